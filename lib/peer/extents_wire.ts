/**
 * The pool ranges of a lock answer on the wire (proto/pegaflow.proto,
 * `QueryBlocksForTransferResponse`): the owner packs its pinned blocks'
 * ranges ({@link packExtents}), the requester unpacks them into one flat
 * array ({@link remoteExtents}).
 *
 * Why shifts: blocks saved in one batch lie one slot apart in every column
 * of the pool (lib/storage/offsets.ts), so block i's ranges are block i-1's
 * moved by one constant. A requester that asks for it (`shifted_extents`)
 * gets such a block as "the previous block's, moved by d": a lock of 256
 * Llama-3.1-8B blocks saved together answers 64 extents and 255 shifts
 * (~3 KiB) instead of 16,384 extents (256 KiB), which the owner would
 * encode and the requester receive and decode while the wire waits for its
 * first byte. A block cut differently from the one before it is sent whole.
 *
 * @module
 */
import type { BlockRanges } from "../transfer/ranges.ts";
import type { QueryBlocksForTransferResponse } from "../../proto/pegaflow.ts";

const TWO32 = 4294967296;
/**
 * Most pool ranges one lock answer may describe: what 64 MiB of extents
 * (the largest answer a requester reads, link.ts) can carry unshifted.
 * Shifts copy the previous block's count, so without this bound a small
 * answer — one block of many ranges, then shifts — made the requester
 * allocate and walk ranges without end (gigabytes; a RangeError that
 * escaped the fetch and left the owner's lock pinned until its TTL).
 */
export const MAX_ANSWER_RANGES = (64 << 20) / 16;

/** The extent fields of a lock answer. */
export interface PackedExtents {
  /** Per block: its own extents in `extents`, or 0 (shifted). */
  extentCounts: Uint32Array;
  /** The own extents, back to back: u64 pool offset, u64 bytes, little-endian. */
  extents: Uint8Array;
  /** Per block the shift of a shifted block (0 elsewhere); empty when `shifted` was false. */
  extentShifts: Float64Array;
}

/** True when block i's ranges are block i-1's moved by one constant (then `shift` holds it). */
function sameCut(r: BlockRanges, i: number, shift: { d: number }): boolean {
  const { ranges, starts } = r;
  const a = starts[i], p = starts[i - 1], n = starts[i + 1] - a;
  if (n !== a - p || n === 0) return false;
  const d = ranges[2 * a] - ranges[2 * p];
  for (let e = 0; e < n; e++) {
    const x = 2 * (a + e), y = 2 * (p + e);
    if (ranges[x + 1] !== ranges[y + 1] || ranges[x] - ranges[y] !== d) return false;
  }
  shift.d = d;
  return true;
}

/**
 * Packs the ranges of blocks `0 .. k` of `r`; with `shifted`, a block cut
 * like the one before it goes as a shift.
 *
 * @example
 * ```ts
 * const p = packExtents(pin.ranges, k, req.shiftedExtents);
 * res.extentCounts = Array.from(p.extentCounts); res.extents = p.extents;
 * ```
 */
export function packExtents(r: BlockRanges, k: number, shifted: boolean): PackedExtents {
  const { ranges, starts } = r;
  const extentCounts = new Uint32Array(k);
  const extentShifts = new Float64Array(shifted ? k : 0);
  const shift = { d: 0 };
  let own = 0;
  for (let i = 0; i < k; i++) {
    if (shifted && i > 0 && sameCut(r, i, shift)) {
      extentShifts[i] = shift.d;
    } else {
      own += extentCounts[i] = starts[i + 1] - starts[i];
    }
  }
  const words = new Uint32Array(4 * own);
  let w = 0;
  for (let i = 0; i < k; i++) {
    if (extentCounts[i] === 0) continue;
    for (let e = 2 * starts[i]; e < 2 * starts[i + 1]; e++, w += 2) {
      words[w] = ranges[e] >>> 0;
      words[w + 1] = (ranges[e] / TWO32) >>> 0;
    }
  }
  return { extentCounts, extents: new Uint8Array(words.buffer), extentShifts };
}

/**
 * The owner's ranges of each locked block as one flat array (a lock of 256
 * blocks answers 16,384 ranges, which as objects cost the requester's JS
 * thread and GC time while its READ runs). Lenient about what it need not
 * read (a shift beside a block's own extents is ignored); a string says what
 * is wrong with an answer it cannot use.
 */
export function remoteExtents(res: QueryBlocksForTransferResponse): BlockRanges | string {
  const n = res.checksums.length;
  const counts = res.extentCounts, shifts = res.extentShifts;
  if (counts.length !== n) return `${n} checksums but ${counts.length} extent counts`;
  if (shifts.length !== 0 && shifts.length !== n) {
    return `${n} checksums but ${shifts.length} extent shifts`;
  }
  const starts = new Uint32Array(n + 1);
  let own = 0;
  for (let i = 0; i < n; i++) {
    let c = counts[i];
    own += c;
    if (c === 0) {
      if (i === 0 || shifts.length === 0) {
        return `block ${i}: 0 extents and no previous block's extents to shift`;
      }
      c = starts[i] - starts[i - 1];
    }
    if (starts[i] + c > MAX_ANSWER_RANGES) {
      return `blocks 0..${i} describe ${starts[i] + c} pool ranges; at most ${MAX_ANSWER_RANGES}`;
    }
    starts[i + 1] = starts[i] + c;
  }
  if (res.extents.length !== own * 16) {
    return `${res.extents.length} extent bytes for ${own} extents`;
  }
  const dv = new DataView(res.extents.buffer, res.extents.byteOffset, res.extents.byteLength);
  const ranges = new Float64Array(2 * starts[n]);
  for (let i = 0, p = 0; i < n; i++) {
    const from = 2 * starts[i], to = 2 * starts[i + 1];
    if (counts[i] > 0) {
      for (let e = from; e < to; e++, p += 8) {
        ranges[e] = dv.getUint32(p, true) + dv.getUint32(p + 4, true) * TWO32;
      }
    } else {
      const d = shifts[i], prev = 2 * starts[i - 1];
      for (let e = from; e < to; e += 2) {
        const off = ranges[prev + e - from] + d;
        if (!(off >= 0 && off <= Number.MAX_SAFE_INTEGER)) {
          return `block ${i}: shift ${d} moves extent ${(e - from) / 2} to offset ${off}`;
        }
        ranges[e] = off;
        ranges[e + 1] = ranges[prev + e - from + 1];
      }
    }
    let sum = 0;
    for (let e = from + 1; e < to; e += 2) {
      // A range of no bytes is nothing a pool cuts (and would let a block claim any count).
      if (ranges[e] === 0) return `block ${i}: extent ${(e - from - 1) / 2} is 0 bytes`;
      sum += ranges[e];
    }
    if (sum !== res.payloadBytes) {
      return `block ${i}: extents cover ${sum} bytes, payload is ${res.payloadBytes}`;
    }
  }
  return { ranges, starts };
}
