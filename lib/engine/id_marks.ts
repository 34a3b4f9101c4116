/**
 * Where each block id was last named in the list being checked, for the
 * request checks that refuse a repeated id (a Save's block ids under two
 * hashes, a Load's target named twice). One scratch pair of arrays kept
 * across calls and grown to the largest num_blocks seen: no allocation per
 * block or per request. The JS thread runs one check at a time, so the
 * checks share it.
 *
 * @example
 * ```ts
 * const p = IdMarks.pass(numBlocks);
 * for (let i = 0; i < ids.length; i++) {
 *   const before = IdMarks.seen(ids[i], p); // index of an earlier mention in this pass, or -1
 *   IdMarks.mark(ids[i], p, i);
 * }
 * ```
 *
 * @module
 */

/** `seenIn[id] === pass`: id was named in this pass, at index `seenAt[id]`. */
let seenIn = new Uint32Array(0);
let seenAt = new Uint32Array(0);
let current = 0;

export const IdMarks = {
  /** A new pass over ids below `numBlocks` (every id checked against that bound first). */
  pass(numBlocks: number): number {
    if (seenIn.length < numBlocks) {
      seenIn = new Uint32Array(numBlocks);
      seenAt = new Uint32Array(numBlocks);
      current = 0;
    }
    if (++current > 0xffff_fffe) {
      seenIn.fill(0);
      current = 1;
    }
    return current;
  },
  /** Where `id` was marked in pass `p`, or -1. */
  seen(id: number, p: number): number {
    return seenIn[id] === p ? seenAt[id] : -1;
  },
  /** Marks `id` as named at index `i` in pass `p`. */
  mark(id: number, p: number, i: number): void {
    seenIn[id] = p;
    seenAt[id] = i;
  },
};
