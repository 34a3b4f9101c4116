/**
 * The block index's Prometheus metrics (`pegaflow_index_*`) and the small
 * interface the index reports through, so the index itself never imports
 * prom-client and tests can count calls without a registry.
 *
 * @module
 */

import type { Registry } from "prom-client";
import { counter, gauge, histogram } from "../metrics.ts";

/** What an index call was doing (a metric label). */
export type IndexOp = "advertise" | "withdraw" | "lookup" | "heartbeat" | "connect";

/** Where the index reports; every method is cheap and never throws. */
export interface IndexMetrics {
  /** One finished call to Redis: how long, whether it succeeded, how many blocks it named. */
  call(op: IndexOp, seconds: number, ok: boolean, blocks: number): void;
  /** A failed call or connection attempt (Redis down, deadline passed, script error). */
  error(op: IndexOp): void;
  /** Redis reachable (true) or not (false). */
  up(up: boolean): void;
  /** Blocks advertised again after an outage, a lost registration or a TTL refresh. */
  republished(blocks: number): void;
  /** This node re-joined under a new incarnation (its older entries became dead at once). */
  rejoined(): void;
  /** Another live process holds this node id: this node is kept out of the index (true) or not. */
  conflict(excluded: boolean): void;
}

/** Index calls: 20 µs .. 1 s (a local Redis answers a 625-block call in well under 1 ms). */
const INDEX_BUCKETS = [2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1];

/**
 * Registers the index metrics on `registry`.
 *
 * @example
 * ```ts
 * const index = new RedisBlockIndex({ ...opts, metrics: registerIndexMetrics(metrics.registry) });
 * ```
 */
export function registerIndexMetrics(registry: Registry): IndexMetrics {
  const calls = counter(
    registry,
    "pegaflow_index_calls_total",
    "block index calls to Redis by operation and result (ok, error)",
    ["op", "result"],
  );
  const seconds = histogram(
    registry,
    "pegaflow_index_call_duration_seconds",
    "block index call time by operation (one round trip each)",
    INDEX_BUCKETS,
    ["op"],
  );
  const blocks = counter(
    registry,
    "pegaflow_index_blocks_total",
    "blocks named by successful index calls (advertised, withdrawn, looked up)",
    ["op"],
  );
  const errors = counter(
    registry,
    "pegaflow_index_errors_total",
    "failed index calls and connection attempts (the node serves locally meanwhile)",
    ["op"],
  );
  const up = gauge(registry, "pegaflow_index_redis_up", "1 while the index's Redis answers");
  const republished = counter(
    registry,
    "pegaflow_index_readvertised_blocks_total",
    "blocks advertised again after an outage, a lost registration or a TTL refresh",
  );
  const rejoins = counter(
    registry,
    "pegaflow_index_rejoins_total",
    "times this node re-joined the index under a new incarnation",
  );
  const conflict = gauge(
    registry,
    "pegaflow_index_node_id_conflict",
    "1 while another live process holds this node's id in the index and this node advertises nothing",
  );
  return {
    call(op, s, ok, n) {
      calls.inc({ op, result: ok ? "ok" : "error" });
      seconds.observe({ op }, s);
      if (ok && n > 0) blocks.inc({ op }, n);
    },
    error: (op) => errors.inc({ op }),
    up: (u) => up.set(u ? 1 : 0),
    republished: (n) => republished.inc(n),
    rejoined: () => rejoins.inc(),
    conflict: (on) => conflict.set(on ? 1 : 0),
  };
}
