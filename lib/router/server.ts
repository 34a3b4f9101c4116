/**
 * The router's HTTP server: routes, request intake, and the glue between the P/D flow, the
 * backend pools, the health checker and the metrics.
 *
 * Deno.serve (hyper underneath) serves clients; upstream requests go through one `fetch` client
 * with a keep-alive pool, so a steady load reuses connections to every backend. See
 * docs/router.md for the measured overhead.
 *
 * @module
 */

import { metricsResponse } from "../metrics.ts";
import { BackendPool } from "./backend_pool.ts";
import type { RouterConfig } from "./config.ts";
import { errorResponse, RouterError } from "./errors.ts";
import { describeError, HealthChecker } from "./health.ts";
import { Logger } from "../log.ts";
import { RouterMetrics } from "./metrics.ts";
import { checkCapacity, ClientGone, type FlowDeps, runDecode, runPrefill } from "./pd_flow.ts";
import {
  type GenerationRoute,
  parseGenerationRequest,
  readRequestBody,
  refusalResponse,
} from "./validate.ts";

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
   * Stops accepting connections, lets open requests finish for up to `graceMs`, then cuts the
   * rest and releases timers and connections.
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

/** Client-supplied request ids are passed to engines and logs: keep them short and printable. */
const REQUEST_ID_RE = /^[\x21-\x7e]{1,256}$/;
const DEFAULT_SHUTDOWN_GRACE_MS = 10_000;
/**
 * Idle keep-alive connections to backends are dropped after this long: shorter than uvicorn's
 * default keep-alive (5 s, what vLLM runs on), so the router does not pick a connection the
 * engine is closing at that moment.
 */
export const UPSTREAM_POOL_IDLE_MS = 4_000;
/** Status recorded when the client disconnected before the answer was complete (nginx's code). */
const CLIENT_CLOSED_STATUS = "499";

const GENERATION_ROUTES: ReadonlySet<string> = new Set([
  "/v1/completions",
  "/v1/chat/completions",
]);

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

  let resolveListen!: (addr: Deno.NetAddr) => void;
  const listening = new Promise<Deno.NetAddr>((r) => (resolveListen = r));
  let server: Deno.HttpServer<Deno.NetAddr>;
  try {
    server = Deno.serve({
      hostname: config.host,
      port: config.port,
      // Workers share the port; Linux spreads new connections over their sockets.
      reusePort: worker !== undefined,
      onListen: (addr) => resolveListen(addr as Deno.NetAddr),
      onError: (e) => {
        logger.error("unhandled error in request handler", { error: describeError(e) });
        return errorResponse(
          new RouterError(500, "server_error", `internal router error: ${describeError(e)}`),
        );
      },
    }, handler);
  } catch (e) {
    // Cannot listen (address in use, bad interface): leave nothing running behind.
    await health?.stop();
    client.close();
    throw e;
  }
  const addr = await listening;
  const hostForUrl = addr.hostname.includes(":") ? `[${addr.hostname}]` : addr.hostname;
  const url = `http://${hostForUrl}:${addr.port}`;
  logger.info("listening", {
    url,
    port: addr.port,
    prefill: config.prefill.join(","),
    decode: config.decode.join(","),
  });

  let stopping: Promise<void> | undefined;
  const shutdown = (graceMs = DEFAULT_SHUTDOWN_GRACE_MS) => {
    stopping ??= (async () => {
      await health?.stop();
      let timer: ReturnType<typeof setTimeout> | undefined;
      const grace = new Promise<"timeout">((
        r,
      ) => (timer = setTimeout(() => r("timeout"), graceMs)));
      const shut = server.shutdown();
      const result = await Promise.race([shut.then(() => "done" as const), grace]);
      clearTimeout(timer);
      if (result === "timeout") {
        logger.warn("shutdown grace period over; cutting open requests", { grace_ms: graceMs });
        stopAll.abort(new DOMException("router shutting down", "AbortError"));
      }
      await shut;
      client.close();
      logger.info("stopped");
    })();
    return stopping;
  };
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
  await health.checkAll();
  for (const pool of pools) {
    for (const b of pool.backends) {
      if (!b.healthy) {
        logger.warn("backend out of service at start", {
          role: b.role,
          url: b.url,
          reason: b.lastError,
        });
      }
    }
  }
  health.start();
  return health;
}

/**
 * Builds the request handler (exported for embedding the router in another Deno.serve).
 * `scrape` answers `GET /metrics` instead of this router's own registry (a worker's: the whole
 * router's metrics).
 */
