/**
 * What the microbenchmarks of one 10K-token prefix share (bench/storage.ts, bench/tier_host.ts,
 * bench/index_run.ts): their `--iterations` flag, the prefix's synthetic block hashes, and the
 * timing of a synchronous step in µs.
 *
 * @module
 */
import { latencyRow } from "./stats.ts";
import { type BenchArgs, positiveInt } from "./cli.ts";

/** Blocks of a 10K-token prefix: 10K tokens / 16 tokens per block. */
export const PREFIX_BLOCKS = 625;

/** The microbenchmarks' flag for their timed calls per row. */
export const ITERATIONS_FLAG = "--iterations";

/**
 * `--iterations` from the parsed command line (default `fallback`); exits 2 naming the flag when
 * it is not a positive integer.
 */
export function iterationsFlag(args: BenchArgs, fallback: number): number {
  return positiveInt(ITERATIONS_FLAG, args.flags[ITERATIONS_FLAG], fallback);
}

/**
 * {@link PREFIX_BLOCKS} distinct 32-byte hashes for `seed`: the seed and the block's index in
 * the first 8 bytes, the rest random when `randomTail` (else zero).
 */
export function prefixHashes(seed: number, randomTail: boolean): Uint8Array[] {
  return Array.from({ length: PREFIX_BLOCKS }, (_, i) => {
    const b = new Uint8Array(32);
    new DataView(b.buffer).setUint32(0, seed);
    new DataView(b.buffer).setUint32(4, i);
    if (randomTail) crypto.getRandomValues(b.subarray(8));
    return b;
  });
}

/** One row of a microbenchmark's table, in µs. */
export interface MicroRow {
  name: string;
  p50_us: number;
  p99_us: number;
  mean_us: number;
}

/**
 * Times `fn(i)` for i = 0..iterations-1 after `min(warmup, iterations)` untimed calls (given
 * negative i), and returns the percentiles in µs.
 */
export function measure(
  name: string,
  iterations: number,
  warmup: number,
  fn: (i: number) => void,
): MicroRow {
  for (let i = 0; i < Math.min(warmup, iterations); i++) fn(-1 - i);
  const t: number[] = [];
  for (let i = 0; i < iterations; i++) {
    const t0 = performance.now();
    fn(i);
    t.push((performance.now() - t0) * 1000);
  }
  return latencyRow(name, t);
}
