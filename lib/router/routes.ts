/**
 * The router's request handler: the routes, request intake (request id, body, validation), one
 * generation request through the P/D flow with its metrics and 499 accounting, and the
 * `/v1/models`, `/health` and `/metrics` answers. lib/router/server.ts listens and wires it.
 *
 * @module
 */

import { metricsResponse } from "../metrics.ts";
import type { BackendPool } from "./backend_pool.ts";
import type { RouterConfig } from "./config.ts";
import { ClientGone, errorResponse, RouterError } from "./errors.ts";
import { describeError } from "./health.ts";
import { ShutdownCut } from "./upstream.ts";
import { checkCapacity, type FlowDeps, runDecode, runPrefill } from "./pd_flow.ts";
import {
  type GenerationRoute,
  parseGenerationRequest,
  readRequestBody,
  refusalResponse,
} from "./validate.ts";

/** Client-supplied request ids are passed to engines and logs: keep them short and printable. */
const REQUEST_ID_RE = /^[\x21-\x7e]{1,256}$/;
/** Status recorded when the client disconnected before the answer was complete (nginx's code). */
const CLIENT_CLOSED_STATUS = "499";

const GENERATION_ROUTES: ReadonlySet<string> = new Set([
  "/v1/completions",
  "/v1/chat/completions",
]);

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

  const requestId = requestIdOf(req);
  if (requestId instanceof RouterError) {
    finish(requestId.status);
    return errorResponse(requestId);
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
  const { signal, detach } = stopWorkSignal(req.signal, stopSignal);
  let relayStarted = false;
  try {
    const ctx = {
      requestId,
      signal,
      authorization: req.headers.get("authorization"),
      completed: () => info.completed,
    };
    checkCapacity(deps, requestId);
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
    return failureResponse(e, requestId, log, finish);
  } finally {
    if (!relayStarted) {
      detach();
      metrics.inflight.dec();
    }
  }
}

/** The request's X-Request-Id, a new one when it has none, or the refusal of a bad one. */
function requestIdOf(req: Request): string | RouterError {
  const given = req.headers.get("x-request-id");
  if (given === null || given === "") return crypto.randomUUID();
  if (REQUEST_ID_RE.test(given)) return given;
  return new RouterError(
    400,
    "invalid_request_error",
    "X-Request-Id must be 1-256 printable ASCII characters without spaces",
    null,
    "invalid_request_id",
  );
}

/**
 * One signal for "stop working on this request": the client left, or shutdown
 * cut it (then its reason is a {@link ShutdownCut}, so the client, still
 * there, is told so instead of being counted as gone). A signal aborted
 * already counts at once. `detach` takes the listeners off before the
 * response completes, because Deno also aborts req.signal after a successful
 * response and must not find work still attached to it.
 */
function stopWorkSignal(
  clientSignal: AbortSignal,
  stopSignal: AbortSignal,
): { signal: AbortSignal; detach: () => void } {
  const cancel = new AbortController();
  const onGone = () => cancel.abort(new DOMException("client disconnected", "AbortError"));
  const onStop = () => cancel.abort(new ShutdownCut());
  if (clientSignal.aborted) onGone();
  else if (stopSignal.aborted) onStop();
  clientSignal.addEventListener("abort", onGone, { once: true });
  stopSignal.addEventListener("abort", onStop, { once: true });
  const detach = () => {
    clientSignal.removeEventListener("abort", onGone);
    stopSignal.removeEventListener("abort", onStop);
  };
  return { signal: cancel.signal, detach };
}

/** The answer to a flow that threw: 499 for a client that left, the error for a refusal. */
function failureResponse(
  e: unknown,
  requestId: string,
  log: FlowDeps["log"],
  finish: (status: number | string) => void,
): Response {
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
