/**
 * The SSD throughput gauges' moving average, shared by the write and read
 * flows so both weigh a batch the same way.
 *
 * @module
 */

/** Weight of the newest batch in the throughput gauges' moving average. */
const THROUGHPUT_EWMA_WEIGHT = 0.2;

/**
 * The moving average after one more sample (bytes/s of one batch); a
 * non-finite sample (a batch that took no measurable time) is ignored.
 *
 * @example
 * ```ts
 * let bps = 0;
 * bps = ewma(bps, 1e9); // 1e9: the first sample is taken as is
 * bps = ewma(bps, 2e9); // 1.2e9
 * ```
 */
export function ewma(prev: number, sample: number): number {
  if (!Number.isFinite(sample)) return prev;
  return prev === 0 ? sample : prev + THROUGHPUT_EWMA_WEIGHT * (sample - prev);
}
