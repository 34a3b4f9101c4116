/**
 * Space on the cache files: a log-structured ring of fixed-size segments,
 * reused oldest first.
 *
 * Why a ring and not the RAM tier's LRU: the SSD tier is a victim cache
 * under an LRU/TinyLFU RAM tier, so what reaches it was already filtered for
 * value; what it needs most is cheap, sequential, never-fragmenting writes
 * and an allocation that costs O(1). A ring gives exactly that: records are
 * appended to the open segment, and when the ring wraps, the oldest segment
 * is emptied whole (its index entries dropped) and refilled. Recency after a
 * restart is unknown anyway, and write order is what the disk can recover.
 *
 * Segments of the different files are interleaved in ring order
 * (f0.s0, f1.s0, f0.s1, f1.s1, ...) so consecutive fills spread writes over
 * every path.
 *
 * @module
 */

import { PAGE_BYTES } from "./format.ts";

/** One segment: `bytes` at `fileOffset` of file `file`. */
export interface Segment {
  /** Position in ring order. */
  readonly id: number;
  readonly file: number;
  readonly fileOffset: number;
  /** Sequence number at which this fill of the segment began (0 = never written). */
  epoch: number;
  /** Bytes of records appended in the current fill. */
  fill: number;
  /** Writes allocated here and not yet completed: the segment cannot be reused meanwhile. */
  inflightWrites: number;
  /** Keys indexed in this segment. */
  readonly keys: Set<string>;
}

/** Where a new record goes. */
export interface Allocation {
  segment: Segment;
  /** Absolute file offset of the record. */
  fileOffset: number;
}

/** Why a record could not be placed. */
export type AllocationRefusal = "record-larger-than-segment" | "next-segment-busy";

/** Smallest segment: two pages (a record's header page and one page of payload). */
export const MIN_SEGMENT_BYTES = 2 * PAGE_BYTES;

/**
 * The ring of segments and its write head.
 *
 * @example
 * ```ts
 * const ring = new SegmentRing([{ segments: 4 }], 64 << 20, (seg) => index.dropSegment(seg));
 * const a = ring.allocate(recordBytes(2 << 20), seq);
 * ```
 */
export class SegmentRing {
  readonly segments: Segment[] = [];
  readonly segmentBytes: number;
  #head = 0;
  /** Times the head moved into the next segment (each drops that segment's old records). */
  reuses = 0;
  readonly #onReuse: (seg: Segment) => void;

  /**
   * @param files segment count per file; file i's segment k sits at
   *   `PAGE_BYTES + k * segmentBytes` (the first page is the superblock).
   * @param onReuse called before a segment's old records are given up.
   */
  constructor(
    files: { segments: number }[],
    segmentBytes: number,
    onReuse: (seg: Segment) => void,
  ) {
    if (segmentBytes % PAGE_BYTES !== 0 || segmentBytes < MIN_SEGMENT_BYTES) {
      throw new RangeError(
        `segment size ${segmentBytes} must be a multiple of ${PAGE_BYTES} and ≥ ${MIN_SEGMENT_BYTES}`,
      );
    }
    this.segmentBytes = segmentBytes;
    this.#onReuse = onReuse;
    const most = Math.max(0, ...files.map((f) => f.segments));
    for (let k = 0; k < most; k++) {
      for (let f = 0; f < files.length; f++) {
        if (k >= files[f].segments) continue;
        this.segments.push({
          id: this.segments.length,
          file: f,
          fileOffset: PAGE_BYTES + k * segmentBytes,
          epoch: 0,
          fill: 0,
          inflightWrites: 0,
          keys: new Set(),
        });
      }
    }
    if (this.segments.length === 0) {
      throw new RangeError("the SSD cache has no segment (capacity too small)");
    }
  }

  /** The segment being filled. */
  get head(): Segment {
    return this.segments[this.#head];
  }

  /** Total bytes the ring can hold. */
  get capacityBytes(): number {
    return this.segments.length * this.segmentBytes;
  }

  /**
   * Continues after recovery: the newest segment (highest epoch) keeps
   * filling from where its last valid record ended; a torn record after it
   * is simply overwritten. With nothing recovered, the head is segment 0
   * and `startSeq` opens it.
   */
  resume(startSeq: number): void {
    let best = -1;
    for (const s of this.segments) {
      if (s.epoch > 0 && (best < 0 || s.epoch > this.segments[best].epoch)) best = s.id;
    }
    if (best < 0) {
      this.#head = 0;
      this.segments[0].epoch = startSeq;
      this.segments[0].fill = 0;
    } else {
      this.#head = best;
    }
  }

  /**
   * A record placed in `seg` was not written: recovery reads a segment's chain
   * up to its first gap, so nothing more is placed in `seg` when it is still
   * the head (the next record opens the next segment). Records already placed
   * after the gap stay indexed until a restart, which cannot reach them.
   */
  sealAfterGap(seg: Segment): void {
    if (seg === this.segments[this.#head]) seg.fill = this.segmentBytes;
  }

  /**
   * Places a record of `bytes` (page-aligned) written with sequence `seq`.
   * Moving into the next segment drops its old records first (onReuse).
   */
  allocate(bytes: number, seq: number): Allocation | AllocationRefusal {
    if (bytes > this.segmentBytes) return "record-larger-than-segment";
    let seg = this.segments[this.#head];
    if (seg.fill + bytes > this.segmentBytes) {
      const next = this.segments[(this.#head + 1) % this.segments.length];
      if (next.inflightWrites > 0) return "next-segment-busy";
      this.#onReuse(next);
      // Overwritten only if it held records (this run's, or found at open): a fresh file's
      // segments are filled for the first time, which drops nothing.
      if (next.fill > 0) this.reuses++;
      next.keys.clear();
      next.epoch = seq;
      next.fill = 0;
      this.#head = next.id;
      seg = next;
    }
    // A fill's first record opens it: a restart's scan starts a chain only at a record whose seq
    // is its epoch (a fresh ring's head was opened at a seq that a refused record may have used).
    if (seg.fill === 0) seg.epoch = seq;
    const fileOffset = seg.fileOffset + seg.fill;
    seg.fill += bytes;
    seg.inflightWrites++;
    return { segment: seg, fileOffset };
  }
}
