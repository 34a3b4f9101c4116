/**
 * Test helper: the seeded byte pattern a node fills its pool with, so that
 * another process can check every byte it read without asking for them.
 * Byte i of a pool with seed s is byte (i & 3) of word(s, i >> 2).
 */

/** (remote offset, local offset, bytes). */
export type Seg = [number, number, number];

/** The pattern's 32-bit word `w` for `seed` (a murmur3-style mix). */
export function word(seed: number, w: number): number {
  let h = (seed ^ Math.imul(w, 0x9e3779b1)) >>> 0;
  h = Math.imul(h ^ (h >>> 16), 0x85ebca6b);
  h = Math.imul(h ^ (h >>> 13), 0xc2b2ae35);
  return (h ^ (h >>> 16)) >>> 0;
}

/** Pattern byte at pool offset `i`. */
export function patternByte(seed: number, i: number): number {
  return (word(seed, Math.floor(i / 4)) >>> ((i & 3) * 8)) & 0xff;
}

/** Fills mem[off, off+len) (off, len multiples of 4) with the pattern of `seed`. */
export function fillPattern(mem: Uint8Array, off: number, len: number, seed: number): void {
  const u = new Uint32Array(mem.buffer, mem.byteOffset + off, len >> 2);
  const w0 = off >> 2;
  for (let i = 0; i < u.length; i++) u[i] = word(seed, w0 + i);
}

/**
 * First local offset where mem does not hold the remote pattern that `segs`
 * should have brought over, or -1 when every byte matches.
 */
export function firstMismatch(mem: Uint8Array, segs: Seg[], seed: number): number {
  for (const [r, l, b] of segs) {
    for (let k = 0; k < b; k++) {
      if (mem[l + k] !== patternByte(seed, r + k)) return l + k;
    }
  }
  return -1;
}

/** A cheap order-sensitive checksum (FNV-1a over 32-bit words, then tail bytes). */
export function checksum(mem: Uint8Array, off: number, len: number): number {
  let h = 0x811c9dc5;
  for (let i = off; i < off + len; i++) h = Math.imul(h ^ mem[i], 0x01000193);
  return h >>> 0;
}
