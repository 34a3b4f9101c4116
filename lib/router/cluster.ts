/**
 * A router served by several threads (`--workers N`): N Deno Workers, each with its own event
 * loop and `Deno.serve({ reusePort: true })` on the same port, so Linux spreads client
 * connections over them and the native piping of the streams runs on N threads, not one.
 *
 * What stays one router:
 * - **Backend state.** Each pool's inflight counts, healthy flags and tie-breaking cursor live in
 *   one SharedArrayBuffer, updated with Atomics by every worker: least-inflight selection sees the
 *   whole router's load, and a backend taken out by any thread is out for all at once.
 * - **Health checks.** One checker, on this (main) thread; it flips the shared flags and tells
 *   the workers the reason (for `/health`). A worker's request path that takes a backend out
 *   (a refused connection) reports it here, and the reason is passed on to the other workers.
 * - **Metrics.** `GET /metrics` on any worker asks this thread, which collects every worker's
 *   `getMetricsAsJSON()` and merges them with prom-client's `AggregatorRegistry.aggregate`
 *   (counters and histograms summed; the gauges that read shared state taken once).
 * - **Shutdown.** `shutdown()` stops the health checks and has every worker stop accepting and
 *   let its open requests finish (the same grace as a single-threaded router).
 *
 * @module
 */

import { AggregatorRegistry } from "prom-client";
import { type Backend, BackendPool } from "./backend_pool.ts";
import type { RouterConfig } from "./config.ts";
import type { FromWorker, ToWorker } from "./cluster_protocol.ts";
import type { HealthChecker } from "./health.ts";
import { Logger } from "../log.ts";
import { ListenError, startHealthChecks, UPSTREAM_POOL_IDLE_MS } from "./server.ts";
import { HTTP_CLOSE_WAIT_MS, settlesWithin } from "../http/shutdown.ts";

/** A worker that has not sent its metrics by then is left out of that scrape (and it fails). */
const SCRAPE_TIMEOUT_MS = 5_000;
const WORKER_URL = new URL("./worker.ts", import.meta.url).href;

/** A running multi-threaded router. */
export interface ClusterHandle {
  /** Base URL clients use, e.g. `http://127.0.0.1:8080`. */
  readonly url: string;
  /** The port every worker serves. */
  readonly port: number;
  /** The main thread's view of the pools (the same shared state the workers use). */
  readonly prefill: BackendPool;
  readonly decode: BackendPool;
  /** Every worker stops accepting and lets open requests finish for up to `graceMs`. */
  shutdown(graceMs?: number): Promise<void>;
  /** Resolves when every worker has stopped; rejects if a worker failed. */
  readonly finished: Promise<void>;
}

interface Member {
  worker: Worker;
  index: number;
  started: Promise<{ url: string; port: number }>;
  stopped: Promise<void>;
}

/** What the main thread shares with the code that spawns and answers its workers. */
interface Cluster {
  config: RouterConfig;
  logger: Logger;
  prefill: BackendPool;
  decode: BackendPool;
  members: Member[];
  metrics: MetricsMerge;
  /** Rejects `finished` (a worker failed). */
  fail(e: Error): void;
}

const poolOf = (c: Cluster, role: "prefill" | "decode") =>
  role === "prefill" ? c.prefill : c.decode;

function broadcast(c: Cluster, m: ToWorker, except?: Member): void {
  for (const w of c.members) if (w !== except) w.worker.postMessage(m);
}

/**
 * One `GET /metrics`: every worker's `getMetricsAsJSON()` collected and merged
 * with prom-client's `AggregatorRegistry.aggregate` (counters and histograms
 * summed); fails when a worker sends nothing within {@link SCRAPE_TIMEOUT_MS}.
 */
class MetricsMerge {
  #next = 0;
  readonly #collects = new Map<number, { parts: unknown[]; received: number; done: () => void }>();

  constructor(readonly cluster: () => Cluster) {}

