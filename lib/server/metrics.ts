/**
 * Prometheus metrics of the KV server (`pegaflow_*`), served at /metrics.
 * Counters and histograms are updated where things happen (engine hooks, RPC
 * wrapper); pool and cache gauges are read from the store at scrape time, so
 * they can never drift from the store's own accounting.
 *
 * @module
 */
import { type Counter, Gauge, type Histogram, Registry } from "prom-client";
import { counter, gauge, histogram, scrapeGauge } from "../metrics.ts";
import { registerProcessMetrics } from "./process_metrics.ts";
import type { StageMetrics } from "../pipeline/stage.ts";
import type { EngineMetrics } from "../engine/engine.ts";
import type { StoreStats } from "../storage/store.ts";

/** Copy durations: 100 µs .. ~13 s. */
const COPY_BUCKETS = [
  1e-4,
  2.5e-4,
  5e-4,
  1e-3,
  2.5e-3,
  5e-3,
  0.01,
  0.025,
  0.05,
  0.1,
  0.25,
  0.5,
  1,
  2.5,
  5,
  13,
];
/**
 * RPC latencies: 10 µs .. 10 s. A hot RPC's handler (QueryPrefetch, Load, Save
 * over the local socket) takes tens of µs on a fast host: below 50 µs the
 * histogram would put most of them in its first bucket.
 */
const RPC_BUCKETS = [
  1e-5,
  2.5e-5,
  5e-5,
  1e-4,
  2.5e-4,
  5e-4,
  1e-3,
  2.5e-3,
  5e-3,
  0.01,
  0.025,
  0.05,
  0.1,
  0.25,
  0.5,
  1,
  2.5,
  10,
];

/**
 * All server metrics in one registry.
 *
 * @example
 * ```ts
 * const m = new ServerMetrics(() => store.stats());
 * m.rpc("Save", "OK", 0.004);
 * const text = await m.registry.metrics();
 * ```
 */
export class ServerMetrics implements EngineMetrics {
  readonly registry = new Registry();
  readonly #rpcTotal: Counter<"method" | "status">;
  readonly #rpcSeconds: Histogram<"method" | "status">;
  readonly #saveBytes: Counter<"device">;
  readonly #saveSeconds: Histogram<"device">;
  readonly #saveBlocks: Counter;
  readonly #saveFailures: Counter<"reason" | "device">;
  readonly #loadBytes: Counter<"device">;
  readonly #loadSeconds: Histogram<"device">;
  readonly #loadFailures: Counter<"device">;
  readonly #queryBlocks: Counter<"result">;
  readonly #queueDepth: Gauge<"queue">;
  readonly #queueInflight: Gauge<"queue">;
  readonly #queueRefused: Counter<"queue">;
  readonly #queueDropped: Counter<"queue">;
  readonly #goawaysDropped: Counter;
  readonly #sessions: Gauge;
  readonly #cleanups: Counter<"reason">;
  readonly #sealed: Counter;

