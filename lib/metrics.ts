/**
 * prom-client plumbing shared by the KV server (lib/server/metrics.ts), its
 * SSD tier (lib/ssd/metrics.ts) and the router (lib/router/metrics.ts): metric
 * constructors bound to an explicit registry, a gauge read at scrape time,
 * and the `/metrics` response.
 *
 * Every metric goes into a registry its owner passes in, never prom-client's
 * global one, so several servers or routers can live in one process (tests,
 * embedders) without their metric names colliding.
 *
 * @module
 */

import { Counter, Gauge, Histogram, type Registry } from "prom-client";

/**
 * A counter registered on `registry` (no labels unless `labelNames` is given).
 *
 * @example
 * ```ts
 * const rpcs = counter(registry, "pegaflow_rpc_requests_total", "gRPC requests", ["method"]);
 * rpcs.inc({ method: "Save" });
 * ```
 */
export function counter<T extends string = string>(
  registry: Registry,
  name: string,
  help: string,
  labelNames: readonly T[] = [],
): Counter<T> {
  return new Counter<T>({ name, help, labelNames, registers: [registry] });
}

/**
 * A histogram with the given bucket bounds, registered on `registry`.
 *
 * @example
 * ```ts
 * const copy = histogram(registry, "pegaflow_save_duration_seconds", "save time", [0.001, 0.01]);
 * copy.observe(0.004);
 * ```
 */
export function histogram<T extends string = string>(
  registry: Registry,
  name: string,
  help: string,
  buckets: number[],
  labelNames: readonly T[] = [],
): Histogram<T> {
  return new Histogram<T>({ name, help, labelNames, buckets, registers: [registry] });
}

/**
 * A gauge its owner sets, registered on `registry`.
 *
 * @example
 * ```ts
 * const depth = gauge(registry, "pegaflow_queue_depth", "items waiting", ["queue"]);
 * depth.set({ queue: "save" }, 3);
 * ```
 */
export function gauge<T extends string = string>(
  registry: Registry,
  name: string,
  help: string,
  labelNames: readonly T[] = [],
): Gauge<T> {
  return new Gauge<T>({ name, help, labelNames, registers: [registry] });
}

/**
 * An unlabelled gauge on `registry` whose value is `read()` at every scrape,
 * so it mirrors state owned elsewhere and can never drift from it.
 *
 * @example
 * ```ts
 * scrapeGauge(registry, "pegaflow_leases", "live leases", () => store.stats().leasesActive);
 * ```
 */
export function scrapeGauge(
  registry: Registry,
  name: string,
  help: string,
  read: () => number,
): Gauge {
  return new Gauge({
    name,
    help,
    registers: [registry],
    collect() {
      this.set(read());
    },
  });
}

/**
 * The `/metrics` answer: `registry` rendered in its own exposition format,
 * metric by metric. A metric whose scrape-time read throws (a collector over
 * a handle closed at shutdown) is left out and named in a `# NAME
 * unavailable: why` comment line; every other metric is still served.
 * `registry.metrics()` would reject as a whole, and one closed handle would
 * blank the scrape (an HTTP 500) for the rest of a server's shutdown.
 *
 * @example
 * ```ts
 * if (url.pathname === "/metrics") return await metricsResponse(metrics.registry);
 * ```
 */
export async function metricsResponse(registry: Registry): Promise<Response> {
  const parts = await Promise.all(
    registry.getMetricsAsArray().map(async ({ name }) => {
      try {
        return await registry.getSingleMetricAsString(name);
      } catch (e) {
        // A comment is one line: a multi-line message must not break the exposition format.
        const why = String((e as Error)?.message ?? e).replace(/\s+/g, " ");
        return `# ${name} unavailable: ${why}`;
      }
    }),
  );
  return new Response(`${parts.join("\n\n")}\n`, {
    headers: { "content-type": registry.contentType },
  });
}
