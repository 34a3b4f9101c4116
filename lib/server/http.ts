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
 * @module
 */
import type { KvEngine } from "../engine/engine.ts";
import { PROTOCOL_VERSION } from "../engine/engine.ts";
import type { KvStore } from "../storage/store.ts";
import type { Logger } from "../log.ts";
import { metricsResponse } from "../metrics.ts";
import type { ServerMetrics } from "./metrics.ts";

/** Largest JSON body the operator endpoints read. */
const MAX_BODY_BYTES = 64 * 1024;

function json(status: number, body: unknown): Response {
  return new Response(JSON.stringify(body, null, 1) + "\n", {
    status,
    headers: { "content-type": "application/json" },
  });
}

async function readJson(req: Request): Promise<Record<string, unknown>> {
  const text = await req.text();
  if (text.length > MAX_BODY_BYTES) throw new Error(`body over ${MAX_BODY_BYTES} bytes`);
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
  /** Cleans one instance up the way a lost session does. */
  cleanup: (instanceId: string, reason: string) => Promise<number>;
}): (req: Request) => Promise<Response> {
  const { engine, store, metrics, log } = deps;
  return async (req) => {
    const url = new URL(req.url);
    const route = `${req.method} ${url.pathname}`;
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
          let body;
          try {
            body = await readJson(req);
          } catch (e) {
            return json(400, { error: `invalid body: ${(e as Error).message}` });
          }
          const ids = body.all === true
            ? engine.instances().map((i) => i.instanceId)
            : typeof body.instance_id === "string"
            ? [body.instance_id]
            : null;
          if (!ids) return json(400, { error: 'expected {"instance_id": "..."} or {"all": true}' });
          const unknown = ids.filter((id) => !engine.has(id));
          if (unknown.length > 0) {
            return json(404, { error: `instance "${unknown[0]}" is not registered` });
          }
          const cleaned = [];
          for (const id of ids) {
            const leases = await deps.cleanup(id, "http_cleanup");
            cleaned.push({ instance_id: id, leases_released: leases });
          }
          log.info("instances cleaned up over HTTP", { count: cleaned.length });
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
          return json(404, { error: `no route ${route}` });
      }
    } catch (e) {
      log.error("http handler failed", { route, error: String((e as Error)?.stack ?? e) });
      return json(500, { error: (e as Error).message });
    }
  };
}
