/**
 * Prometheus metrics of the tiers below RAM (`pegaflow_tier_*`), one label
 * value per tier, read from {@link LowerTiers} at scrape time: capacity and
 * health of each tier, which tier served (or missed) a query's prefix, and
 * what the `tier.admit` stage dropped. The tier's own metrics
 * (`pegaflow_ssd_*`) and the stage gauges (`pegaflow_queue_depth{queue}`)
 * are registered by their owners.
 *
 * @module
 */

import { Counter, Gauge, type Registry } from "prom-client";
import type { LowerTiers } from "../storage/lower_tiers.ts";
import type { TierHealth } from "../storage/tier.ts";

/**
 * A counter's advance to a running total: by what changed since the last
 * scrape, per label set (the stats are running totals).
 */
function advancer(): (c: Counter<string>, labels: Record<string, string>, v: number) => void {
  const last = new Map<string, number>();
  return (c, labels, v) => {
    const key = JSON.stringify(labels);
    const prev = last.get(key) ?? 0;
    if (v > prev) c.inc(labels, v - prev);
    last.set(key, v);
  };
}

/**
 * Registers the tier metrics on `registry`.
 *
 * @example
 * ```ts
 * registerTierMetrics(metrics.registry, tiers);
 * ```
 */
export function registerTierMetrics(registry: Registry, tiers: LowerTiers): void {
  const healthGauge = (name: string, help: string, value: (h: TierHealth) => number) =>
    new Gauge({
      name,
      help,
      labelNames: ["tier"],
      registers: [registry],
      collect() {
        for (const t of tiers.tiers) this.set({ tier: t.name }, value(t.health()));
      },
    });
  healthGauge(
    "pegaflow_tier_up",
    "1 while the tier serves, 0 while degraded or once closed",
    (h) => h.state === "up" ? 1 : 0,
  );
  healthGauge(
    "pegaflow_tier_degraded",
    "1 while the tier is open but takes no work (its io is stalled: a hung disk), else 0",
    (h) => h.state === "degraded" ? 1 : 0,
  );
  healthGauge("pegaflow_tier_capacity_bytes", "bytes the tier can hold", (h) => h.capacityBytes);
  healthGauge("pegaflow_tier_used_bytes", "block bytes the tier holds", (h) => h.usedBytes);
  const advanceQueries = advancer();
  new Counter({
    name: "pegaflow_tier_queries_total",
    help: "queries whose prefix continued past RAM, by tier and answer " +
      "(loading: a fetch started or joined; ready: its fetch ended; miss_<reason>)",
    labelNames: ["tier", "answer"],
    registers: [registry],
    collect() {
      for (const [tier, q] of Object.entries(tiers.stats().queries)) {
        advanceQueries(this, { tier, answer: "loading" }, q.loading);
        advanceQueries(this, { tier, answer: "ready" }, q.ready);
        for (const [reason, n] of Object.entries(q.miss)) {
          advanceQueries(this, { tier, answer: `miss_${reason}` }, n);
        }
      }
    },
  });
  const advanceSources = advancer();
  new Counter({
    name: "pegaflow_query_source_total",
    help: "QueryPrefetch answers by where their prefix came from (hit attribution): " +
      "ram, a tier (ssd, peer: the fetch the request waited for), or miss",
    labelNames: ["source"],
    registers: [registry],
    collect() {
      for (const [source, n] of Object.entries(tiers.stats().sources.queries)) {
        advanceSources(this, { source }, n);
      }
    },
  });
  const advanceSourceBlocks = advancer();
  new Counter({
    name: "pegaflow_query_source_blocks_total",
    help: "prefix blocks QueryPrefetch answers held, by where they came from (ram, ssd, peer)",
    labelNames: ["source"],
    registers: [registry],
    collect() {
      for (const [source, n] of Object.entries(tiers.stats().sources.blocks)) {
        advanceSourceBlocks(this, { source }, n);
      }
    },
  });
  registerAdmitMetrics(registry, tiers);
}

/** What the tier.admit stage did not hand the tiers: batches dropped when full, puts that threw. */
function registerAdmitMetrics(registry: Registry, tiers: LowerTiers): void {
  const advanceDropped = advancer();
  new Counter({
    name: "pegaflow_tier_admit_dropped_blocks_total",
    help: "sealed blocks not offered to the tiers because the tier.admit queue was full",
    registers: [registry],
    collect() {
      advanceDropped(this, {}, tiers.stats().admitDroppedBlocks);
    },
  });
  const advanceFailed = advancer();
  new Counter({
    name: "pegaflow_tier_admit_failures_total",
    help: "batches of sealed blocks a tier failed to take (its put threw; logged), by tier",
    labelNames: ["tier"],
    registers: [registry],
    collect() {
      for (const [tier, n] of Object.entries(tiers.stats().admitFailed)) {
        advanceFailed(this, { tier }, n);
      }
    },
  });
}