export function createHandler(
  deps: FlowDeps,
  config: RouterConfig,
  stopSignal: AbortSignal,
  scrape?: () => Promise<Response>,
): (req: Request, info: Deno.ServeHandlerInfo) => Promise<Response> {
  const { metrics } = deps;
  return async (req, info) => {
    const path = pathOf(req.url);
    const generation = GENERATION_ROUTES.has(path);
    if (generation && req.method === "POST") {
      return await handleGeneration(deps, config, req, info, path as GenerationRoute, stopSignal);
    }
    // No other route takes a body, but every route holds one to --max-body (read and dropped).
    if (req.body !== null) {
      try {
        await readRequestBody(req, config.maxBodyBytes);
      } catch (e) {
        if (!(e instanceof RouterError)) throw e;
        deps.log.warn("refused request body", { path, status: e.status, reason: e.message });
        return refusalResponse(e);
      }
    }
    if (generation) return methodNotAllowed(path, "POST");
    switch (path) {
      case "/v1/models":
        if (req.method !== "GET") return methodNotAllowed(path, "GET");
        return await handleModels(deps, config, req);
      case "/health":
        if (req.method !== "GET") return methodNotAllowed(path, "GET");
        return handleHealth(deps);
      case "/metrics":
        if (req.method !== "GET") return methodNotAllowed(path, "GET");
        return scrape === undefined ? await metricsResponse(metrics.registry) : await scrape();
      default:
        return errorResponse(
          new RouterError(
            404,
            "invalid_request_error",
            `no route ${req.method} ${path}; the router serves POST /v1/completions, ` +
              `POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics`,
            null,
            "not_found",
          ),
        );
    }
  };
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

/** The path of a request URL without parsing the whole URL (this runs on every request). */
function pathOf(url: string): string {
  const start = url.indexOf("/", url.indexOf("//") + 2);
  if (start < 0) return "/";
  let end = url.length;
  const q = url.indexOf("?", start);
  if (q >= 0) end = q;
  const h = url.indexOf("#", start);
  if (h >= 0 && h < end) end = h;
  return url.slice(start, end);
}

function methodNotAllowed(path: string, allowed: string): Response {
  const res = errorResponse(
    new RouterError(
      405,
      "invalid_request_error",
      `${path} only accepts ${allowed}`,
      null,
      "method_not_allowed",
    ),
  );
  res.headers.set("allow", allowed);
  return res;
}

async function handleGeneration(
  deps: FlowDeps,
  config: RouterConfig,
  req: Request,
  info: Deno.ServeHandlerInfo,
  route: GenerationRoute,
  stopSignal: AbortSignal,
): Promise<Response> {
  const { metrics, log } = deps;
  const t0 = performance.now();
  const finish = (status: number | string) => {
    metrics.requests.inc({ route, status: String(status) });
    metrics.requestSeconds.observe({ route }, (performance.now() - t0) / 1000);
  };

  const given = req.headers.get("x-request-id");
  let requestId: string;
  if (given === null || given === "") {
    requestId = crypto.randomUUID();
  } else if (!REQUEST_ID_RE.test(given)) {
    const err = new RouterError(
      400,
      "invalid_request_error",
      "X-Request-Id must be 1-256 printable ASCII characters without spaces",
      null,
      "invalid_request_id",
    );
    finish(err.status);
    return errorResponse(err);
  } else {
    requestId = given;
  }

  let parsed;
  try {
    parsed = parseGenerationRequest(route, await readRequestBody(req, config.maxBodyBytes));
  } catch (e) {
    if (!(e instanceof RouterError)) throw e;
    // A body the HTTP layer could not decode says something is wrong with a client (or a proxy in
    // front): worth a warning. Validation refusals are routine and stay at debug.
    const level = e.code === "malformed_body" ? "warn" : "debug";
    log[level]("refused request", { request_id: requestId, code: e.code, reason: e.message });
    finish(e.status);
    return refusalResponse(e, requestId);
  }

  metrics.inflight.inc();
  // One signal for "stop working on this request": the client left or shutdown cut it. The
  // listeners come off before the response completes, because Deno also aborts req.signal after
  // a successful response and must not find work still attached to it.
  const cancel = new AbortController();
  const onGone = () => cancel.abort(new DOMException("client disconnected", "AbortError"));
  req.signal.addEventListener("abort", onGone, { once: true });
  stopSignal.addEventListener("abort", onGone, { once: true });
  const detach = () => {
    req.signal.removeEventListener("abort", onGone);
    stopSignal.removeEventListener("abort", onGone);
  };
  let relayStarted = false;
  try {
    const ctx = {
      requestId,
      signal: cancel.signal,
      authorization: req.headers.get("authorization"),
      completed: () => info.completed,
    };
    checkCapacity(deps);
    const pre = await runPrefill(deps, parsed, ctx);
    if (pre.kind === "refused") {
      finish(pre.status);
      return new Response(pre.body, {
        status: pre.status,
        headers: { "content-type": pre.contentType, "x-request-id": requestId },
      });
    }
    const res = await runDecode(deps, parsed, pre.kvTransferParams, ctx, (status, outcome) => {
      detach();
      metrics.inflight.dec();
      finish(outcome === "client_gone" ? CLIENT_CLOSED_STATUS : status);
      log.debug("request done", { request_id: requestId, status, outcome });
    });
    relayStarted = true;
    return res;
  } catch (e) {
    if (e instanceof ClientGone) {
      log.debug("client disconnected", { request_id: requestId, reason: e.message });
      finish(CLIENT_CLOSED_STATUS);
      return new Response(null, { status: Number(CLIENT_CLOSED_STATUS) });
    }
    if (e instanceof RouterError) {
      log.warn("request failed", { request_id: requestId, status: e.status, reason: e.message });
      finish(e.status);
      return errorResponse(e, requestId);
    }
    throw e;
  } finally {
    if (!relayStarted) {
      detach();
      metrics.inflight.dec();
    }
  }
}

interface ModelEntry {
  id: string;
  [k: string]: unknown;
}

/** GET /v1/models: the union (by id) of what every healthy backend serves. */
async function handleModels(
  deps: FlowDeps,
  config: RouterConfig,
  req: Request,
): Promise<Response> {
  const backends = [...deps.decode.backends, ...deps.prefill.backends].filter((b) => b.healthy);
  const auth = req.headers.get("authorization");
  const headers: HeadersInit = auth === null ? {} : { authorization: auth };
  const failures: string[] = [];
  const lists = await Promise.all(backends.map(async (b) => {
    try {
      const res = await fetch(`${b.url}/v1/models`, {
        headers,
        client: deps.client,
        signal: AbortSignal.timeout(config.healthTimeoutMs),
      });
      if (!res.ok) {
        failures.push(`${b.url}: HTTP ${res.status}`);
        await res.body?.cancel();
        return [];
      }
      const json = await res.json() as { data?: unknown };
      if (!Array.isArray(json.data)) {
        failures.push(`${b.url}: answer has no 'data' array`);
        return [];
      }
      return json.data.filter((m): m is ModelEntry =>
        typeof m === "object" && m !== null && typeof (m as ModelEntry).id === "string"
      );
    } catch (e) {
      failures.push(`${b.url}: ${describeError(e)}`);
      return [];
    }
  }));
  const nothingListed = lists.every((l) => l.length === 0);
  if (backends.length === 0 || (nothingListed && failures.length > 0)) {
    return errorResponse(
      new RouterError(
        503,
        "server_error",
        `no backend could list its models: ${
          failures.length > 0 ? failures.join("; ") : "no backend is in service"
        }`,
        null,
        "models_unavailable",
      ),
    );
  }
  if (failures.length > 0) {
    deps.log.warn("some backends could not list their models", { failures: failures.join("; ") });
  }
  const byId = new Map<string, ModelEntry>();
  for (const list of lists) for (const m of list) if (!byId.has(m.id)) byId.set(m.id, m);
  return Response.json({ object: "list", data: [...byId.values()] });
}

/** GET /health: 200 when at least one P and one D are in service, else 503; body details both. */
function handleHealth(deps: FlowDeps): Response {
  const describe = (pool: BackendPool) => ({
    healthy: pool.healthyCount(),
    total: pool.backends.length,
    backends: pool.backends.map((b) => ({
      url: b.url,
      healthy: b.healthy,
      inflight: b.inflight,
      error: b.lastError,
    })),
  });
  const ok = deps.prefill.healthyCount() > 0 && deps.decode.healthyCount() > 0;
  return Response.json(
    {
      status: ok ? "ok" : "unavailable",
      prefill: describe(deps.prefill),
      decode: describe(deps.decode),
    },
    { status: ok ? 200 : 503 },
  );
}