  // long function: one declaration per metric the server updates as things
  // happen, read as the table of what it exports.
  constructor(
    stats: () => StoreStats,
    extra?: { instances: () => number; sessions: () => number; prefetchWaits: () => number },
  ) {
    const r = this.registry;
    this.#rpcTotal = counter(
      r,
      "pegaflow_rpc_requests_total",
      "gRPC requests by method and status code",
      ["method", "status"],
    );
    this.#rpcSeconds = histogram(
      r,
      "pegaflow_rpc_duration_seconds",
      "gRPC handling time by method and status",
      RPC_BUCKETS,
      ["method", "status"],
    );
    this.#saveBytes = counter(
      r,
      "pegaflow_save_bytes_total",
      "bytes copied into the pool by saves, by the saving rank's device",
      ["device"],
    );
    this.#saveBlocks = counter(
      r,
      "pegaflow_save_slots_total",
      "block slots (layer x rank) copied by saves",
    );
    this.#saveSeconds = histogram(
      r,
      "pegaflow_save_duration_seconds",
      "save time from allocation to the gather's completion, by device",
      COPY_BUCKETS,
      ["device"],
    );
    this.#saveFailures = counter(
      r,
      "pegaflow_save_failures_total",
      "saves dropped, by reason (pool_exhausted, queue_full, copy_failed) and the rank's device",
      ["reason", "device"],
    );
    this.#loadBytes = counter(
      r,
      "pegaflow_load_bytes_total",
      "bytes scattered back to engines, by the loading rank's device",
      ["device"],
    );
    this.#loadSeconds = histogram(
      r,
      "pegaflow_load_duration_seconds",
      "load time from submit to the scatter's completion, by device",
      COPY_BUCKETS,
      ["device"],
    );
    this.#loadFailures = counter(
      r,
      "pegaflow_load_failures_total",
      "loads whose copy failed, by device",
      ["device"],
    );
    this.#queryBlocks = counter(
      r,
      "pegaflow_query_blocks_total",
      "queried blocks by result (hit: in the served prefix, miss: not)",
      ["result"],
    );
    this.#queueDepth = gauge(
      r,
      "pegaflow_queue_depth",
      "items waiting per pipeline queue",
      ["queue"],
    );
    this.#queueInflight = gauge(
      r,
      "pegaflow_queue_inflight",
      "items in a worker per pipeline stage",
      ["queue"],
    );
    this.#queueRefused = counter(
      r,
      "pegaflow_queue_refused_total",
      "items refused by a full queue",
      ["queue"],
    );
    this.#queueDropped = counter(
      r,
      "pegaflow_queue_dropped_total",
      "items dropped by a full queue",
      ["queue"],
    );
    this.#goawaysDropped = counter(
      r,
      "pegaflow_grpc_goaway_dropped_total",
      "client GOAWAY frames the gRPC relay kept from grpc-js (denoland/deno#36788 guard)",
    );
    this.#sessions = new Gauge({
      name: "pegaflow_sessions",
      help: "open liveness sessions",
      registers: [r],
      collect() {
        if (extra) this.set(extra.sessions());
      },
    });
    this.#sealed = counter(
      r,
      "pegaflow_blocks_sealed_total",
      "blocks that became servable (every layer and TP rank arrived)",
    );
    this.#cleanups = counter(
      r,
      "pegaflow_instance_cleanups_total",
      "instances cleaned up, by reason",
      ["reason"],
    );
    registerStoreGauges(r, stats);
    registerProcessMetrics(r);
    if (extra) {
      scrapeGauge(r, "pegaflow_instances", "registered instances", () => extra.instances());
      scrapeGauge(
        r,
        "pegaflow_prefetch_waits",
        "WaitPrefetch calls held now (engines waiting for a lower tier's fetch)",
        () => extra.prefetchWaits(),
      );
    }
  }

  /** Records one RPC. */
  rpc(method: string, status: string, seconds: number): void {
    this.#rpcTotal.inc({ method, status });
    this.#rpcSeconds.observe({ method, status }, seconds);
  }

  /**
   * Counts the end of a streaming RPC (a Session) without a duration: its
   * lifetime (hours) is not handling time, and past the histogram's last
   * bucket it would only skew `pegaflow_rpc_duration_seconds`' sum.
   */
  streamEnded(method: string, status: string): void {
    this.#rpcTotal.inc({ method, status });
  }

  /** Counts blocks a save sealed. */
  sealed(count: number): void {
    this.#sealed.inc(count);
  }

  /** Counts a client GOAWAY dropped by the GOAWAY guard (lib/server/goaway_guard.ts). */
  goawayDropped(): void {
    this.#goawaysDropped.inc();
  }

  cleanup(reason: string): void {
    this.#cleanups.inc({ reason });
  }

  /**
   * Starts the per-device series of every served device at zero, so a
   * dashboard sees each device (and its absence of traffic) from start-up.
   */
  devicesServed(devices: readonly number[]): void {
    for (const d of devices) {
      const labels = { device: String(d) };
      this.#saveBytes.inc(labels, 0);
      this.#saveSeconds.zero(labels);
      this.#loadBytes.inc(labels, 0);
      this.#loadSeconds.zero(labels);
      this.#loadFailures.inc(labels, 0);
    }
  }

  saveDone(bytes: number, seconds: number, slots: number, device: number): void {
    const labels = { device: String(device) };
    this.#saveBytes.inc(labels, bytes);
    this.#saveBlocks.inc(slots);
    this.#saveSeconds.observe(labels, seconds);
  }

  saveFailed(reason: string, device: number): void {
    this.#saveFailures.inc({ reason, device: String(device) });
  }

  loadDone(bytes: number, seconds: number, ok: boolean, device: number): void {
    const labels = { device: String(device) };
    if (ok) {
      this.#loadBytes.inc(labels, bytes);
      this.#loadSeconds.observe(labels, seconds);
    } else {
      this.#loadFailures.inc(labels);
    }
  }

  queryDone(requested: number, hits: number): void {
    this.#queryBlocks.inc({ result: "hit" }, hits);
    this.#queryBlocks.inc({ result: "miss" }, requested - hits);
  }

  stage(name: string): StageMetrics {
    return {
      depth: this.#queueDepth.labels({ queue: name }),
      inflight: this.#queueInflight.labels({ queue: name }),
      refused: this.#queueRefused.labels({ queue: name }),
      dropped: this.#queueDropped.labels({ queue: name }),
    };
  }
}