  async merged(): Promise<{ text: string; contentType: string }> {
    const c = this.cluster();
    const id = this.#next++;
    const parts: unknown[] = [];
    let timer: ReturnType<typeof setTimeout> | undefined;
    try {
      await new Promise<void>((resolve, reject) => {
        this.#collects.set(id, { parts, received: 0, done: resolve });
        timer = setTimeout(() => {
          const missing = c.members.length - (this.#collects.get(id)?.received ?? 0);
          reject(
            new Error(
              `${missing} of ${c.members.length} workers sent no metrics within ${SCRAPE_TIMEOUT_MS} ms`,
            ),
          );
        }, SCRAPE_TIMEOUT_MS);
        broadcast(c, { type: "collect", id });
      });
    } finally {
      clearTimeout(timer);
      this.#collects.delete(id);
    }
    // Each part is one worker's getMetricsAsJSON(), which is what aggregate() merges.
    const merged = AggregatorRegistry.aggregate(
      parts as Parameters<typeof AggregatorRegistry.aggregate>[0],
    );
    return { text: await merged.metrics(), contentType: merged.contentType };
  }

  /** A worker's part of scrape `id` arrived. */
  received(id: number, json: unknown): void {
    const c = this.#collects.get(id);
    if (c === undefined) return; // that scrape timed out already
    c.parts.push(json);
    if (++c.received >= this.cluster().members.length) c.done();
  }
}

/** Beyond a worker's own bounded drain, how long its "stopped" may take to arrive. */
const WORKER_STOP_SLACK_MS = 1_000;

/** A worker's start failure as the error class the main thread would have thrown. */
function startError(name: string, message: string): Error {
  return name === "ListenError" ? new ListenError(message) : new Error(message);
}

/** A worker saw a backend's health change: keep the reason and tell the other workers. */
function passOnHealth(c: Cluster, m: Extract<FromWorker, { type: "health" }>, from: Member): void {
  // The worker already flipped the shared flag; a health round may have flipped it back
  // since (a backend up again): the flag as it is now decides, never a stale reason on a
  // healthy backend that no later round would clear.
  const b = poolOf(c, m.backend.role).backends[m.backend.index];
  b.lastError = b.healthy ? null : m.reason;
  broadcast(c, {
    type: "health",
    backend: m.backend,
    healthy: b.healthy,
    error: b.lastError,
  }, from);
}

/** A worker was scraped: answer it with every worker's metrics merged. */
function answerScrape(c: Cluster, worker: Worker, id: number): void {
  c.metrics.merged().then(
    (r) => worker.postMessage({ type: "scraped", id, ...r } satisfies ToWorker),
    (e) =>
      worker.postMessage(
        { type: "scrape-failed", id, error: String(e?.message ?? e) } satisfies ToWorker,
      ),
  );
}

/** Starts worker `index` on `port` (0: pick one) and wires its messages. */
function spawnWorker(c: Cluster, index: number, port: number): Member {
  const worker = new Worker(WORKER_URL, { type: "module", name: `router-worker-${index}` });
  let onStart!: (a: { url: string; port: number }) => void;
  let onStartFailed!: (e: Error) => void;
  let onStopped!: () => void;
  const member: Member = {
    worker,
    index,
    started: new Promise((res, rej) => {
      onStart = res;
      onStartFailed = rej;
    }),
    stopped: new Promise<void>((res) => (onStopped = res)),
  };
  worker.onmessage = (ev: MessageEvent<FromWorker>) => {
    const m = ev.data;
    switch (m.type) {
      case "listening":
        onStart({ url: m.url, port: m.port });
        return;
      case "start-failed":
        onStartFailed(startError(m.name, m.message));
        return;
      case "health":
        passOnHealth(c, m, member);
        return;
      case "scrape":
        answerScrape(c, worker, m.id);
        return;
      case "metrics":
        c.metrics.received(m.id, m.json);
        return;
      case "stopped":
        onStopped();
        return;
    }
  };
  worker.onerror = (ev) => {
    ev.preventDefault();
    const e = new Error(`router worker ${index} failed: ${ev.message}`);
    c.logger.error("router worker failed", { worker: index, error: ev.message });
    onStartFailed(e);
    c.fail(e);
  };
  worker.postMessage(
    {
      type: "start",
      worker: index,
      config: { ...c.config, port },
      prefillState: c.prefill.sharedState,
      decodeState: c.decode.sharedState,
      // Backends out since before this worker existed: it was not there to be told why.
      lastErrors: {
        prefill: c.prefill.backends.map((b) => b.lastError),
        decode: c.decode.backends.map((b) => b.lastError),
      },
    } satisfies ToWorker,
  );
  c.members.push(member);
  return member;
}

/**
 * Refuses a port another process listens on. The workers bind with SO_REUSEPORT, which Linux
 * lets any process of the same user share: a second router on the port did not fail, it took half
 * of the first one's clients. A plain bind (then closed) fails on any listener there. Port 0 is
 * skipped (the first worker picks a free one).
 */
function portFree(config: RouterConfig): void {
  if (config.port === 0) return;
  try {
    Deno.listen({ hostname: config.host, port: config.port }).close();
  } catch (e) {
    throw ListenError.of(config, e);
  }
}

/**
 * Starts `config.workers` worker threads serving `config.host:config.port`. The first one binds
 * (so port 0 picks one free port), the others join it on that port. Rejects — leaving nothing
 * running — when a worker cannot listen, with the worker's error (a `ListenError`).
 *
 * @example
 * ```ts
 * const router = await startRouterCluster({ ...config, workers: 4 });
 * console.log(router.url);
 * await router.shutdown();
 * ```
 */
export async function startRouterCluster(
  config: RouterConfig,
  log?: Logger,
): Promise<ClusterHandle> {
  const logger = log ?? new Logger(config.logLevel);
  let failed: ((e: Error) => void) | undefined;
  const failure = new Promise<never>((_, reject) => (failed = reject));
  // A rejection nobody awaits yet must not end the process on its own: finished reports it.
  failure.catch(() => {});
  const c: Cluster = {
    config,
    logger,
    prefill: new BackendPool("prefill", config.prefill),
    decode: new BackendPool("decode", config.decode),
    members: [],
    metrics: new MetricsMerge(() => c),
    fail: (e) => failed?.(e),
  };
  const { prefill, decode, members } = c;
  const refOf = (b: Backend) => ({ role: b.role, index: poolOf(c, b.role).backends.indexOf(b) });
  for (const pool of [prefill, decode]) {
    pool.onHealthChange((b, healthy, reason) => {
      logger.debug("backend health changed", { role: b.role, url: b.url, healthy, reason });
      broadcast(c, { type: "health", backend: refOf(b), healthy, error: b.lastError });
    });
    // Still out, for another reason (a later health round): /health on every worker says so.
    pool.onReasonChange((b) => {
      broadcast(c, { type: "health", backend: refOf(b), healthy: false, error: b.lastError });
    });
  }

  portFree(config);
  const client = Deno.createHttpClient({ poolIdleTimeout: UPSTREAM_POOL_IDLE_MS });
  let health: HealthChecker | undefined;
  let first: { url: string; port: number };
  try {
    health = await startHealthChecks(config, [prefill, decode], client, logger);
    // The first worker binds (port 0 becomes a real port); the others join it there.
    first = await spawnWorker(c, 0, config.port).started;
    const rest: Member[] = [];
    for (let i = 1; i < config.workers; i++) rest.push(spawnWorker(c, i, first.port));
    await Promise.all(rest.map((m) => m.started));
  } catch (e) {
    for (const m of members) m.worker.terminate();
    await health?.stop();
    client.close();
    throw e;
  }
  logger.info("router workers listening", { url: first.url, workers: config.workers });

  let resolveFinished!: () => void;
  const stoppedAll = new Promise<void>((r) => (resolveFinished = r));
  let stopping: Promise<void> | undefined;
  const shutdown = (graceMs = config.shutdownGraceMs) => {
    stopping ??= (async () => {
      await health?.stop();
      broadcast(c, { type: "shutdown", graceMs });
      // Each worker's drain is bounded (its grace, then the HTTP close wait); a worker whose
      // event loop is stuck would never say "stopped": past the sum, it is terminated.
      const limitMs = graceMs + HTTP_CLOSE_WAIT_MS + WORKER_STOP_SLACK_MS;
      if (!(await settlesWithin(Promise.all(members.map((m) => m.stopped)), limitMs))) {
        logger.warn("router workers did not stop in time; terminating them", { wait_ms: limitMs });
      }
      for (const m of members) m.worker.terminate();
      client.close();
      resolveFinished();
    })();
    return stopping;
  };
  const finished = Promise.race([stoppedAll, failure]).catch(async (e) => {
    for (const m of members) m.worker.terminate();
    await health?.stop();
    client.close();
    throw e;
  });
  return { url: first.url, port: first.port, prefill, decode, shutdown, finished };
}
