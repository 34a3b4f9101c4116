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

import type { Observable } from "rxjs";
import type { StageMetrics } from "../pipeline/stage.ts";
import type { Completion } from "../../ffi/ring.ts";
import { Uring } from "../../ffi/uring.ts";
import { SsdIo } from "./io.ts";
import { SsdIndex } from "./index.ts";
import {
  nextSeqAfter,
  recoverIndex,
  type RecoveryFile,
  type RecoveryProgress,
  type RecoveryReport,
} from "./recovery.ts";
import { SegmentRing } from "./space.ts";
import type { StoredLayout } from "../storage/tier.ts";
import { type CacheFile, lockPaths, openCacheFiles, SsdOpenError } from "./cache_files.ts";
import {
  type EnqueueResult,
  type SsdWriteBatch,
  type SsdWriteBlock,
  SsdWriter,
} from "./write_behind.ts";
import { type PrefetchAllocator, type PrefetchAnswer, SsdPrefetcher } from "./prefetch.ts";
import type { SsdWriteStats } from "./write_behind.ts";
import type { SsdReadStats } from "./prefetch.ts";
import { SsdLockedError } from "./file_lock.ts";
import { Logger } from "../log.ts";

export { SsdLockedError, SsdOpenError };

/** Bytes in a GiB. */
const GIB = 1024 ** 3;
/** Default `--ssd-cache-capacity`: 512 GiB. */
export const DEFAULT_SSD_CAPACITY = 512 * GIB;
/** Default segment: large enough for sequential writes, small enough that reuse drops little. */
export const DEFAULT_SEGMENT_BYTES = 64 * 1024 ** 2;
/**
 * Queue depths and in-flight bounds when the caller gives none; also the
 * defaults of the matching `--ssd-*` flags (lib/ssd/flags.ts).
 */
export const SSD_QUEUE_DEFAULTS = {
  writeQueueDepth: 64,
  writeInflight: 4,
  prefetchQueueDepth: 256,
  prefetchInflight: 8,
  maxPrefetchBlocks: 4096,
} as const;
/** Default io_uring depth: enough to saturate an NVMe drive with 2 MiB records. */
const DEFAULT_IO_DEPTH = 128;
/** Default header staging pages (4 MiB): one per write or prefetch batch in flight. */
export const DEFAULT_HDR_PAGES = 1024;
/** A finished prefetch nobody polled for is forgotten after this (its blocks stay cached). */
const DEFAULT_PREFETCH_TTL_MS = 30_000;
/** Index rebuild progress is logged this often (an operator sees a long scan is alive). */
const DEFAULT_RECOVERY_PROGRESS_MS = 5_000;

/** The completion ring the tier posts to (ffi/ring.ts `CompletionRing` fits). */
export interface SsdRing {
  readonly handle: number;
  readonly completions$: Observable<Completion>;
}

/** Options of {@link SsdTier.open}; the CLI flags map 1:1 (docs/ssd.md). */
export interface SsdTierOptions {
  /** Pinned pool handle (reads land in it, writes come from it). */
  pool: number;
  /** Completion ring shared with the copy engine. */
  ring: SsdRing;
  /** `--ssd-cache-path`: files or directories (a directory gets CACHE_FILE_NAME inside). */
  paths: string[];
  /** `--ssd-cache-capacity` in bytes, split evenly over paths, capped to free space. */
  capacityBytes?: number;
  /** `--ssd-reset`: ignore and overwrite what is on disk. */
  reset?: boolean;
  /** Segment size (multiple of 4 KiB, ≥ the largest record). */
  segmentBytes?: number;
  /** `--ssd-write-queue-depth`: write batches waiting. Default 64. */
  writeQueueDepth?: number;
  /** `--ssd-write-inflight`: write batches in flight. Default 4. */
  writeInflight?: number;
  /** `--ssd-prefetch-queue-depth`: prefetches waiting. Default 256. */
  prefetchQueueDepth?: number;
  /** `--ssd-prefetch-inflight`: prefetch reads in flight. Default 8. */
  prefetchInflight?: number;
  /** `--max-prefetch-blocks`: blocks being read by prefetches at once. Default 4096. */
  maxPrefetchBlocks?: number;
  /** io_uring entries (power of two). */
  ioDepth?: number;
  /** Header staging pages (bounds ops with headers in flight). */
  hdrPages?: number;
  /** O_DIRECT (default true); false runs through the page cache (benchmarks). */
  direct?: boolean;
  /** A finished prefetch not polled within this is forgotten (its blocks stay cached). */
  prefetchTtlMs?: number;
  /** Index rebuild progress is logged this often (0: every scan round). */
  recoveryProgressMs?: number;
  /** The server's logger (a child with `tier: "ssd"`); default: stderr at info. */
  log?: Logger;
  /** Metric hooks of the `ssd.write` and `ssd.prefetch` stages (depth gauge, drops, refusals). */
  stageMetrics?: (stage: string) => StageMetrics;
}

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
}

type ResolvedOptions = Required<
  Omit<SsdTierOptions, "log" | "ring" | "paths" | "reset" | "stageMetrics">
>;

/**
 * The options with their defaults, checked: every count a non-negative
 * integer, at least one path, and a header arena that holds every write and
 * prefetch in flight.
 */
