/**
 * {@link CopyBatch}: a reusable, preallocated batch descriptor.
 *
 * The descriptor is the exact byte layout `pf_copy_submit` parses
 * (`pf_batch_header`, `pf_batch_group[]`, `pf_batch_seg[]`). Groups and
 * segments are written as u32 words straight into one Uint32Array: no
 * allocation and no FFI call per segment. u64 fields are written as two u32
 * halves (exact for values below 2^53).
 *
 * @module
 */
import {
  type CopyPath,
  type Direction,
  DIRECTION_CODES,
  PATH_CODES,
  type Region,
} from "./native.ts";
import type { SharedMemory } from "./native.ts";
import { isU53, notU53 } from "./structs.ts";

const HEADER_BYTES = 32;
const GROUP_BYTES = 16;
const SEG_BYTES = 24;
const TWO32 = 4294967296;

/** `pf_batch_header.flags` bit PF_BATCH_WHOLE. */
const BATCH_WHOLE = 1;
/** `pf_batch_header.flags` bit PF_BATCH_QUIET: no per-group (LAYER) records. */
const BATCH_QUIET = 2;

/** Options of {@link CopyBatch.reset}. */
export interface BatchOptions {
  /**
   * The consumer reads the batch only once all of it has landed (an
   * engine's async load), never group by group: a cuda engine may then
   * spread an H2D batch over several copy lanes (`PF_BATCH_WHOLE`). Its
   * groups still complete in order, in bursts.
   */
  whole?: boolean;
}

/** Where a batch stores its progress words (see `pf_batch_header`). */
export interface ProgressTarget {
  /** The shm object (or its u32 handle). */
  shm: SharedMemory | number;
  /** Byte offset in it, 8-aligned: u32 groups done, then i32 final status. */
  offset: number;
}

/**
 * A batch of copies: groups (one per layer, one completion each) of
 * segments (region offset, pool offset, bytes).
 *
 * @example
 * ```ts
 * const batch = new CopyBatch(32, 40_000);
 * batch.reset("d2h");
 * for (const layer of layers) {
 *   batch.group(layer.region, layer.id);
 *   for (const b of blocks) batch.seg(b * stride, poolOff(b, layer.id), 32768);
 * }
 * const { done } = copyEngine.submit(batch);
 * ```
 */
export class CopyBatch {
  /** Most groups this descriptor can hold. */
  readonly maxGroups: number;
  /** Most segments this descriptor can hold. */
  readonly maxSegs: number;
  /** The descriptor bytes (pass `buffer.subarray(0, byteLength)`). */
  readonly buffer: Uint8Array;
  readonly #u32: Uint32Array;
  readonly #segsWord: number;
  #groups = 0;
  #segs = 0;
  #groupFirst = 0;
  #bytes = 0;
  #direction: Direction = "d2h";
  #path: CopyPath = "host";

  /** Preallocates room for `maxGroups` groups and `maxSegs` segments. */
  constructor(maxGroups: number, maxSegs: number) {
    if (
      !(Number.isInteger(maxGroups) && maxGroups > 0) || !(Number.isInteger(maxSegs) && maxSegs > 0)
    ) {
      throw new RangeError(
        `CopyBatch: maxGroups ${maxGroups} and maxSegs ${maxSegs} must be positive integers`,
      );
    }
    this.maxGroups = maxGroups;
    this.maxSegs = maxSegs;
    const segsOff = HEADER_BYTES + GROUP_BYTES * maxGroups; // 8-aligned by construction
    this.buffer = new Uint8Array(segsOff + SEG_BYTES * maxSegs);
    this.#u32 = new Uint32Array(this.buffer.buffer);
    this.#segsWord = segsOff >> 2;
    this.#u32[6] = segsOff;
  }

