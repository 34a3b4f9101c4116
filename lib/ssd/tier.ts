/**
 * The SSD tier: write-behind of sealed blocks and prefetch into the pinned
 * pool, on io_uring, with per-record checksums and an index that survives
 * restarts. This module opens it and puts its parts together:
 *
 * | part                | module            |
 * | ------------------- | ----------------- |
 * | cache files, locks  | cache_files.ts    |
 * | index rebuild       | recovery.ts       |
 * | segment ring        | space.ts          |
 * | write-behind stage  | write_behind.ts   |
 * | prefetch stage      | prefetch.ts       |
 * | a prefetch's read   | prefetch_read.ts  |
 * | record format, CRC  | format.ts         |
 * | io batches          | io.ts             |
 *
 * It is the SSD's mechanism keyed by record key (`namespace:hex`, the key
 * stored in every record header); the server reaches it only through the
 * `Tier` port, which lib/ssd/ssd_tier_port.ts implements over it:
 *  - `SsdTier.open(opts)` at start (after the pool and completion ring);
 *  - `enqueueWrite(batch)` for sealed blocks (the batch pins its blocks in
 *    RAM only when the write starts);
 *  - `lookupPrefix(keys)` / `prefetch(reqId, keys, allocate)` / `poll(reqId)`
 *    for the keys past the RAM prefix;
 *  - `stats()` / `registerSsdMetrics` for /metrics; `close()` at shutdown.
 *
 * Every record carries its namespace's layout fingerprint
 * (lib/storage/layout.ts): a block is read only for the layout that wrote it.
 * One process per cache file: an exclusive advisory lock (file_lock.ts) is
 * taken before the file is touched, and a second server is refused.
 *
 * @module
 */

import type { StageMetrics } from "../pipeline/stage.ts";
import { Uring } from "../../ffi/uring.ts";
import { SsdIo } from "./io.ts";
import { type ClosingCall, describeIo, hungOpenError, openWithin, SsdStallWatch } from "./stall.ts";
import { OpenFs, SsdFsHung } from "./open_fs.ts";
import { type ResolvedOptions, resolveOptions, type SsdTierOptions } from "./options.ts";
import { SsdIndex } from "./index.ts";
import {
  logRebuildProgress,
  nextSeqAfter,
  recoverIndex,
  type RecoveryFile,
  type RecoveryReport,
} from "./recovery.ts";
import { SegmentRing } from "./space.ts";
import type { StoredLayout } from "../storage/tier.ts";
import { type CacheFile, openCacheFiles, SsdOpenError } from "./cache_files.ts";
import {
  type EnqueueResult,
  type SsdWriteBatch,
  type SsdWriteBlock,
  SsdWriter,
} from "./write_behind.ts";
import { type PrefetchAllocator, type PrefetchAnswer, SsdPrefetcher } from "./prefetch.ts";
import type { SsdWriteStats } from "./write_behind.ts";
import type { SsdReadStats } from "./prefetch.ts";
import { lockPaths, SsdLockedError } from "./file_lock.ts";
import type { LockFile } from "./lock_thread.ts";
import { SsdOpenHungError, SsdOpenStalledError, SsdStalledError } from "./stall.ts";
import { Logger } from "../log.ts";

export { SsdLockedError, SsdOpenError, SsdOpenHungError, SsdOpenStalledError, SsdStalledError };

export {
  DEFAULT_HDR_PAGES,
  DEFAULT_SEGMENT_BYTES,
  DEFAULT_SSD_CAPACITY,
  SSD_QUEUE_DEFAULTS,
  type SsdRing,
  type SsdTierOptions,
} from "./options.ts";

/** Counters and gauges of the tier (exported as pegaflow_ssd_* metrics). */
export interface SsdStats extends SsdWriteStats, SsdReadStats {
  capacityBytes: number;
  indexBlocks: number;
  indexBytes: number;
  recoveredBlocks: number;
  recoveredBytes: number;
  recoveryTornRecords: number;
  segmentsReused: number;
  alignmentFallbacks: number;
  /** io batches that passed the stall deadline, ever; 1 while the tier is degraded. */
  ioStalls: number;
  ioDegraded: number;
}

