/**
 * Batches of record reads and writes over the io_uring engine: builds one
 * descriptor per batch (no per-block FFI call), hands out header staging
 * pages, and turns the batch's completion records into one Promise.
 *
 * @module
 */

import type { Observable, Subscription } from "rxjs";
import type { Completion } from "../../ffi/ring.ts";
import {
  DONE_IO,
  DONE_IO_BATCH,
  errnoText,
  IO_BATCH_HEADER_BYTES,
  IO_DESC_BYTES,
  IO_EXT_BYTES,
  IO_HDR_BYTES,
  IoFlag,
  IoOp,
  poolCrc32c,
  type Uring,
} from "../../ffi/uring.ts";

import type { PoolExtent } from "../transfer/ranges.ts";

/** One record of the completion ring (the fields the SSD tier reads). */
export type IoCompletion = Pick<Completion, "tag" | "kind" | "index" | "status" | "aux" | "value">;

/**
 * SSD tags live in their own range of the shared completion ring's tag space
 * (2^50 up; the copy engine counts from 1) so they never collide, and stay
 * below 2^53 so they survive the ring's Number conversion.
 */
export const SSD_TAG_BASE = 2 ** 50;

/**
 * An io batch outstanding longer than this is stalled: a healthy NVMe
 * completes a whole batch in milliseconds, so 30 s means a dead device or a
 * lost network mount, not load (the tier then stops taking new work).
 */
export const DEFAULT_IO_STALL_MS = 30_000;

/** The oldest io batch still in the kernel (what a stall or a give-up names). */
export interface IoOutstanding {
  /** The batch's first op: its kind, file handle (and path, once named) and file offset. */
  op: "read" | "write";
  file: number;
  path: string;
  fileOffset: number;
  /** Ops in that batch. */
  ops: number;
  /** How long it has been in the kernel. */
  ageMs: number;
  /** Batches in the kernel now, this one included. */
  batches: number;
  /** Batches past the stall deadline now. */
  stalledBatches: number;
}

/**
 * The ops of one io batch, built before submission.
 *
 * @example
 * ```ts
 * const b = io.newBatch();
 * const i = b.write(file, off, true, [{ offset: poolOff, bytes }]);
 * const crcs = await io.checksum(b);
 * encodeHeader(b.headerPage(i), { ..., payloadCrc: crcs[i] });
 * const r = await io.run(b);
 * ```
 */
export class IoBatch {
  readonly files: number[] = [];
  readonly kinds: number[] = [];
  readonly flags: number[] = [];
  readonly hasHeader: boolean[] = [];
  readonly fileOffsets: number[] = [];
  readonly firstExt: number[] = [];
  readonly numExt: number[] = [];
  readonly extOffsets: number[] = [];
  readonly extBytes: number[] = [];
  #headers: Uint8Array = new Uint8Array(0);
  #headerIndex: number[] = [];
  #numHeaders = 0;

  /** Ops in the batch. */
  get size(): number {
    return this.files.length;
  }

  /** Ops that carry a header page. */
  get headerCount(): number {
    return this.#numHeaders;
  }

  /** Adds a read of [header page] + extents at `fileOffset`; `crc` asks C for the payload CRC32C. */
  read(
    file: number,
    fileOffset: number,
    header: boolean,
    extents: PoolExtent[],
    crc: boolean,
  ): number {
    return this.#add(file, IoOp.READ, crc ? IoFlag.CRC : 0, fileOffset, header, extents);
  }

  /** Adds a write of [header page] + extents at `fileOffset`; fill the header via {@link headerPage}. */
  write(file: number, fileOffset: number, header: boolean, extents: PoolExtent[]): number {
    return this.#add(file, IoOp.WRITE, 0, fileOffset, header, extents);
  }

  /** The batch-local page that becomes op `i`'s header (writes) — copied at submit. */
  headerPage(i: number): Uint8Array {
    const h = this.#headerIndex[i];
    if (h === undefined || h < 0) throw new RangeError(`io op ${i} has no header page`);
    return this.#headers.subarray(h * IO_HDR_BYTES, (h + 1) * IO_HDR_BYTES);
  }