  /** Groups written since reset. */
  get numGroups(): number {
    return this.#groups;
  }
  /** Segments written since reset. */
  get numSegs(): number {
    return this.#segs;
  }
  /** Sum of segment bytes since reset. */
  get bytes(): number {
    return this.#bytes;
  }
  /** Direction given to {@link CopyBatch.reset}. */
  get direction(): Direction {
    return this.#direction;
  }
  /** Path given to {@link CopyBatch.reset} or {@link CopyBatch.setPath}. */
  get path(): CopyPath {
    return this.#path;
  }
  /** Descriptor bytes in use (header, all group slots, written segments). */
  get byteLength(): number {
    return (this.#segsWord << 2) + SEG_BYTES * this.#segs;
  }

  /**
   * Starts a new batch in this buffer. `path` defaults to `host` (the host
   * backend's memcpy); a cuda engine needs a GPU path, set here or later
   * with {@link CopyBatch.setPath} by the path policy.
   */
  reset(
    direction: Direction,
    path: CopyPath = "host",
    progress?: ProgressTarget,
    opts: BatchOptions = {},
  ): this {
    const d = DIRECTION_CODES[direction];
    const p = PATH_CODES[path];
    if (d === undefined) {
      throw new TypeError(`CopyBatch.reset: direction "${direction}"; expected d2h or h2d`);
    }
    if (p === undefined) {
      throw new TypeError(
        `CopyBatch.reset: path "${path}"; expected host, kernel, dma_batch, dma or mixed`,
      );
    }
    this.#groups = 0;
    this.#segs = 0;
    this.#groupFirst = 0;
    this.#bytes = 0;
    this.#direction = direction;
    this.#path = path;
    const u = this.#u32;
    u[2] = d;
    u[3] = p;
    if (progress) {
      u[4] = typeof progress.shm === "number" ? progress.shm : progress.shm.handle;
      u[5] = progress.offset;
    } else {
      u[4] = 0;
      u[5] = 0;
    }
    u[7] = opts.whole ? BATCH_WHOLE : 0;
    return this;
  }

  /**
   * Whether the batch posts a LAYER record per group (`quiet` false, the
   * default after {@link CopyBatch.reset}) or only its BATCH record
   * (`PF_BATCH_QUIET`). Set by the submitter, which knows whether anything
   * watches the groups land (`CopyEngine.submit` vs `submitQuiet`).
   */
  setQuiet(quiet: boolean): this {
    const u = this.#u32;
    u[7] = quiet ? u[7] | BATCH_QUIET : u[7] & ~BATCH_QUIET;
    return this;
  }

  /** Overrides the path after the batch is built (path policy). */
  setPath(path: CopyPath): this {
    const p = PATH_CODES[path];
    if (p === undefined) {
      throw new TypeError(
        `CopyBatch.setPath: path "${path}"; expected host, kernel, dma_batch, dma or mixed`,
      );
    }
    this.#path = path;
    this.#u32[3] = p;
    return this;
  }

  /** Opens the next group: following segments belong to `region`, `layer`. */
  group(region: Region | number, layer: number): this {
    if (this.#groups === this.maxGroups) {
      throw new RangeError(
        `CopyBatch.group: layer ${layer}: batch holds at most ${this.maxGroups} groups`,
      );
    }
    this.#closeGroup();
    const w = (HEADER_BYTES >> 2) + this.#groups * (GROUP_BYTES >> 2);
    const u = this.#u32;
    u[w] = typeof region === "number" ? region : region.id;
    u[w + 1] = layer;
    u[w + 2] = this.#segs;
    u[w + 3] = 0;
    this.#groupFirst = this.#segs;
    this.#groups++;
    return this;
  }

  /**
   * Adds one segment to the current group. Offsets and bytes are integers in
   * [0, 2^53): anything else (negative, NaN, fractional) throws a RangeError
   * here, since its u32 halves would spell another, valid-looking offset.
   */
  seg(regionOff: number, poolOff: number, bytes: number): this {
    if (this.#groups === 0) throw new RangeError("CopyBatch.seg: call group() first");
    if (this.#segs === this.maxSegs) {
      throw new RangeError(`CopyBatch.seg: batch holds at most ${this.maxSegs} segments`);
    }
    if (!(isU53(regionOff) && isU53(poolOff) && isU53(bytes))) {
      throw notU53(
        `CopyBatch.seg: segment ${this.#segs} (group ${this.#groups - 1})`,
        ["regionOff", "poolOff", "bytes"],
        [regionOff, poolOff, bytes],
      );
    }
    const u = this.#u32;
    const w = this.#segsWord + this.#segs * (SEG_BYTES >> 2);
    u[w] = regionOff >>> 0;
    u[w + 1] = (regionOff / TWO32) >>> 0;
    u[w + 2] = poolOff >>> 0;
    u[w + 3] = (poolOff / TWO32) >>> 0;
    u[w + 4] = bytes >>> 0;
    u[w + 5] = (bytes / TWO32) >>> 0;
    this.#segs++;
    this.#bytes += bytes;
    return this;
  }

  #closeGroup(): void {
    if (this.#groups > 0) {
      this.#u32[(HEADER_BYTES >> 2) + (this.#groups - 1) * (GROUP_BYTES >> 2) + 3] = this.#segs -
        this.#groupFirst;
    }
  }

  /** Writes the counts into the header; returns the bytes to submit. */
  finish(): Uint8Array {
    this.#closeGroup();
    this.#u32[0] = this.#groups;
    this.#u32[1] = this.#segs;
    return this.buffer.subarray(0, this.byteLength);
  }
}