/** Where the tier logs when the caller passes no logger. */
function defaultLog(): Logger {
  return new Logger("info", { tier: "ssd" });
}

/**
 * The SSD tier. One per server, over the server's pool and completion ring.
 *
 * @example
 * ```ts
 * const tier = await SsdTier.open({ pool: pool.handle, ring, paths: ["/mnt/nvme"] });
 * tier.enqueueWrite({ blocks, pin: (fresh) => pinInRam(fresh) });
 * const a = tier.prefetch("req-1", keysPastRam, (wanted) => allocate(wanted), fingerprint);
 * // a.state === "loading" → answer "loading"; tier.poll("req-1") until "ready"
 * await tier.close();
 * ```
 */
export class SsdTier {
  readonly recovery: RecoveryReport;
  readonly files: readonly CacheFile[];
  readonly #io: SsdIo;
  readonly #ring: SegmentRing;
  readonly #index: SsdIndex;
  readonly #writer: SsdWriter;
  readonly #prefetcher: SsdPrefetcher;
  readonly #stall: SsdStallWatch;
  #closed = false;
  /** Resolves once the engine and the files' locks are closed ({@link close}; later after a give-up). */
  readonly engineClosed: Promise<void>;
  #engineDone!: () => void;
  #engineOpen = true;
  /** The engine's alignment fallbacks when it closed (its handle is gone after). */
  #finalAlignmentFallbacks: number | undefined;
  /** What the close of the engine's files waits on, once that close passed its deadline. */
  #closeStuck: string | undefined;