  /** Index among header-carrying ops of op `i`, or -1. */
  headerSlotIndex(i: number): number {
    return this.#headerIndex[i] ?? -1;
  }

  /** All header pages, in header order. */
  get headerBytes(): Uint8Array {
    return this.#headers.subarray(0, this.#numHeaders * IO_HDR_BYTES);
  }

  /** The C descriptor (`pf_io_batch_header` + ops + extents); `pages[h]` = arena page of header h. */
  encode(pages: ArrayLike<number> | null): Uint8Array {
    const n = this.files.length, m = this.extOffsets.length;
    const buf = new Uint8Array(IO_BATCH_HEADER_BYTES + n * IO_DESC_BYTES + m * IO_EXT_BYTES);
    const v = new DataView(buf.buffer);
    v.setUint32(0, n, true);
    v.setUint32(4, m, true);
    let o = IO_BATCH_HEADER_BYTES;
    for (let i = 0; i < n; i++, o += IO_DESC_BYTES) {
      const h = this.#headerIndex[i];
      v.setUint32(o, this.files[i], true);
      v.setUint32(o + 4, this.kinds[i], true);
      v.setUint32(o + 8, this.flags[i], true);
      v.setUint32(o + 12, h >= 0 && pages ? pages[h] + 1 : 0, true);
      v.setBigUint64(o + 16, BigInt(this.fileOffsets[i]), true);
      v.setUint32(o + 24, this.firstExt[i], true);
      v.setUint32(o + 28, this.numExt[i], true);
    }
    for (let e = 0; e < m; e++, o += IO_EXT_BYTES) {
      v.setBigUint64(o, BigInt(this.extOffsets[e]), true);
      v.setBigUint64(o + 8, BigInt(this.extBytes[e]), true);
    }
    return buf;
  }

  #add(file: number, kind: number, flags: number, off: number, header: boolean, ext: PoolExtent[]) {
    if (!header && ext.length === 0) throw new RangeError("an io op needs a header or extents");
    const i = this.files.length;
    this.files.push(file);
    this.kinds.push(kind);
    this.flags.push(flags);
    this.hasHeader.push(header);
    this.fileOffsets.push(off);
    this.firstExt.push(this.extOffsets.length);
    this.numExt.push(ext.length);
    for (const e of ext) {
      this.extOffsets.push(e.offset);
      this.extBytes.push(e.bytes);
    }
    if (header) {
      const h = this.#numHeaders++;
      if (this.#headers.length < this.#numHeaders * IO_HDR_BYTES) {
        const grown = new Uint8Array(
          Math.max(this.#numHeaders, 2 * this.#headers.length / IO_HDR_BYTES) * IO_HDR_BYTES,
        );
        grown.set(this.#headers);
        this.#headers = grown;
      }
      this.#headerIndex.push(h);
    } else {
      this.#headerIndex.push(-1);
    }
    return i;
  }
}

/** Per-op outcome of a batch; header pages stay readable until {@link IoBatchResult.release}. */
export interface IoBatchResult {
  /** PF_OK (0) or PF_EIO per op. */
  status: Int32Array;
  /** errno on failure; the payload CRC32C for reads with `crc`. */
  aux: Uint32Array;
  /** Bytes moved per op. */
  bytes: Float64Array;
  /** Ops that failed. */
  failed: number;
  /** Op `i`'s header page as it is in the arena (reads: what came from disk). */
  header(i: number): Uint8Array;
  /** `strerror` of op `i`'s errno. */
  errorText(i: number): string;
  /** Returns the header pages to the arena. Call once. */
  release(): void;
}

interface Pending {
  status: Int32Array;
  aux: Uint32Array;
  bytes: Float64Array;
  resolve: (failed: number) => void;
  /** performance.now() at submit. */
  at: number;
  op: "read" | "write";
  file: number;
  fileOffset: number;
  ops: number;
  /** Fires when the batch passes the stall deadline. */
  timer: number;
  stalled: boolean;
}

/** Told when the first batch stalls (the oldest outstanding) and when none is stalled any more. */
export type IoStallListener = (stalled: IoOutstanding | undefined) => void;

/**
 * Runs {@link IoBatch}es on a {@link Uring}: header pages are lent from the
 * staging arena for the life of a batch (callers wait, FIFO, when the arena
 * is exhausted), completions are matched by tag.
 */
export class SsdIo {
  readonly #uring: Uring;
  readonly #pool: number;
  readonly #pending = new Map<number, Pending>();
  readonly #freePages: number[] = [];
  readonly #pageWaiters: { n: number; grant: (pages: number[]) => void }[] = [];
  readonly #sub: Subscription;
  readonly #stallMs: number;
  readonly #stallListeners: IoStallListener[] = [];
  readonly #paths = new Map<number, string>();
  #refused: string | undefined;
  #stalledNow = 0;
  #stalls = 0;
  #nextTag = 1;

