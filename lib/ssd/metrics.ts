/**
 * The SSD tier's Prometheus metrics (`pegaflow_ssd_*`), read from
 * {@link SsdTier.stats} at scrape time: counters advance by what changed
 * since the last scrape, gauges are set.
 *
 * @module
 */

import { Counter, type Registry } from "prom-client";
import { scrapeGauge } from "../metrics.ts";
import type { SsdStats } from "./tier.ts";

type CounterKey = {
  [K in keyof SsdStats]: K;
}[keyof SsdStats];

const COUNTERS: [string, string, CounterKey][] = [
  ["pegaflow_ssd_write_bytes_total", "payload bytes written to SSD", "writeBytes"],
  ["pegaflow_ssd_write_blocks_total", "blocks written to SSD", "writeBlocks"],
  [
    "pegaflow_ssd_write_failures_total",
    "block writes that failed (I/O error, ENOSPC)",
    "writeFailures",
  ],
  [
    "pegaflow_ssd_write_queue_full_total",
    "write batches dropped because the queue was full",
    "writeQueueFullDrops",
  ],
  [
    "pegaflow_ssd_write_queue_full_blocks_total",
    "blocks in dropped write batches",
    "writeQueueFullDroppedBlocks",
  ],
  [
    "pegaflow_ssd_write_skipped_evicted_total",
    "blocks evicted from RAM before their write began",
    "writeSkippedEvicted",
  ],
  [
    "pegaflow_ssd_write_skipped_no_space_total",
    "blocks not placed (larger than a segment, or segment busy)",
    "writeSkippedNoSpace",
  ],
  [
    "pegaflow_ssd_write_pads_total",
    "pads written over failed record writes (a restart steps over each gap)",
    "writePads",
  ],
  [
    "pegaflow_ssd_write_pad_failures_total",
    "pads that could not be written (the records after each such gap are lost at a restart)",
    "writePadFailures",
  ],
  [
    "pegaflow_ssd_drop_pads_total",
    "pads written over dropped (discarded) blocks' records: a restart does not index them again",
    "dropPads",
  ],
  [
    "pegaflow_ssd_drop_pad_failures_total",
    "drop pads that could not be written (that discarded block is indexed again at a restart)",
    "dropPadFailures",
  ],
  ["pegaflow_ssd_read_bytes_total", "payload bytes read from SSD and verified", "readBytes"],
  ["pegaflow_ssd_read_blocks_total", "blocks read from SSD and verified", "readBlocks"],
  ["pegaflow_ssd_read_failures_total", "block reads that failed with an I/O error", "readFailures"],
  [
    "pegaflow_ssd_checksum_failures_total",
    "blocks whose header or CRC32C did not verify (served as misses)",
    "checksumFailures",
  ],
  [
    "pegaflow_ssd_prefetch_backpressure_total",
    "prefetches answered as a miss (budget, queue full, no pool space)",
    "prefetchBackpressure",
  ],
  [
    "pegaflow_ssd_prefetch_partial_total",
    "prefetches cut short by the block budget",
    "prefetchPartial",
  ],
  [
    "pegaflow_ssd_prefetch_expired_total",
    "finished prefetches forgotten because their request never polled again (blocks stay cached)",
    "prefetchExpired",
  ],
  [
    "pegaflow_ssd_layout_mismatch_total",
    "prefetches stopped at a block another layout of its namespace wrote (served as a miss)",
    "layoutMismatches",
  ],
  [
    "pegaflow_ssd_segments_reused_total",
    "segments overwritten (oldest first) while they held records; a fresh file's first fill is not counted",
    "segmentsReused",
  ],
  [
    "pegaflow_ssd_io_stalls_total",
    "io batches outstanding past the stall deadline (a hung disk: the tier degrades)",
    "ioStalls",
  ],
  [
    "pegaflow_ssd_write_degraded_drops_total",
    "write batches dropped because the tier was degraded (stalled io)",
    "writeDegradedDrops",
  ],
  [
    "pegaflow_ssd_write_degraded_dropped_blocks_total",
    "blocks in write batches dropped because the tier was degraded",
    "writeDegradedDroppedBlocks",
  ],
  [
    "pegaflow_ssd_prefetch_degraded_misses_total",
    "prefetches answered as a miss because the tier was degraded (stalled io)",
    "prefetchDegradedMisses",
  ],
];

const GAUGES: [string, string, CounterKey][] = [
  [
    "pegaflow_ssd_capacity_bytes",
    "SSD cache capacity after capping to free space",
    "capacityBytes",
  ],
  [
    "pegaflow_ssd_degraded",
    "1 while an io batch is stalled (writes dropped, prefetches miss)",
    "ioDegraded",
  ],
  ["pegaflow_ssd_index_blocks", "blocks indexed on SSD", "indexBlocks"],
  ["pegaflow_ssd_index_bytes", "payload bytes indexed on SSD", "indexBytes"],
  ["pegaflow_ssd_recovered_blocks", "blocks recovered from disk at start", "recoveredBlocks"],
  ["pegaflow_ssd_recovered_bytes", "payload bytes recovered from disk at start", "recoveredBytes"],
  [
    "pegaflow_ssd_recovery_dropped_records",
    "torn or truncated records dropped at start",
    "recoveryTornRecords",
  ],
  [
    "pegaflow_ssd_write_throughput_bytes_per_second",
    "write throughput (moving average over batches)",
    "writeThroughputBps",
  ],
  [
    "pegaflow_ssd_read_throughput_bytes_per_second",
    "read throughput (moving average over prefetches)",
    "readThroughputBps",
  ],
  ["pegaflow_ssd_write_queue_depth", "write batches waiting", "writeQueueDepth"],
  ["pegaflow_ssd_write_inflight", "write batches in flight", "writeInflight"],
  ["pegaflow_ssd_prefetch_queue_depth", "prefetches waiting", "prefetchQueueDepth"],
  ["pegaflow_ssd_prefetch_inflight", "prefetch reads in flight", "prefetchInflight"],
  [
    "pegaflow_ssd_prefetch_reserved_blocks",
    "pool blocks being read by prefetches (a landed block is an ordinary cached block)",
    "prefetchReservedBlocks",
  ],
  ["pegaflow_ssd_prefetch_budget_blocks", "--max-prefetch-blocks", "prefetchBudgetBlocks"],
  [
    "pegaflow_ssd_alignment_fallbacks",
    "ops that went buffered because they were not O_DIRECT-aligned",
    "alignmentFallbacks",
  ],
];

/**
 * Registers the SSD metrics on `registry`, reading `stats()` at each scrape.
 *
 * @example
 * ```ts
 * registerSsdMetrics(metrics.registry, () => tier.stats());
 * ```
 */
export function registerSsdMetrics(registry: Registry, stats: () => SsdStats): void {
  let snap: SsdStats | undefined;
  let snapAt = -1;
  // One stats() per scrape, shared by every metric's collect().
  const read = () => {
    const now = performance.now();
    if (!snap || now - snapAt > 1) {
      try {
        snap = stats();
      } catch (e) {
        // A closed tier's io_uring handle is gone (stats() throws PF_EHANDLE) while the server
        // still answers /metrics during its shutdown: its last figures are its final ones.
        if (!snap) throw e;
      }
      snapAt = now;
    }
    return snap;
  };
  for (const [name, help, key] of COUNTERS) {
    let last = 0;
    new Counter({
      name,
      help,
      registers: [registry],
      collect() {
        const v = read()[key];
        if (v > last) this.inc(v - last);
        last = v;
      },
    });
  }
  for (const [name, help, key] of GAUGES) scrapeGauge(registry, name, help, () => read()[key]);
}
