/**
 * The one range merger: joins a copy segment to the previous one when it
 * continues it on both sides (region and pool). Every batch PegaFlow
 * submits is merged here, once, while it is built; the C library copies
 * segments as given (csrc/pegaflow.h, "Each segment is copied as given").
 *
 * Why here and not in C: the builder knows which segments continue each
 * other without comparing them. A load walks a ticket's runs (blocks saved
 * together, one pool stride apart) against the target block ids, so a
 * 10K-token prefix reaches the merger as ~64 pieces, not 40,000 blocks;
 * a save emits a layer's K (then V) plane in block order, which the merger
 * joins as it goes. Merging in C would need all 40,000 segments written into
 * the descriptor first (and read back), which is the per-block work the hot
 * path avoids. docs/architecture.md records the decision.
 *
 * @module
 */

/** Where merged segments go, in order (a batch writer is one). */
export interface SegmentSink {
  seg(regionOff: number, poolOff: number, bytes: number): void;
}

/**
 * Merges contiguous segments on their way to a sink. Reusable: allocation
 * free per segment; call {@link RangeMerger.flush} before the sink's next
 * group and before submitting.
 *
 * @example
 * ```ts
 * const m = new RangeMerger(batch);
 * m.add(0, 4096, 32768);
 * m.add(32768, 36864, 32768); // continues both sides: one segment of 64 KiB
 * m.flush();
 * ```
 */
export class RangeMerger {
  #r = 0;
  #p = 0;
  #n = 0;

  /** `sink` may be swapped between batches (flush first). */
  constructor(public sink: SegmentSink) {}

  /** Adds a segment; it joins the pending one when both sides continue it. */
  add(regionOff: number, poolOff: number, bytes: number): void {
    if (this.#n > 0 && regionOff === this.#r + this.#n && poolOff === this.#p + this.#n) {
      this.#n += bytes;
      return;
    }
    this.flush();
    this.#r = regionOff;
    this.#p = poolOff;
    this.#n = bytes;
  }

  /** Hands the pending merged segment to the sink. */
  flush(): void {
    if (this.#n > 0) this.sink.seg(this.#r, this.#p, this.#n);
    this.#n = 0;
  }
}

/** A contiguous byte range of the pool. */
export interface PoolExtent {
  offset: number;
  bytes: number;
}

/**
 * The pool extents of items laid back to back on the other side (an SSD
 * record holds a block's slots in offset-array order): items whose pool
 * offsets continue each other join, through {@link RangeMerger}.
 *
 * @example
 * ```ts
 * mergeExtents([0, 4096, 65536], 4096); // [{offset: 0, bytes: 8192}, {offset: 65536, bytes: 4096}]
 * ```
 */
export function mergeExtents(offsets: ArrayLike<number>, bytes: number): PoolExtent[] {
  const out: PoolExtent[] = [];
  const m = new RangeMerger({ seg: (_r, p, n) => void out.push({ offset: p, bytes: n }) });
  for (let j = 0; j < offsets.length; j++) m.add(j * bytes, offsets[j], bytes);
  m.flush();
  return out;
}