  /** `stallMs`: a batch outstanding longer is stalled (see {@link onStall}). */
  constructor(
    uring: Uring,
    pool: number,
    completions: Observable<IoCompletion>,
    stallMs = DEFAULT_IO_STALL_MS,
  ) {
    this.#uring = uring;
    this.#pool = pool;
    this.#stallMs = stallMs;
    for (let p = uring.hdrPages - 1; p >= 0; p--) this.#freePages.push(p);
    this.#sub = completions.subscribe((c) => this.#onCompletion(c));
  }

  /** The engine underneath. */
  get uring(): Uring {
    return this.#uring;
  }

  /** Names file handle `file` by `path` in what a stall or a give-up reports. */
  namePath(file: number, path: string): void {
    this.#paths.set(file, path);
  }

  /** The path named for `file`, else a text naming its handle. */
  pathOf(file: number): string {
    return this.#paths.get(file) ?? `file handle ${file}`;
  }

  /**
   * Refuses every later {@link run} with an Error saying `why` (an open that
   * gave up: its remaining steps must not add io to a stalled disk). Batches
   * already submitted still complete.
   */
  refuse(why: string): void {
    this.#refused = why;
  }

  /** A new, empty batch. */
  newBatch(): IoBatch {
    return new IoBatch();
  }

