/**
 * Chained prefix block hashes, as inference engines compute them: block i's
 * hash covers block i's tokens AND every block before it (through block
 * i-1's hash), so equal hashes mean equal prefixes. Deterministic across
 * processes, ranks and restarts (lesson 6 of the original system): sha256
 * over fixed little-endian bytes, no per-process seed.
 *
 * @module
 */
import { createHash } from "node:crypto";

/** Bytes kept of each sha256 (collision odds are negligible at 128 bits). */
export const BLOCK_HASH_BYTES = 16;

/**
 * Hashes of every full block of `tokens` (a trailing partial block gets none).
 *
 * @example
 * ```ts
 * const h = chainedBlockHashes(Uint32Array.from({ length: 64 }, (_, i) => i), 16);
 * h.length; // 4
 * ```
 */
export function chainedBlockHashes(
  tokens: Uint32Array,
  blockTokens: number,
  salt = "",
): Uint8Array[] {
  // 0 would never leave the loop below (every "block" is full), a fraction would
  // cut tokens in half: both are caller bugs, refused as python/pegaflow/hashes.py does.
  if (!Number.isInteger(blockTokens) || blockTokens < 1) {
    throw new RangeError(`block hashes: blockTokens must be an integer >= 1, got ${blockTokens}`);
  }
  const out: Uint8Array[] = [];
  let prev = new Uint8Array(createHash("sha256").update(`pegaflow-root:${salt}`).digest()).subarray(
    0,
    BLOCK_HASH_BYTES,
  );
  const le = new Uint8Array(tokens.buffer, tokens.byteOffset, tokens.byteLength);
  for (let b = 0; (b + 1) * blockTokens <= tokens.length; b++) {
    const h = createHash("sha256");
    h.update(prev);
    h.update(le.subarray(b * blockTokens * 4, (b + 1) * blockTokens * 4));
    prev = new Uint8Array(h.digest()).subarray(0, BLOCK_HASH_BYTES);
    out.push(prev);
  }
  return out;
}

/** A deterministic token sequence for prompt `seed` (tests and the demo). */
export function syntheticTokens(seed: number, count: number): Uint32Array {
  const t = new Uint32Array(count);
  let x = (seed * 2654435761) >>> 0 || 1;
  for (let i = 0; i < count; i++) {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    t[i] = x % 128_256; // Llama-3 vocabulary size
  }
  return t;
}