/**
 * The pool and cache gauges, read from the store at scrape time so they can
 * never drift from its own accounting.
 */
// long function: one declaration per gauge, read as the table of what the
// store exports.
function registerStoreGauges(r: Registry, stats: () => StoreStats): void {
  const fromStats = (
    name: string,
    help: string,
    pick: (s: StoreStats) => number,
    monotonic = false,
  ) =>
    scrapeGauge(
      r,
      name,
      monotonic ? `${help} (monotonic, read from the store)` : help,
      () => pick(stats()),
    );
  fromStats(
    "pegaflow_pool_capacity_bytes",
    "pinned pool bytes the store places blocks in",
    (s) => s.capacityBytes,
  );
  fromStats(
    "pegaflow_pool_used_bytes",
    "pinned pool bytes allocated (cached + in flight)",
    (s) => s.usedBytes,
  );
  new Gauge({
    name: "pegaflow_pool_part_used_bytes",
    help:
      "pinned pool bytes allocated per pool part (one part per NUMA node of the served devices)",
    labelNames: ["part"],
    registers: [r],
    collect() {
      stats().partUsedBytes.forEach((b, p) => this.set({ part: String(p) }, b));
    },
  });
  fromStats(
    "pegaflow_pool_largest_free_bytes",
    "largest free extent of the pool",
    (s) => s.largestFreeBytes,
  );
  fromStats(
    "pegaflow_inflight_copy_bytes",
    "pool bytes reserved by saves whose copy is in flight",
    (s) => s.inflightCopyBytes,
  );
  fromStats("pegaflow_cache_blocks", "sealed blocks resident in RAM", (s) => s.sealedBlocks);
  fromStats(
    "pegaflow_cache_evictable_bytes",
    "bytes of sealed, unpinned blocks",
    (s) => s.evictableBytes,
  );
  fromStats(
    "pegaflow_inflight_blocks",
    "blocks with slots still arriving (never served)",
    (s) => s.inflightBlocks,
  );
  fromStats(
    "pegaflow_pinned_blocks",
    "blocks held by a lease, a load or a transfer lock",
    (s) => s.pinnedBlocks,
  );
  fromStats("pegaflow_leases", "live leases", (s) => s.leasesActive);
  fromStats(
    "pegaflow_loads_inflight",
    "loads whose scatter has not finished",
    (s) => s.loadsInflight,
  );
  fromStats("pegaflow_cache_hits_total", "queried blocks served from RAM", (s) => s.hits, true);
  fromStats("pegaflow_cache_misses_total", "queried blocks not served", (s) => s.misses, true);
  fromStats("pegaflow_cache_evictions_total", "blocks evicted", (s) => s.evictions, true);
  fromStats("pegaflow_cache_evicted_bytes_total", "bytes evicted", (s) => s.evictedBytes, true);
  fromStats(
    "pegaflow_admission_rejections_total",
    "new blocks refused by TinyLFU admission",
    (s) => s.admissionRejections,
    true,
  );
  fromStats(
    "pegaflow_save_refusals_total",
    "saves refused for room (pool exhausted)",
    (s) => s.saveRefusals,
    true,
  );
  fromStats(
    "pegaflow_dedup_blocks_total",
    "saved blocks skipped before copy (already held)",
    (s) => s.deduplicated,
    true,
  );
  fromStats(
    "pegaflow_save_discarded_blocks_total",
    "blocks a Save's discard_hashes dropped (inflight) or evicted (sealed, unpinned)",
    (s) => s.discardedBlocks,
    true,
  );
  fromStats(
    "pegaflow_save_discard_pinned_kept_total",
    "sealed blocks a discard named while pinned (a lease, load or transfer lock): unservable at once, evicted at their last unpin",
    (s) => s.discardPinnedKept,
    true,
  );
  fromStats(
    "pegaflow_save_discard_refused_blocks_total",
    "saved or filled blocks refused because a discard named their hash within its TTL",
    (s) => s.discardRefused,
    true,
  );
  fromStats(
    "pegaflow_save_discard_tombstones",
    "discarded hashes still refusing saves",
    (s) => s.discardTombstones,
  );
  fromStats(
    "pegaflow_stale_inflight_collected_total",
    "inflight blocks collected as stale",
    (s) => s.staleCollected,
    true,
  );
  fromStats(
    "pegaflow_leases_expired_total",
    "leases that expired unused",
    (s) => s.leasesExpired,
    true,
  );
}
