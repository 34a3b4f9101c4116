/**
 * The tests' one seeded PRNG: a run that fails prints its seed, and the seed
 * replays it exactly.
 */

/**
 * mulberry32: small, fast, deterministic; floats in [0, 1).
 *
 * @example
 * ```ts
 * const next = mulberry32(42);
 * const pick = Math.floor(next() * 10);
 * ```
 */
export function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
