/**
 * The benchmarks' percentiles: one definition, so every table means the same
 * thing by p50 and p99.
 *
 * @module
 */

/** The `p`-th percentile (0..100) of `xs` (nearest lower rank; `xs` is not modified). */
export function pct(xs: readonly number[], p: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
}

/** A table row of latency samples in µs: p50, p99 and mean. */
export function latencyRow(name: string, us: readonly number[]) {
  return {
    name,
    p50_us: pct(us, 50),
    p99_us: pct(us, 99),
    mean_us: us.reduce((a, b) => a + b, 0) / us.length,
  };
}
