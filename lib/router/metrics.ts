/**
 * Prometheus metrics of the router (prom-client), all prefixed `pegaflow_router_`.
 *
 * Each router owns its own registry rather than prom-client's global one, so several routers can
 * live in one process (tests, embedders) without colliding. Gauges that mirror pool state are
 * computed at scrape time from the pools instead of being updated on every request.
 *
 * @module
 */

import client from "prom-client";
import { counter, gauge, histogram } from "../metrics.ts";
import type { BackendPool } from "./backend_pool.ts";

/** Latency buckets in seconds: sub-millisecond router work up to minute-long generations. */
const LATENCY_BUCKETS = [
  0.0005,
  0.001,
  0.0025,
  0.005,
  0.01,
  0.025,
  0.05,
  0.1,
  0.25,
  0.5,
  1,
  2.5,
  5,
  10,
  30,
  60,
  120,
  300,
];

/**
 * The router's metric set.
 *
 * @example
 * ```ts
 * const m = new RouterMetrics([prefillPool, decodePool]);
 * m.requests.inc({ route: "/v1/completions", status: "200" });
 * const text = await m.registry.metrics();
 * ```
 */
export class RouterMetrics {
  /** The registry `/metrics` renders. */
  readonly registry: client.Registry;
  /** Requests answered, by route and HTTP status (`499` = client went away first). */
  readonly requests: client.Counter<"route" | "status">;
  /** Prefill round trip (request sent → P's full response read), by backend. */
  readonly prefillSeconds: client.Histogram<"backend">;
  /** Decode time to first byte (request sent → first body chunk), by backend. */
  readonly decodeTtfbSeconds: client.Histogram<"backend">;
  /** Client request received → last byte sent, by route. */
  readonly requestSeconds: client.Histogram<"route">;
  /** Retries, by role and reason (`connect`, `network`, `http_503`, ...). */
  readonly retries: client.Counter<"role" | "reason">;
  /** Upstream requests that failed, by role and reason (`timeout`, `idle_timeout`, ...). */
  readonly upstreamFailures: client.Counter<"role" | "reason">;
  /** Generation requests currently being served. */
  readonly inflight: client.Gauge;

  constructor(pools: readonly BackendPool[]) {
    const registry = new client.Registry();
    this.registry = registry;
    this.requests = counter(
      registry,
      "pegaflow_router_requests_total",
      "Requests answered by the router, by route and HTTP status (499: client disconnected)",
      ["route", "status"],
    );
    this.prefillSeconds = histogram(
      registry,
      "pegaflow_router_prefill_duration_seconds",
      "Prefill round trip: request sent to P until its full response was read",
      LATENCY_BUCKETS,
      ["backend"],
    );
    this.decodeTtfbSeconds = histogram(
      registry,
      "pegaflow_router_decode_ttfb_seconds",
      "Decode time to first byte: request sent to D until the first body chunk arrived",
      LATENCY_BUCKETS,
      ["backend"],
    );
    this.requestSeconds = histogram(
      registry,
      "pegaflow_router_request_duration_seconds",
      "End-to-end latency: client request received until the last byte was sent",
      LATENCY_BUCKETS,
      ["route"],
    );
    this.retries = counter(
      registry,
      "pegaflow_router_retries_total",
      "Upstream requests retried on another attempt, by role and reason",
      ["role", "reason"],
    );
    this.upstreamFailures = counter(
      registry,
      "pegaflow_router_upstream_failures_total",
      "Upstream requests that failed, by role and reason",
      ["role", "reason"],
    );
    this.inflight = gauge(
      registry,
      "pegaflow_router_inflight_requests",
      "Generation requests currently being served by the router",
    );
    new client.Gauge({
      name: "pegaflow_router_backend_healthy",
      help: "1 if the backend is in service, 0 if health checks or errors took it out",
      labelNames: ["role", "backend"],
      registers: [registry],
      // Every worker reads the same shared state: merging workers' snapshots takes one, not a sum.
      aggregator: "first",
      collect() {
        for (const pool of pools) {
          for (const b of pool.backends) {
            this.set({ role: b.role, backend: b.url }, b.healthy ? 1 : 0);
          }
        }
      },
    });
    new client.Gauge({
      name: "pegaflow_router_backend_inflight",
      help: "Requests the router has open against each backend",
      labelNames: ["role", "backend"],
      registers: [registry],
      aggregator: "first",
      collect() {
        for (const pool of pools) {
          for (const b of pool.backends) this.set({ role: b.role, backend: b.url }, b.inflight);
        }
      },
    });
  }
}
