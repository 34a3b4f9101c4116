/**
 * SSD write-behind: sealed blocks become records on disk. A credit-bounded
 * stage (`ssd.write`): a queue of batches with policy `drop-newest` (a full
 * queue drops the batch being offered and counts it; a save never waits on
 * the SSD) in front of `inflight` batch writers.
 *
 * A batch is pinned in RAM only when its write starts (one `pin` call for
 * the batch); a block RAM evicted before that is skipped. Each batch is
 * split in chunks the header arena can stage; a chunk is placed in the
 * segment ring, checksummed by the reaper thread, headed (key, layout
 * fingerprint, CRC, sequence, epoch, generation), written in one io batch,
 * and indexed once its write succeeded.
 *
 * A record not written (its op failed, or its io batch was refused whole)
 * is counted and logged with its block, namespace, file and offset; a pad
 * header is written over it (pads.ts: a restart's scan steps over the gap to
 * the records placed after it), its segment is released for reuse either
 * way, and the batch's pin goes only once every chunk of the batch ended (a
 * write in flight reads the pool).
 *
 * A drop (a discard, {@link SsdWriter.drop}) is durable (drops.ts): the
 * record is padded over, a write of the key still queued is not written, and
 * one in flight is padded over when it lands.
 *
 * @module
 */

import { Stage, type StageMetrics, type StageOptions } from "../pipeline/stage.ts";
import type { LayoutIdentity } from "../storage/layout.ts";
import { encodeHeader, keyBytes, recordBytes } from "./format.ts";
import type { IoBatch, IoBatchResult, SsdIo } from "./io.ts";
import type { PoolExtent } from "../transfer/ranges.ts";
import type { SsdIndex } from "./index.ts";
import type { SegmentRing } from "./space.ts";
import type { CacheFile } from "./cache_files.ts";
import { ewma } from "./throughput.ts";
import { type PadSite, SsdPads, type SsdPadStats } from "./pads.ts";
import { type PendingWrite, SsdDrops } from "./drops.ts";
import { errorText, type Logger } from "../log.ts";

/** A sealed block offered for write-behind. */
export interface SsdWriteBlock {
  /** Record key (`namespace:hex`), stored in the record header. */
  key: string;
  /** The block's namespace and its layout: stored in the record, checked on every read. */
  namespace: string;
  layout: LayoutIdentity;
}

/**
 * What a write batch pinned when its write started: per block (aligned with
 * the blocks asked), the pool extents of its bytes in record order, or
 * undefined when RAM evicted it since (it is skipped, not kept alive).
 * Pinned until `release()`, which the tier calls once, after the write.
 */
export interface SsdPinned {
  readonly extents: readonly (readonly PoolExtent[] | undefined)[];
  release(): void;
}

/**
 * Blocks offered for write-behind together. The tier pins them only when
 * their write starts, with one `pin` call for the blocks it will write (the
 * ones not already on SSD or queued).
 */
export interface SsdWriteBatch<B extends SsdWriteBlock = SsdWriteBlock> {
  readonly blocks: readonly B[];
  pin(blocks: readonly B[]): SsdPinned;
}

/** What {@link SsdWriter.enqueue} did. */
export interface EnqueueResult {
  status: "queued" | "dropped" | "nothing-to-write";
  /** Blocks in the queued (or dropped) batch. */
  blocks: number;
  /** Blocks skipped because already on SSD or already queued. */
  duplicates: number;
}

/**
 * Stage settings of write-behind: a full queue drops the newest batch (a
 * save never waits on the SSD), `inflight` batches run at once.
 */
export function writeStageOptions(queueDepth: number, inflight: number): StageOptions {
  return { concurrency: inflight, queue: { depth: queueDepth, policy: "drop-newest" } };
}

/** A block given segment space in a write batch. */
interface Placed extends PadSite {
  block: SsdWriteBlock;
  mark: PendingWrite;
}

interface WriteJob {
  blocks: SsdWriteBlock[];
  /** Per block (aligned with `blocks`): its pending write. */
  marks: PendingWrite[];
  /** Pins `blocks` (called when the write starts). */
  pin: () => SsdPinned;
}

/** Write-behind counters (part of `SsdStats`). */
export interface SsdWriteStats extends SsdPadStats {
  writeBytes: number;
  writeBlocks: number;
  writeFailures: number;
  writeQueueDepth: number;
  writeInflight: number;
  writeQueueFullDrops: number;
  writeQueueFullDroppedBlocks: number;
  writeSkippedEvicted: number;
  writeSkippedNoSpace: number;
  /** Write batches (and their blocks) dropped because the tier was degraded (stall.ts). */
  writeDegradedDrops: number;
  writeDegradedDroppedBlocks: number;
  writeThroughputBps: number;
}