  /** CRC32C of each op's pool extents (header excluded), off the JS thread. */
  async checksum(batch: IoBatch): Promise<Uint32Array> {
    const out = new Uint32Array(batch.size);
    if (batch.size > 0) await poolCrc32c(this.#pool, batch.encode(null), out);
    return out;
  }

  /**
   * Submits the batch and resolves when every op completed. Never rejects for
   * an I/O error (those are per-op statuses); throws for a malformed batch or
   * a closed engine.
   */
  async run(batch: IoBatch): Promise<IoBatchResult> {
    if (this.#refused !== undefined) throw new Error(`SSD io refused: ${this.#refused}`);
    const n = batch.size;
    const pages = await this.#takePages(batch.headerCount);
    const arena = this.#uring.headers;
    const src = batch.headerBytes;
    for (let h = 0; h < pages.length; h++) {
      arena.set(src.subarray(h * IO_HDR_BYTES, (h + 1) * IO_HDR_BYTES), pages[h] * IO_HDR_BYTES);
    }
    const tag = SSD_TAG_BASE + this.#nextTag++;
    const p: Pending = {
      status: new Int32Array(n),
      aux: new Uint32Array(n),
      bytes: new Float64Array(n),
      resolve: () => {},
      at: performance.now(),
      op: batch.kinds[0] === IoOp.WRITE ? "write" : "read",
      file: batch.files[0],
      fileOffset: batch.fileOffsets[0],
      ops: n,
      timer: 0,
      stalled: false,
    };
    const done = new Promise<number>((resolve) => (p.resolve = resolve));
    this.#pending.set(tag, p);
    try {
      this.#uring.submit(batch.encode(pages), BigInt(tag));
    } catch (e) {
      this.#pending.delete(tag);
      this.#givePages(pages);
      throw e;
    }
    // No deadline can end the wait itself: the kernel may still read or fill
    // those pool pages. A batch past the deadline is reported as stalled.
    p.timer = Number(setTimeout(() => this.#stalled(p), this.#stallMs));
    Deno.unrefTimer(p.timer);
    const failed = await done;
    let released = false;
    return {
      status: p.status,
      aux: p.aux,
      bytes: p.bytes,
      failed,
      header: (i) => {
        const h = batch.headerSlotIndex(i);
        if (h < 0 || released) throw new RangeError(`io op ${i}: no header page (or released)`);
        return arena.subarray(pages[h] * IO_HDR_BYTES, (pages[h] + 1) * IO_HDR_BYTES);
      },
      errorText: (i) => errnoText(p.aux[i]),
      release: () => {
        if (released) return;
        released = true;
        this.#givePages(pages);
      },
    };
  }

  /** Batches awaiting completion. */
  get inflightBatches(): number {
    return this.#pending.size;
  }

  /**
   * Calls `listener` with the oldest outstanding batch when a batch passes
   * the stall deadline while none was stalled, and with undefined once every
   * stalled batch completed. Returns the call that stops the calls.
   */
  onStall(listener: IoStallListener): () => void {
    this.#stallListeners.push(listener);
    return () => {
      const i = this.#stallListeners.indexOf(listener);
      if (i >= 0) this.#stallListeners.splice(i, 1);
    };
  }

  /** True while a batch is outstanding past the stall deadline. */
  get stalled(): boolean {
    return this.#stalledNow > 0;
  }

  /** Batches that passed the stall deadline, ever. */
  get stalls(): number {
    return this.#stalls;
  }

  /** The oldest batch in the kernel now, or undefined when none is. */
  oldestOutstanding(): IoOutstanding | undefined {
    let oldest: Pending | undefined;
    for (const p of this.#pending.values()) if (!oldest || p.at < oldest.at) oldest = p;
    if (!oldest) return undefined;
    return {
      op: oldest.op,
      file: oldest.file,
      path: this.pathOf(oldest.file),
      fileOffset: oldest.fileOffset,
      ops: oldest.ops,
      ageMs: Math.round(performance.now() - oldest.at),
      batches: this.#pending.size,
      stalledBatches: this.#stalledNow,
    };
  }

  /** Stops listening to completions (after the tier drained). */
  dispose(): void {
    this.#sub.unsubscribe();
    for (const p of this.#pending.values()) clearTimeout(p.timer);
  }

  #stalled(p: Pending): void {
    p.stalled = true;
    this.#stalls++;
    if (this.#stalledNow++ > 0) return;
    const oldest = this.oldestOutstanding();
    for (const l of [...this.#stallListeners]) l(oldest);
  }

  #onCompletion(c: IoCompletion): void {
    const p = this.#pending.get(c.tag);
    if (!p) return; // another user of the shared ring
    if (c.kind === DONE_IO) {
      p.status[c.index] = c.status;
      p.aux[c.index] = c.aux;
      p.bytes[c.index] = Number(c.value);
    } else if (c.kind === DONE_IO_BATCH) {
      this.#pending.delete(c.tag);
      clearTimeout(p.timer);
      if (p.stalled && --this.#stalledNow === 0) {
        for (const l of [...this.#stallListeners]) l(undefined);
      }
      p.resolve(c.aux);
    }
  }

  #takePages(n: number): Promise<number[]> {
    if (n > this.#uring.hdrPages) {
      throw new RangeError(
        `io batch needs ${n} header pages; the staging arena has ${this.#uring.hdrPages} (split the batch)`,
      );
    }
    if (n === 0) return Promise.resolve([]);
    if (this.#pageWaiters.length === 0 && this.#freePages.length >= n) {
      return Promise.resolve(this.#freePages.splice(this.#freePages.length - n, n));
    }
    return new Promise((grant) => this.#pageWaiters.push({ n, grant }));
  }

  #givePages(pages: number[]): void {
    for (const p of pages) this.#freePages.push(p);
    while (this.#pageWaiters.length > 0 && this.#freePages.length >= this.#pageWaiters[0].n) {
      const w = this.#pageWaiters.shift()!;
      w.grant(this.#freePages.splice(this.#freePages.length - w.n, w.n));
    }
  }
}
