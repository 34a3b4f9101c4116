/**
 * The router's HTTP server: builds the backend pools, the health checker, the metrics and the
 * flow's dependencies, listens with the handler of lib/router/routes.ts, and shuts down with a
 * grace period.
 *
 * Deno.serve (hyper underneath) serves clients; upstream requests go through one `fetch` client
 * with a keep-alive pool, so a steady load reuses connections to every backend. See
 * docs/router.md for the measured overhead.
 *
 * @module
 */

import { BackendPool } from "./backend_pool.ts";
import type { RouterConfig } from "./config.ts";
import { errorResponse, RouterError } from "./errors.ts";
import { describeError, HealthChecker } from "./health.ts";
import { Logger } from "../log.ts";
import { HTTP_CLOSE_WAIT_MS, settlesWithin } from "../http/shutdown.ts";
import { RouterMetrics } from "./metrics.ts";
import type { FlowDeps } from "./pd_flow.ts";
import { createHandler } from "./routes.ts";

/** A running router. */
export interface RouterHandle {
  /** Base URL clients use, e.g. `http://127.0.0.1:8080`. */
  readonly url: string;
  /** The port actually bound (useful with port 0). */
  readonly port: number;
  readonly prefill: BackendPool;
  readonly decode: BackendPool;
  readonly metrics: RouterMetrics;
  /**
   * Stops accepting connections, lets open requests finish for up to `graceMs` (default:
   * `--shutdown-grace`, {@link RouterConfig.shutdownGraceMs}), then cuts the rest and releases
   * timers and connections. Resolves at most ~2 s after the grace period even when a client
   * stalled mid-request keeps its connection (and {@link finished}) open.
   */
  shutdown(graceMs?: number): Promise<void>;
  /** Resolves when the server has stopped. */
  readonly finished: Promise<void>;
}

/**
 * How a router runs as one of several workers serving one port (lib/router/cluster.ts): the main
 * thread runs the health checks and merges the metrics; the workers share the pools' state.
 */
export interface WorkerMembership {
  /** {@link BackendPool.sharedState} of the main thread's prefill pool. */
  prefillState: SharedArrayBuffer;
  /** {@link BackendPool.sharedState} of the main thread's decode pool. */
  decodeState: SharedArrayBuffer;
  /** Answers `GET /metrics` for the whole router (every worker's metrics merged). */
  scrape: () => Promise<Response>;
}

/**
 * Idle keep-alive connections to backends are dropped after this long: shorter than uvicorn's
 * default keep-alive (5 s, what vLLM runs on), so the router does not pick a connection the
 * engine is closing at that moment.
 */
export const UPSTREAM_POOL_IDLE_MS = 4_000;

/**
 * Starts a router: runs one round of health checks (so the first request already sees which
 * backends are up), then listens.
 *
 * @example
 * ```ts
 * const router = await startRouter({ ...config, port: 0 });
 * console.log(router.url);
 * await router.shutdown();
 * ```
 */
export async function startRouter(
  config: RouterConfig,
  log?: Logger,
  worker?: WorkerMembership,
): Promise<RouterHandle> {
  const logger = log ?? new Logger(config.logLevel);
  const prefill = new BackendPool("prefill", config.prefill, worker?.prefillState);
  const decode = new BackendPool("decode", config.decode, worker?.decodeState);
  const metrics = new RouterMetrics([prefill, decode]);
  const client = Deno.createHttpClient({ poolIdleTimeout: UPSTREAM_POOL_IDLE_MS });
  for (const pool of [prefill, decode]) {
    pool.onHealthChange((b, healthy, reason) => {
      logger.debug("backend health changed", { role: b.role, url: b.url, healthy, reason });
    });
  }
  // A worker's health checks are the main thread's (one checker for the whole router).
  const health = worker === undefined
    ? await startHealthChecks(config, [prefill, decode], client, logger)
    : undefined;

  const deps: FlowDeps = {
    prefill,
    decode,
    metrics,
    log: logger,
    client,
    prefillTimeoutMs: config.prefillTimeoutMs,
    decodeTimeoutMs: config.decodeTimeoutMs,
    streamIdleTimeoutMs: config.streamIdleTimeoutMs,
    legacyAbort: await signalAbortsOnSuccess(),
  };
  if (deps.legacyAbort) {
    logger.warn(
      "Deno aborts request signals after successful responses here (legacy behaviour): streams " +
        "cut by their client are counted as served; run with --unstable-no-legacy-abort " +
        "(deno task router does) for exact 499 accounting",
    );
  }
  // Aborted when shutdown's grace period is over: every open upstream request is cut.
  const stopAll = new AbortController();
  const handler = createHandler(deps, config, stopAll.signal, worker?.scrape);

  let server: Deno.HttpServer<Deno.NetAddr>;
  let addr: Deno.NetAddr;
  try {
    ({ server, addr } = await serveRoutes(config, worker !== undefined, handler, logger));
  } catch (e) {
    // Cannot listen (address in use, bad interface): leave nothing running behind.
    await health?.stop();
    client.close();
    throw e;
  }
  const hostForUrl = addr.hostname.includes(":") ? `[${addr.hostname}]` : addr.hostname;
  const url = `http://${hostForUrl}:${addr.port}`;
  logger.info("listening", {
    url,
    port: addr.port,
    prefill: config.prefill.join(","),
    decode: config.decode.join(","),
  });

  let stopping: Promise<void> | undefined;
  const shutdown = (graceMs = config.shutdownGraceMs) =>
    stopping ??= (async () => {
      await health?.stop();
      await drainWithin(server, graceMs, stopAll, logger);
      client.close();
      logger.info("stopped");
    })();
  return {
    url,
    port: addr.port,
    prefill,
    decode,
    metrics,
    shutdown,
    finished: server.finished,
  };
}