/** What the writer works on (the tier's open files, ring, index and io). */
export interface SsdWriterDeps {
  io: SsdIo;
  files: readonly CacheFile[];
  segments: SegmentRing;
  index: SsdIndex;
  log: Logger;
  /** Blocks per io batch (bounded by the header arena). */
  chunk: number;
  /** Sequence number of the next record (after the newest one recovered). */
  nextSeq: number;
  queueDepth: number;
  inflight: number;
  metrics?: StageMetrics;
  /** True while the io is stalled (stall.ts): offered batches are dropped and counted. */
  degraded?: () => boolean;
}

/**
 * The write-behind flow of one SSD tier.
 *
 * @example
 * ```ts
 * const w = new SsdWriter({ io, files, segments, index, log, chunk: 64, nextSeq: 1,
 *   queueDepth: 64, inflight: 4 });
 * w.enqueue({ blocks, pin: (fresh) => pinInRam(fresh) }); // queued | dropped | nothing-to-write
 * await w.flush();
 * ```
 */
export class SsdWriter {
  readonly #io: SsdIo;
  readonly #files: readonly CacheFile[];
  readonly #segments: SegmentRing;
  readonly #index: SsdIndex;
  readonly #log: Logger;
  readonly #chunk: number;
  readonly #stage: Stage<WriteJob, void>;
  readonly #pads: SsdPads;
  /** The writes queued or running per key, and the drops (drops.ts). */
  readonly #drops: SsdDrops;
  readonly #degraded: () => boolean;
  /** Write batches accepted and not yet ended (what {@link flush} waits for). */
  readonly #writesPending = new Set<Promise<unknown>>();
  #seq: number;
  #closed = false;
  readonly #s = {
    writeBytes: 0,
    writeBlocks: 0,
    writeFailures: 0,
    writeQueueFullDrops: 0,
    writeQueueFullDroppedBlocks: 0,
    writeSkippedEvicted: 0,
    writeSkippedNoSpace: 0,
    writeDegradedDrops: 0,
    writeDegradedDroppedBlocks: 0,
    writeThroughputBps: 0,
  };

  constructor(d: SsdWriterDeps) {
    this.#io = d.io;
    this.#files = d.files;
    this.#segments = d.segments;
    this.#index = d.index;
    this.#log = d.log;
    this.#chunk = d.chunk;
    this.#seq = d.nextSeq;
    this.#degraded = d.degraded ?? (() => false);
    this.#pads = new SsdPads(d.io, d.files, d.log, d.chunk);
    this.#drops = new SsdDrops(d.index, this.#pads, d.log, (ended) => this.#track(ended));
    this.#stage = new Stage<WriteJob, void>(
      "ssd.write",
      { ...writeStageOptions(d.queueDepth, d.inflight), metrics: d.metrics },
      (job) => this.#writeJob(job),
    );
  }

  /**
   * Offers sealed blocks for writing. Never waits: when the write queue is
   * full the batch is dropped and counted (and never pinned). Blocks already
   * on SSD or already queued are skipped.
   */
  enqueue<B extends SsdWriteBlock>(batch: SsdWriteBatch<B>): EnqueueResult {
    const { blocks } = batch;
    if (this.#closed) return { status: "dropped", blocks: blocks.length, duplicates: 0 };
    if (this.#degraded()) {
      // A stalled disk: a new batch would only pin RAM behind it.
      this.#s.writeDegradedDrops++;
      this.#s.writeDegradedDroppedBlocks += blocks.length;
      return { status: "dropped", blocks: blocks.length, duplicates: 0 };
    }
    const fresh: B[] = [];
    const seen = new Set<string>();
    let duplicates = 0;
    for (const b of blocks) {
      // A record of the key from another layout does not count: this one is written too.
      const held = this.#index.get(b.key)?.layout === b.layout.fingerprint;
      // A key twice in one batch is written once (else two records, two pins, one block);
      // a write of it dropped meanwhile holds nothing: this one is written.
      if (held || this.#drops.writing(b.key) || seen.has(b.key)) duplicates++;
      else {
        seen.add(b.key);
        fresh.push(b);
      }
    }
    if (fresh.length === 0) return { status: "nothing-to-write", blocks: 0, duplicates };
    // Marked before the submit: a free worker starts the batch inside it, and may end it there.
    const marks = fresh.map((b) => this.#drops.mark(b.key));
    const sub = this.#stage.submit({ blocks: fresh, marks, pin: () => batch.pin(fresh) });
    if (sub.status === "dropped" || sub.status === "refused") {
      this.#drops.unmark(fresh, marks);
      this.#s.writeQueueFullDrops++;
      this.#s.writeQueueFullDroppedBlocks += fresh.length;
      return { status: "dropped", blocks: fresh.length, duplicates };
    }
    this.#track(sub.done());
    return { status: "queued", blocks: fresh.length, duplicates };
  }

  /** Counts `ended` among the writes {@link flush} waits for. */
  #track(ended: Promise<unknown>): void {
    this.#writesPending.add(ended);
    ended.then(() => this.#writesPending.delete(ended));
  }

  /**
   * Forgets `keys` (a discard), durably (drops.ts): unindexed now, a pad
   * written over each record (which {@link flush} waits for), so a restart
   * does not index them again; a write of one still queued is not written,
   * one in flight is padded over when it lands. Never waits. Returns the
   * blocks the index held.
   */
  drop(keys: readonly string[]): number {
    return this.#drops.drop(keys);
  }

  /**
   * Resolves when every write accepted so far has ended (tests, shutdown).
   * No deadline of its own: the tier's flush bounds it (stall.ts).
   */
  async flush(): Promise<void> {
    while (this.#writesPending.size > 0) await Promise.all(this.#writesPending);
  }

  async #writeJob(job: WriteJob): Promise<void> {
    // Pinned now, not when queued: a queued batch keeps nothing from eviction.
    let pinned: SsdPinned;
    try {
      pinned = job.pin();
    } catch (e) {
      this.#drops.unmark(job.blocks, job.marks);
      this.#s.writeFailures += job.blocks.length;
      this.#log.error("SSD write batch could not be pinned in RAM: not written", {
        block: job.blocks[0].key,
        namespace: job.blocks[0].namespace,
        blocks: job.blocks.length,
        error: errorText(e),
      });
      return;
    }
    try {
      const chunks = [];
      for (let start = 0; start < job.blocks.length; start += this.#chunk) {
        const end = Math.min(job.blocks.length, start + this.#chunk);
        const marks = job.marks.slice(start, end);
        chunks.push(
          this.#writeChunk(job.blocks.slice(start, end), marks, pinned.extents.slice(start, end)),
        );
      }
      // Every chunk ends before the pin goes: a write in flight still reads those pool bytes.
      const bug = (await Promise.allSettled(chunks)).find((c) => c.status === "rejected");
      if (bug) throw bug.reason; // I/O errors are counted per block; this is the stage's failure
    } finally {
      this.#drops.unmark(job.blocks, job.marks);
      pinned.release();
    }
  }

  /** One io_uring batch for a chunk: placed, checksummed, headers written, submitted, indexed. */
  async #writeChunk(
    blocks: SsdWriteBlock[],
    marks: PendingWrite[],
    pinned: readonly (readonly PoolExtent[] | undefined)[],
  ): Promise<void> {
    const batch = this.#io.newBatch();
    const placed = this.#place(blocks, marks, pinned, batch);
    if (placed.length === 0) return;
    const t0 = performance.now();
    const failed: Placed[] = [];
    const dropped: Placed[] = [];
    try {
      let crcs: Uint32Array;
      let r: IoBatchResult;
      try {
        crcs = await this.#io.checksum(batch);
        this.#writeHeaders(batch, placed, crcs);
        r = await this.#io.run(batch);
      } catch (e) {
        // Refused whole (a malformed batch, the engine closing): none of it was written.
        for (const p of placed) this.#writeFailed(p, errorText(e));
        failed.push(...placed);
        return;
      }
      r.release();
      const bytes = this.#indexWritten(placed, r, crcs, failed, dropped);
      this.#s.writeBytes += bytes;
      this.#s.writeThroughputBps = ewma(
        this.#s.writeThroughputBps,
        bytes / ((performance.now() - t0) / 1000),
      );
    } finally {
      // Padded while the records still hold their segments (none is reused meanwhile).
      try {
        await Promise.all([
          failed.length > 0 && this.#pads.gaps(failed),
          dropped.length > 0 && this.#pads.dropped(dropped),
        ]);
      } finally {
        for (const p of placed) p.seg.inflightWrites--;
      }
    }
  }

  /**
   * Segment space for each still-pinned block and its write in `batch`; a
   * block evicted before its pin, or with no space, is skipped and counted.
   */
  #place(
    blocks: SsdWriteBlock[],
    marks: PendingWrite[],
    pinned: readonly (readonly PoolExtent[] | undefined)[],
    batch: IoBatch,
  ): Placed[] {
    const placed: Placed[] = [];
    for (let i = 0; i < blocks.length; i++) {
      const block = blocks[i];
      const extents = pinned[i];
      if (marks[i].dropped) continue; // discarded while queued: nothing to write
      if (!extents) {
        this.#s.writeSkippedEvicted++;
        continue;
      }
      const bytes = extents.reduce((n, e) => n + e.bytes, 0);
      const seq = this.#seq++;
      const a = this.#segments.allocate(recordBytes(bytes), seq);
      if (typeof a === "string") {
        this.#s.writeSkippedNoSpace++;
        this.#log.warn("block not written to SSD", { block: block.key, bytes, reason: a });
        continue;
      }
      placed.push({ block, mark: marks[i], seg: a.segment, off: a.fileOffset, bytes, seq });
      batch.write(this.#files[a.segment.file].handle, a.fileOffset, true, [...extents]);
    }
    return placed;
  }

  /** Each record's header page: key, sequence, payload checksum, layout. */
  #writeHeaders(batch: IoBatch, placed: Placed[], crcs: Uint32Array): void {
    const now = Date.now();
    for (let i = 0; i < placed.length; i++) {
      const p = placed[i];
      encodeHeader(batch.headerPage(i), {
        key: p.block.key,
        seq: p.seq,
        epoch: p.seg.epoch,
        payloadBytes: p.bytes,
        payloadCrc: crcs[i],
        recordBytes: recordBytes(p.bytes),
        writtenAtMs: now,
        generation: this.#files[p.seg.file].generation,
        namespace: p.block.namespace,
        layout: p.block.layout.fingerprint,
        layoutSummary: p.block.layout.summary,
      }, keyBytes(p.block.key));
    }
  }

  /**
   * Indexes the records that landed, logs the ones that failed (added to
   * `failed`); a record that landed dropped goes to `dropped` (padded over,
   * never indexed). Returns the bytes written.
   */
  #indexWritten(
    placed: Placed[],
    r: IoBatchResult,
    crcs: Uint32Array,
    failed: Placed[],
    dropped: Placed[],
  ): number {
    let bytes = 0;
    for (let i = 0; i < placed.length; i++) {
      const p = placed[i];
      if (r.status[i] === 0 && p.mark.dropped) {
        bytes += p.bytes;
        dropped.push(p);
      } else if (r.status[i] === 0) {
        // The segment may have been reused meanwhile only if it had no
        // write in flight, and this one was: the location is current.
        this.#index.put(p.block.key, {
          segment: p.seg,
          fileOffset: p.off,
          payloadBytes: p.bytes,
          payloadCrc: crcs[i],
          seq: p.seq,
          namespace: p.block.namespace,
          layout: p.block.layout.fingerprint,
        }, p.block.layout.summary);
        bytes += p.bytes;
        this.#s.writeBlocks++;
      } else {
        this.#writeFailed(p, r.errorText(i), r.aux[i]);
        failed.push(p);
      }
    }
    return bytes;
  }

  /** Counts and logs a record that was not written (it is not indexed), a gap in its segment. */
  #writeFailed(p: Placed, error: string, errno?: number): void {
    this.#segments.sealAfterGap(p.seg);
    this.#s.writeFailures++;
    this.#log.error("SSD write failed", {
      block: p.block.key,
      namespace: p.block.namespace,
      error,
      errno,
      path: this.#files[p.seg.file].path,
      offset: p.off,
      bytes: recordBytes(p.bytes),
    });
  }

  /** Counters and gauges. */
  stats(): SsdWriteStats {
    const w = this.#stage.stats();
    return {
      ...this.#s,
      ...this.#pads.stats(),
      writeQueueDepth: w.queue.depth,
      writeInflight: w.inflight,
    };
  }

  /** The files whose fdatasync after a drop's pads has not returned (what a give-up names). */
  padSyncs(): string[] {
    return this.#pads.syncing();
  }

  /** Stops accepting batches; resolves when the accepted ones and the drops' pads have ended. */
  async close(): Promise<void> {
    this.#closed = true;
    await this.#stage.drain();
    await this.flush();
    this.#drops.close();
  }
}