  private constructor(
    io: SsdIo,
    files: CacheFile[],
    ring: SegmentRing,
    index: SsdIndex,
    recovery: RecoveryReport,
    opts: ResolvedOptions,
    log: Logger,
    metrics: ((stage: string) => StageMetrics) | undefined,
  ) {
    this.#io = io;
    this.files = files;
    this.#ring = ring;
    this.#index = index;
    this.recovery = recovery;
    this.engineClosed = new Promise((r) => (this.#engineDone = r));
    this.#stall = new SsdStallWatch(io, files, log, opts.closeTimeoutMs, () => {
      const w = this.#writer.stats(), p = this.#prefetcher.stats();
      return {
        writeQueued: w.writeQueueDepth,
        writeInflight: w.writeInflight,
        prefetchQueued: p.prefetchQueueDepth,
        prefetchInflight: p.prefetchInflight,
        padSyncs: this.#writer.padSyncs(),
      };
    });
    const degraded = () => this.#stall.degraded;
    // The header arena is shared by every writer and reader in flight.
    const chunk = Math.max(
      1,
      Math.floor(opts.hdrPages / (opts.writeInflight + opts.prefetchInflight)),
    );
    this.#writer = new SsdWriter({
      io,
      files,
      segments: ring,
      index,
      log,
      chunk,
      nextSeq: nextSeqAfter(recovery, ring),
      queueDepth: opts.writeQueueDepth,
      inflight: opts.writeInflight,
      metrics: metrics?.("ssd.write"),
      degraded,
    });
    this.#prefetcher = new SsdPrefetcher({
      io,
      files,
      index,
      log,
      chunk,
      queueDepth: opts.prefetchQueueDepth,
      inflight: opts.prefetchInflight,
      maxBlocks: opts.maxPrefetchBlocks,
      ttlMs: opts.prefetchTtlMs,
      metrics: metrics?.("ssd.prefetch"),
      degraded,
    });
  }

  /**
   * Opens every cache path, rebuilds the index from disk (or starts empty
   * with `reset`), and returns the running tier. A path that cannot be used
   * (read-only, missing parent, no space) is logged and skipped.
   *
   * @throws SsdOpenError when no path is usable, with every path's reason.
   * @throws SsdOpenStalledError (an SsdOpenError) when an io batch of the
   * open passes `ioStallMs`: logged with its path and offset; the engine
   * and the files' locks close once the kernel completes it.
   * @throws SsdOpenHungError (an SsdOpenStalledError) when a filesystem call
   * of the open (stat, open, flock, statvfs, ftruncate of a cache path) does
   * not return within `ioStallMs`: logged with the call, path and deadline;
   * what the open holds closes once the call returns.
   */
  static async open(options: SsdTierOptions): Promise<SsdTier> {
    const log = options.log ?? defaultLog();
    const opts = resolveOptions(options);
    // Every filesystem call of the open runs off this thread, bounded by ioStallMs: a hung
    // disk or a dead mount gives the open up instead of freezing the server (open_fs.ts).
    const fs = new OpenFs(opts.ioStallMs, log);
    // Locked before anything opens or sizes a file: two servers on one file
    // would overwrite each other's records (a second server refuses to start).
    const locks = new Map<string, LockFile | Error>();
    // On the lock thread, never this one (lock_thread.ts), and up to the deadline.
    const closeLocks = () => fs.closeLocks(locks.values());
    // After a hung call nothing closes before that call returned.
    const releaseLocks = async () => (await fs.settled(), await closeLocks());
    let uring: Uring;
    try {
      await lockPaths(options.paths, fs, locks);
      uring = Uring.open(opts.pool, options.ring.handle, opts.ioDepth, opts.hdrPages);
    } catch (e) {
      if (e instanceof SsdFsHung) throw hungOpenError(e, releaseLocks, false, log);
      await closeLocks();
      throw e;
    }
    const io = new SsdIo(uring, opts.pool, options.ring.completions$, opts.ioStallMs);
    // The engine closes only with no io of it in the kernel (pf_uring_close waits for it),
    // and only once no filesystem call of the open runs (one may use the engine's files).
    const release = async () => {
      await fs.settled();
      io.dispose();
      try {
        await uring.close();
      } finally {
        await closeLocks();
      }
    };
    // A disk that hangs while the tier opens: the open gives up at the stall deadline.
    return await openWithin(
      io,
      fs,
      SsdTier.#build(io, fs, locks, opts, options, log),
      release,
      log,
    );
  }

  /**
   * Opens the cache files and rebuilds the index over `io` (open's work, raced against a stall).
   * Once the open gave up (`fs.check()` throws) nothing more of it runs, nor is logged.
   */
  static async #build(
    io: SsdIo,
    fs: OpenFs,
    locks: Map<string, LockFile | Error>,
    opts: ResolvedOptions,
    options: SsdTierOptions,
    log: Logger,
  ): Promise<SsdTier> {
    const files = await openCacheFiles(io.uring, io, locks, fs, opts, !!options.reset, log);
    fs.check();
    const index = new SsdIndex();
    const ring = new SegmentRing(files, opts.segmentBytes, (seg) => index.dropSegment(seg));
    const rfiles: RecoveryFile[] = files.map((f) => ({
      handle: f.handle,
      path: f.path,
      sizeBytes: f.sizeAtOpen,
      generation: f.generation,
    }));
    const capacity = files.reduce((n, f) => n + f.segments * opts.segmentBytes, 0);
    log.info("rebuilding the SSD index", {
      segments: ring.segments.length,
      capacity_bytes: capacity,
      files: files.length,
    });
    const report = await recoverIndex(io, rfiles, ring, index, opts.hdrPages, {
      intervalMs: opts.recoveryProgressMs,
      report: (p, final) => (fs.check(), logRebuildProgress(log, p, final)),
    });
    fs.check();
    ring.resume(nextSeqAfter(report, ring));
    const tier = new SsdTier(io, files, ring, index, report, opts, log, options.stageMetrics);
    log.info("SSD index recovered", {
      blocks: report.blocks,
      bytes: report.bytes,
      files: files.length,
      header_reads: report.headerReads,
      chains_ended_on_bad_header: report.stoppedOnBadHeader,
      truncated_records_dropped: report.truncated,
      header_read_errors: report.readErrors,
    });
    if (report.firstReadError) {
      log.warn("SSD header reads failed while rebuilding the index: those segments end there", {
        failed_reads: report.readErrors,
        path: report.firstReadError.path,
        offset: report.firstReadError.offset,
        error: report.firstReadError.error,
      });
    }
    return tier;
  }

  // ---- write-behind ------------------------------------------------------

  /**
   * Offers sealed blocks for writing. Never waits: when the write queue is
   * full the batch is dropped and counted (and never pinned). Blocks already
   * on SSD or already queued are skipped.
   */
  enqueueWrite<B extends SsdWriteBlock>(batch: SsdWriteBatch<B>): EnqueueResult {
    return this.#writer.enqueue(batch);
  }

  /** Forgets `keys` (discarded blocks), on disk too (drops.ts). Returns the blocks unindexed. */
  drop(keys: readonly string[]): number {
    return this.#writer.drop(keys);
  }

  /**
   * Resolves when every write accepted so far has ended (tests, shutdown).
   *
   * @throws SsdStalledError when the io stalls or `closeTimeoutMs` passes
   * first, naming what is outstanding (the writes go on).
   */
  async flushWrites(): Promise<void> {
    const gaveUp = await this.#stall.giveUp(this.#writer.flush(), "flush");
    if (gaveUp) throw new SsdStalledError(gaveUp);
  }

  // ---- lookup and prefetch -------------------------------------------------

  /** How many of `keys`, from the first, are on SSD written by layout `layout` (a fingerprint). */
  lookupPrefix(keys: readonly string[], layout: string): number {
    return this.#index.prefixLength(keys, layout);
  }

  /**
   * The layouts `namespace`'s blocks on SSD were written with (what the
   * engine checks a registration against after a restart).
   */
  storedLayouts(namespace: string): StoredLayout[] {
    return this.#index.layoutsOf(namespace);
  }

  /** Where `key`'s record is (admin and tests), or undefined. */
  locate(
    key: string,
  ): { path: string; fileOffset: number; payloadBytes: number; seq: number } | undefined {
    const l = this.#index.get(key);
    if (!l) return undefined;
    return {
      path: this.files[l.segment.file].path,
      fileOffset: l.fileOffset,
      payloadBytes: l.payloadBytes,
      seq: l.seq,
    };
  }

  /** True while request `reqId` has a prefetch loading or not yet answered `ready`. */
  hasPrefetch(reqId: string): boolean {
    return this.#prefetcher.has(reqId);
  }

  /**
   * Polls request `reqId`: `loading` while any read it waits on runs, then
   * `ready` once (the request is forgotten); undefined for an unknown id.
   */
  poll(reqId: string): "loading" | "ready" | undefined {
    return this.#prefetcher.poll(reqId);
  }

  /** Resolves once request `reqId`'s reads ended; undefined when none runs (prefetch.ts). */
  settled(reqId: string): Promise<void> | undefined {
    return this.#prefetcher.settled(reqId);
  }

  /**
   * The prefetch protocol of QueryPrefetch, keyed by request id (see
   * prefetch.ts): the first call starts or joins reads of the longest prefix
   * of `keys` on SSD under layout `layout` and answers `loading` (or `miss`
   * with why); later calls poll: `loading`, then `ready` once.
   */
  prefetch(
    reqId: string,
    keys: readonly string[],
    allocate: PrefetchAllocator,
    layout: string,
  ): PrefetchAnswer {
    return this.#prefetcher.prefetch(reqId, keys, allocate, layout);
  }

  /** Resolves when the prefetch for `reqId` is no longer loading (tests, demos). */
  prefetchSettled(reqId: string): Promise<void> {
    return this.#prefetcher.settled(reqId) ?? Promise.resolve();
  }

  // ---- stats and shutdown --------------------------------------------------

  /** True once {@link close} began. */
  get closed(): boolean {
    return this.#closed;
  }

  /** True while an io batch is stalled: writes are dropped, prefetches miss (stall.ts). */
  get degraded(): boolean {
    return this.#stall.degraded;
  }

  /**
   * Undefined once the engine is closed; else what it waits on (the oldest
   * io op in the kernel, with path and offset). While it is open it holds
   * the pool and the completion ring: they must not be freed under it.
   */
  stillOpen(): string | undefined {
    if (!this.#engineOpen) return undefined;
    if (this.#closeStuck) return this.#closeStuck;
    const o = this.#io.oldestOutstanding();
    return "the SSD io engine is still open: " +
      (o ? `oldest io op: ${describeIo(o)}` : this.#stall.inCall() ?? "no io op in the kernel");
  }

  /** Capacity and what the index holds: no I/O, safe after {@link close} (tier health). */
  usage(): { capacityBytes: number; indexBytes: number; indexBlocks: number } {
    return {
      capacityBytes: this.#ring.capacityBytes,
      indexBytes: this.#index.payloadBytes,
      indexBlocks: this.#index.size,
    };
  }

  /** Counters and gauges for /metrics and tests; the final figures after {@link close}. */
  stats(): SsdStats {
    return {
      ...this.#writer.stats(),
      ...this.#prefetcher.stats(),
      capacityBytes: this.#ring.capacityBytes,
      indexBlocks: this.#index.size,
      indexBytes: this.#index.payloadBytes,
      recoveredBlocks: this.recovery.blocks,
      recoveredBytes: this.recovery.bytes,
      recoveryTornRecords: this.recovery.truncated + this.recovery.stoppedOnBadHeader,
      segmentsReused: this.#ring.reuses,
      alignmentFallbacks: this.#finalAlignmentFallbacks ??
        this.#io.uring.info().alignmentFallbacks,
      ioStalls: this.#io.stalls,
      ioDegraded: this.#io.stalled ? 1 : 0,
    };
  }

  /**
   * Finishes queued writes and reads, frees prefetched blocks nobody took,
   * syncs and closes the files. Idempotent. Gives up when the io stalls or
   * `closeTimeoutMs` passes (logged, naming what is outstanding): the engine
   * and the files' locks are then closed once the kernel completes that io
   * (its pool pages are never freed under it). The close of the files and
   * locks has that deadline too (a hung filesystem's FLUSH): past it, it is
   * logged naming the call and path, and goes on once that call returns
   * ({@link stillOpen} says what it waits on meanwhile).
   */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    const drained = Promise.all([this.#writer.close(), this.#prefetcher.close()]);
    // Every file is synced even when one fails (EIO); a hung one is named by a give-up.
    const synced = drained.then(() => this.#stall.syncEach((f) => this.#io.uring.sync(f.handle)));
    if (await this.#stall.giveUp(synced, "close")) {
      this.#stall.finishLater(synced.finally(() => this.#shut()), "close");
      return;
    }
    try {
      await synced;
    } finally {
      // A failed sync must not keep the ring, its memory and the files' locks until exit;
      // a close that hangs (a FLUSH held) must not hold up the server's stop.
      this.#closeStuck = await this.#stall.shutWithin((at) => this.#shut(at));
    }
  }

  /**
   * Closes the engine and the files' locks (nothing of the tier's io is
   * outstanding), telling `at` which close it waits on.
   */
  async #shut(at: (call: ClosingCall) => void = () => {}): Promise<void> {
    this.#io.dispose();
    this.#finalAlignmentFallbacks = this.#io.uring.info().alignmentFallbacks;
    try {
      // Off this thread: closes the io files (and waits for ops in flight: none here).
      at({ op: "close for io (pf_uring_close)", paths: this.files.map((f) => f.path) });
      await this.#io.uring.close();
    } finally {
      this.#engineOpen = false;
      const open = new Set(this.files.map((f) => f.path));
      at({ op: "close of the lock file", paths: open });
      try {
        // Off this thread (lock_thread.ts); resolved once every lock is dropped.
        await Promise.all(this.files.map((f) => f.lock.close().finally(() => open.delete(f.path))));
      } finally {
        this.#engineDone();
      }
    }
  }
}