/**
 * The router cannot listen on `--host`/`--port`: the address is in use or not on this host, the
 * host name does not resolve, or the port may not be bound by this user. A usage error, not a
 * crash (router.ts exits 2 naming the flags).
 */
export class ListenError extends Error {
  constructor(message: string, options?: ErrorOptions) {
    super(message, options);
    this.name = "ListenError";
  }

  /** `--host`/`--port` could not be bound: the address and the OS's reason. */
  static of(config: Pick<RouterConfig, "host" | "port">, e: unknown): ListenError {
    return new ListenError(`cannot listen on ${config.host}:${config.port}: ${describeError(e)}`, {
      cause: e,
    });
  }
}

/**
 * Listens (`reusePort` for a worker of a multi-threaded router); resolves once bound. Any failure
 * to listen is a {@link ListenError}.
 */
async function serveRoutes(
  config: RouterConfig,
  shared: boolean,
  handler: Deno.ServeHandler<Deno.NetAddr>,
  logger: Logger,
): Promise<{ server: Deno.HttpServer<Deno.NetAddr>; addr: Deno.NetAddr }> {
  let resolveListen!: (addr: Deno.NetAddr) => void;
  const listening = new Promise<Deno.NetAddr>((r) => (resolveListen = r));
  let server: Deno.HttpServer<Deno.NetAddr>;
  try {
    server = Deno.serve({
      hostname: config.host,
      port: config.port,
      // Workers share the port; Linux spreads new connections over their sockets.
      reusePort: shared,
      onListen: (addr) => resolveListen(addr as Deno.NetAddr),
      onError: (e) => {
        logger.error("unhandled error in request handler", { error: describeError(e) });
        return errorResponse(
          new RouterError(500, "server_error", `internal router error: ${describeError(e)}`),
        );
      },
    }, handler);
  } catch (e) {
    throw ListenError.of(config, e);
  }
  return { server, addr: await listening };
}

/**
 * Stops accepting and lets open requests finish for up to `graceMs`; then cuts what is still open
 * (`stopAll`) and waits up to {@link HTTP_CLOSE_WAIT_MS} for the server to end (a client stalled
 * mid-upload may keep it open longer: lib/http/shutdown.ts).
 */
async function drainWithin(
  server: Deno.HttpServer<Deno.NetAddr>,
  graceMs: number,
  stopAll: AbortController,
  logger: Logger,
): Promise<void> {
  const shut = server.shutdown();
  if (await settlesWithin(shut, graceMs)) return;
  logger.warn("shutdown grace period over; cutting open requests", { grace_ms: graceMs });
  stopAll.abort(new DOMException("router shutting down", "AbortError"));
  if (await settlesWithin(shut, HTTP_CLOSE_WAIT_MS)) return;
  logger.warn("connections still open after the cut (a client stalled mid-request); stopping", {
    grace_ms: graceMs,
    wait_ms: HTTP_CLOSE_WAIT_MS,
  });
}

/**
 * Creates the health checker of `pools`, runs one round (so the first request already sees which
 * backends are up; those that are not are logged), and starts the periodic rounds.
 */
export async function startHealthChecks(
  config: RouterConfig,
  pools: readonly BackendPool[],
  client: Deno.HttpClient,
  logger: Logger,
): Promise<HealthChecker> {
  const health = new HealthChecker(pools, {
    intervalMs: config.healthIntervalMs,
    timeoutMs: config.healthTimeoutMs,
    path: config.healthPath,
    client,
    log: logger,
  });
  // Each backend found down is logged once, by the check itself ("backend out of service").
  await health.checkAll();
  health.start();
  return health;
}

/**
 * Probes, once at start, whether Deno.serve aborts `request.signal` after a successful response
 * (Deno's legacy behaviour, unless run with --unstable-no-legacy-abort). The flow needs to know
 * to read "the signal aborted" as "the client left".
 */
async function signalAbortsOnSuccess(): Promise<boolean> {
  let answer!: (legacy: boolean) => void;
  const probed = new Promise<boolean>((r) => (answer = r));
  const probe = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, (req, info) => {
    const signal = req.signal;
    // Deno settles `completed` and, in legacy mode, aborts the signal in the same step; the
    // callback runs after both.
    info.completed.then(() => answer(signal.aborted), () => answer(signal.aborted));
    return new Response("probe");
  });
  try {
    const res = await fetch(`http://127.0.0.1:${probe.addr.port}/`);
    await res.text();
    return await probed;
  } finally {
    await probe.shutdown();
  }
}
