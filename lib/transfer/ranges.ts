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

/**
 * Pool ranges of a run of blocks in one flat array: no object per range or
 * per block (a peer fetch of 256 blocks of Llama-3.1-8B saved column-major
 * is 16,384 ranges). Block k's ranges are the pairs `starts[k]` up to
 * `starts[k + 1]` of `ranges` (offset, bytes, offset, bytes…), in payload
 * order.
 */
export interface BlockRanges {
  readonly ranges: Float64Array;
  /** Pair index of each block's first range; `blocks + 1` entries. */
  readonly starts: Uint32Array;
}

/**
 * Writes {@link BlockRanges}, block after block, each block's items merged by
 * {@link RangeMerger} (so a block's adjacent slots become one range).
 *
 * @example
 * ```ts
 * const w = new BlockRangesWriter(2, 4);
 * w.addBlock([0, 4096], 0, 1, 2, 4096); // one range of 8 KiB
 * w.addBlock([65536, 8192], 0, 1, 2, 4096); // two ranges
 * w.finish(); // {ranges: [0, 8192, 65536, 4096, 8192, 4096], starts: [0, 1, 3]}
 * ```
 */
export class BlockRangesWriter implements SegmentSink {
  readonly #ranges: Float64Array;
  readonly #starts: Uint32Array;
  readonly #merger: RangeMerger;
  #pairs = 0;
  #blocks = 0;

  /** Room for `maxBlocks` blocks of `maxRanges` ranges in all. */
  constructor(maxBlocks: number, maxRanges: number) {
    this.#ranges = new Float64Array(2 * maxRanges);
    this.#starts = new Uint32Array(maxBlocks + 1);
    this.#merger = new RangeMerger(this);
  }

  /** @internal The merger's sink: one merged range of the current block. */
  seg(_regionOff: number, poolOff: number, bytes: number): void {
    const at = 2 * this.#pairs++;
    this.#ranges[at] = poolOff;
    this.#ranges[at + 1] = bytes;
  }

  /**
   * Adds one block of `count` items of `itemBytes`, in payload order, at
   * pool offsets `offsets[first + j * stride]` (a column-major offset table's
   * block is `first` = its index, `stride` = the table's block count).
   */
  addBlock(
    offsets: ArrayLike<number>,
    first: number,
    stride: number,
    count: number,
    itemBytes: number,
  ): void {
    for (let j = 0; j < count; j++) {
      this.#merger.add(j * itemBytes, offsets[first + j * stride], itemBytes);
    }
    this.#merger.flush();
    this.#starts[++this.#blocks] = this.#pairs;
  }

  /** Adds a block with no ranges (one not held). */
  addEmpty(): void {
    this.#starts[++this.#blocks] = this.#pairs;
  }

  /** The blocks added so far (views into this writer's arrays). */
  finish(): BlockRanges {
    return {
      ranges: this.#ranges.subarray(0, 2 * this.#pairs),
      starts: this.#starts.subarray(0, this.#blocks + 1),
    };
  }
}

/**
 * Block `k`'s ranges as objects (for callers off the hot path: SSD records,
 * checksums, tests).
 *
 * @example
 * ```ts
 * blockExtents({ ranges: new Float64Array([0, 8192]), starts: new Uint32Array([0, 1]) }, 0);
 * // [{offset: 0, bytes: 8192}]
 * ```
 */
export function blockExtents(r: BlockRanges, k: number): PoolExtent[] {
  const out: PoolExtent[] = [];
  for (let e = r.starts[k]; e < r.starts[k + 1]; e++) {
    out.push({ offset: r.ranges[2 * e], bytes: r.ranges[2 * e + 1] });
  }
  return out;
}
