/**
 * The HTTP side of the server (`--http-addr`): health, Prometheus metrics,
 * the instance list and the two operator actions. Plain `Deno.serve`; the
 * request handler is exported separately so it is testable without a socket.
 *
 * | route                        | answer                                           |
 * |------------------------------|--------------------------------------------------|
 * | GET  /health                 | `{"status":"ok","version":..,"backend":..}`      |
 * | GET  /metrics                | Prometheus text (`pegaflow_*`)                   |
 * | GET  /instances              | registered instances (JSON array)                |
 * | POST /instances/cleanup      | body `{"instance_id":"x"}` or `{"all":true}`     |
 * | POST /cache/memory/cleanup   | evicts every unpinned cached block               |
 *
 * HEAD is answered as GET without a body (Deno.serve drops it: `curl -I`
 * probes like a GET); another method on one of these paths is a 405 naming
 * the one it accepts (with `Allow`), any other path a 404 listing the routes.
 *
 * Every request's body, on every route, is read through lib/http/body.ts
 * under {@link MAX_BODY_BYTES}: over it the answer is 413 before the rest is
 * read, a body that cannot be decoded is a 400.
 *
 * @module
 */
import type { KvEngine } from "../engine/engine.ts";
import { PROTOCOL_VERSION } from "../engine/engine.ts";
import type { KvStore } from "../storage/store.ts";
import type { Logger } from "../log.ts";
import { metricsResponse } from "../metrics.ts";
import type { ServerMetrics } from "./metrics.ts";
import { BodyError, CLOSE_AFTER_REFUSAL, readBodyLimited } from "../http/body.ts";

/** Largest body any endpoint reads: the operator endpoints take one small JSON object. */
export const MAX_BODY_BYTES = 64 * 1024;

/** The method each route answers; another method on one of these paths is a 405, not a 404. */
const ROUTE_METHODS: ReadonlyMap<string, "GET" | "POST"> = new Map([
  ["/health", "GET"],
  ["/metrics", "GET"],
  ["/instances", "GET"],
  ["/instances/cleanup", "POST"],
  ["/cache/memory/cleanup", "POST"],
]);

function json(status: number, body: unknown, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body, null, 1) + "\n", {
    status,
    headers: { "content-type": "application/json", ...headers },
  });
}

/** 405 (with `Allow`) for a served path under another method, else 404. */
function noRoute(method: string, path: string): Response {
  const allowed = ROUTE_METHODS.get(path);
  if (allowed === undefined) {
    const routes = [...ROUTE_METHODS].map(([p, m]) => `${m} ${p}`);
    return json(404, { error: `no route ${method} ${path}`, routes });
  }
  return json(405, { error: `${path} only accepts ${allowed}` }, {
    allow: allowed === "GET" ? "GET, HEAD" : allowed,
  });
}

const decoder = new TextDecoder("utf-8", { fatal: true });

function parseJsonObject(body: Uint8Array): Record<string, unknown> {
  const text = decoder.decode(body);
  if (text.trim() === "") return {};
  const v = JSON.parse(text);
  if (typeof v !== "object" || v === null || Array.isArray(v)) {
    throw new Error("body must be a JSON object");
  }
  return v as Record<string, unknown>;
}

/**
 * Builds the HTTP handler.
 *
 * @example
 * ```ts
 * Deno.serve({ port: 9091 }, httpHandler({ engine, store, metrics, log, cleanup }));
 * ```
 */
export function httpHandler(deps: {
  engine: KvEngine;
  store: KvStore;
  metrics: ServerMetrics;
  log: Logger;
  /**
   * Cleans one instance up the way a lost session does; fences it (KvEngine.unregister)
   * before its first await, so cleanups started together each hold their instance.
   */
  cleanup: (instanceId: string, reason: string) => Promise<number>;
}): (req: Request) => Promise<Response> {
  const { engine, store, metrics, log } = deps;
  return async (req) => {
    const url = new URL(req.url);
    const route = `${req.method === "HEAD" ? "GET" : req.method} ${url.pathname}`;
    let body: Uint8Array;
    try {
      body = await readBodyLimited(req, { maxBytes: MAX_BODY_BYTES });
    } catch (e) {
      if (!(e instanceof BodyError)) throw e;
      log.warn("http request body refused", { route, status: e.status, error: e.message });
      return json(e.status, { error: e.message, code: e.code }, CLOSE_AFTER_REFUSAL);
    }
    try {
      switch (route) {
        case "GET /health":
          return json(200, { status: "ok", version: PROTOCOL_VERSION, backend: engine.backend });
        case "GET /metrics":
          return await metricsResponse(metrics.registry);
        case "GET /instances":
          return json(200, {
            instances: engine.instances(),
            stages: engine.stageStats(),
            store: store.stats(),
          });
        case "POST /instances/cleanup": {
          let args;
          try {
            args = parseJsonObject(body);
          } catch (e) {
            return json(400, { error: `invalid body: ${(e as Error).message}` });
          }
          const ids = args.all === true
            ? engine.instances().map((i) => i.instanceId)
            : typeof args.instance_id === "string"
            ? [args.instance_id]
            : null;
          if (!ids) return json(400, { error: 'expected {"instance_id": "..."} or {"all": true}' });
          const unknown = ids.filter((id) => !engine.has(id));
          if (unknown.length > 0) {
            return json(404, { error: `instance "${unknown[0]}" is not registered` });
          }
          // Every cleanup starts now, in this turn: each fences its instance before
          // the first await, so none is left to vanish (a session dropping) or to be
          // registered anew under its id while an earlier one drains.
          const leases = await Promise.all(ids.map((id) => deps.cleanup(id, "http_cleanup")));
          const cleaned = ids.map((id, i) => ({ instance_id: id, leases_released: leases[i] }));
          // Ids follow the name rule ([A-Za-z0-9._-]): a comma separates them.
          log.info("instances cleaned up over HTTP", {
            count: cleaned.length,
            instances: ids.join(","),
          });
          return json(200, { cleaned });
        }
        case "POST /cache/memory/cleanup": {
          const before = store.stats().usedBytes;
          const blocks = store.evictAll();
          const freed = before - store.stats().usedBytes;
          log.info("cache memory cleanup", { blocks_evicted: blocks, bytes_freed: freed });
          return json(200, { blocks_evicted: blocks, bytes_freed: freed, stats: store.stats() });
        }
        default:
          return noRoute(req.method, url.pathname);
      }
    } catch (e) {
      log.error("http handler failed", { route, error: String((e as Error)?.stack ?? e) });
      return json(500, { error: (e as Error).message });
    }
  };
}