function resolveOptions(options: SsdTierOptions): ResolvedOptions {
  const opts: ResolvedOptions = {
    pool: options.pool,
    capacityBytes: options.capacityBytes ?? DEFAULT_SSD_CAPACITY,
    segmentBytes: options.segmentBytes ?? DEFAULT_SEGMENT_BYTES,
    writeQueueDepth: options.writeQueueDepth ?? SSD_QUEUE_DEFAULTS.writeQueueDepth,
    writeInflight: options.writeInflight ?? SSD_QUEUE_DEFAULTS.writeInflight,
    prefetchQueueDepth: options.prefetchQueueDepth ?? SSD_QUEUE_DEFAULTS.prefetchQueueDepth,
    prefetchInflight: options.prefetchInflight ?? SSD_QUEUE_DEFAULTS.prefetchInflight,
    maxPrefetchBlocks: options.maxPrefetchBlocks ?? SSD_QUEUE_DEFAULTS.maxPrefetchBlocks,
    ioDepth: options.ioDepth ?? DEFAULT_IO_DEPTH,
    hdrPages: options.hdrPages ?? DEFAULT_HDR_PAGES,
    direct: options.direct ?? true,
    prefetchTtlMs: options.prefetchTtlMs ?? DEFAULT_PREFETCH_TTL_MS,
    recoveryProgressMs: options.recoveryProgressMs ?? DEFAULT_RECOVERY_PROGRESS_MS,
  };
  for (const [name, v] of Object.entries(opts)) {
    if (typeof v === "number" && (!Number.isSafeInteger(v) || v < 0)) {
      throw new RangeError(`SSD tier option ${name}: ${v} is not a non-negative integer`);
    }
  }
  if (options.paths.length === 0) throw new SsdOpenError("no --ssd-cache-path given");
  if (opts.hdrPages < opts.writeInflight + opts.prefetchInflight) {
    throw new RangeError(
      `SSD tier: hdrPages ${opts.hdrPages} < writeInflight + prefetchInflight (${
        opts.writeInflight + opts.prefetchInflight
      })`,
    );
  }
  return opts;
}

/**
 * The one line an operator watches during a long index rebuild: a sentence
 * with the counts, and the same counts as fields.
 */
function logRebuildProgress(log: Logger, p: RecoveryProgress, final: boolean): void {
  log.info(
    `SSD index rebuild${final ? " done" : ""}: ${p.segmentsDone}/${p.segmentsTotal} ` +
      `segments, ${p.bytesScanned}/${p.bytesTotal} bytes scanned, ${p.records} records ` +
      `indexed from ${p.headersRead} header reads, ${p.elapsedMs} ms elapsed`,
    {
      done: final,
      segments_done: p.segmentsDone,
      segments_total: p.segmentsTotal,
      bytes_scanned: p.bytesScanned,
      bytes_total: p.bytesTotal,
      records: p.records,
      header_reads: p.headersRead,
      elapsed_ms: p.elapsedMs,
    },
  );
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
  #closed = false;
  /** The engine's alignment fallbacks when it closed (its handle is gone after). */
  #finalAlignmentFallbacks: number | undefined;

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
    });
  }

  /**
   * Opens every cache path, rebuilds the index from disk (or starts empty
   * with `reset`), and returns the running tier. A path that cannot be used
   * (read-only, missing parent, no space) is logged and skipped.
   *
   * @throws SsdOpenError when no path is usable, with every path's reason.
   */
  static async open(options: SsdTierOptions): Promise<SsdTier> {
    const log = options.log ?? defaultLog();
    const opts = resolveOptions(options);
    // Locked before anything opens or sizes a file: two servers on one file
    // would overwrite each other's records (a second server refuses to start).
    const locks = lockPaths(options.paths);
    let uring: Uring;
    try {
      uring = Uring.open(opts.pool, options.ring.handle, opts.ioDepth, opts.hdrPages);
    } catch (e) {
      for (const l of locks.values()) if (!(l instanceof Error)) l.close();
      throw e;
    }
    const io = new SsdIo(uring, opts.pool, options.ring.completions$);
    try {
      const files = await openCacheFiles(uring, io, locks, opts, !!options.reset, log);
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
        report: (p, final) => logRebuildProgress(log, p, final),
      });
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
    } catch (e) {
      io.dispose();
      await uring.close();
      for (const l of locks.values()) if (!(l instanceof Error)) l.close();
      throw e;
    }
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

  /** Resolves when every write accepted so far has ended (tests, shutdown). */
  flushWrites(): Promise<void> {
    return this.#writer.flush();
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
    return this.#prefetcher.settled(reqId);
  }

  // ---- stats and shutdown --------------------------------------------------

  /** True once {@link close} began. */
  get closed(): boolean {
    return this.#closed;
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
    };
  }

  /**
   * Finishes queued writes and reads, frees prefetched blocks nobody took,
   * syncs and closes the files. Idempotent.
   */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    try {
      await Promise.all([this.#writer.close(), this.#prefetcher.close()]);
      // Every file is synced even when one fails (EIO): the first failure is thrown last.
      const failures: unknown[] = [];
      for (const f of this.files) {
        await this.#io.uring.sync(f.handle).catch((e) => failures.push(e));
      }
      if (failures.length > 0) throw failures[0];
    } finally {
      // A failed sync must not keep the ring, its memory and the files' locks until exit.
      this.#io.dispose();
      this.#finalAlignmentFallbacks = this.#io.uring.info().alignmentFallbacks;
      try {
        await this.#io.uring.close();
      } finally {
        for (const f of this.files) f.lock.close();
      }
    }
  }
}
