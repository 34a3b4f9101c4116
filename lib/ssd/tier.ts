/**
 * The SSD tier: write-behind of sealed blocks and prefetch into the pinned
 * pool, on io_uring, with per-record checksums and an index that survives
 * restarts.
 *
 * This is the SSD's mechanism keyed by record key (`namespace:hex`, the key
 * stored in every record header); the server reaches it only through the
 * `Tier` port, which lib/ssd/ssd_tier_port.ts implements over it:
 *  - `SsdTier.open(opts)` at start (after the pool and completion ring);
 *  - `enqueueWrite(batch)` for sealed blocks (the batch pins its blocks in
 *    RAM only when the write starts);
 *  - `lookupPrefix(keys)` / `prefetch(reqId, keys, allocate)` / `poll(reqId)`
 *    for the keys past the RAM prefix;
 *  - `stats()` / `registerSsdMetrics` for /metrics; `close()` at shutdown.
 *
 * Both flows are credit-bounded pipeline stages (lib/pipeline):
 *  - write-behind: queue of batches, policy `drop-newest` (a full queue drops
 *    the batch being offered and counts it; a save never waits on the SSD),
 *    `writeInflight` batches in flight;
 *  - prefetch: queue policy `refuse` (a full queue answers "miss" at once
 *    and counts backpressure), `prefetchInflight` reads in flight, plus a
 *    global budget of blocks being read by prefetches.
 *
 * A prefetched block is committed into RAM (`PrefetchAllocation.commit`:
 * sealed as an ordinary cached block, evictable) the moment it is verified,
 * whoever asked for it and whether or not they come back. A query whose
 * prefix is being read for another request joins that read ("loading", then
 * a hit) instead of missing. Every record carries its namespace's layout
 * fingerprint (lib/storage/layout.ts): a block is read only for the layout
 * that wrote it.
 *
 * One process per cache file: an exclusive advisory lock (file_lock.ts) is
 * taken before the file is touched, and a second server is refused.
 *
 * @module
 */

import type { Observable } from "rxjs";
import { Stage, type StageMetrics, type StageOptions } from "../pipeline/stage.ts";
import type { Completion } from "../../ffi/ring.ts";
import { FileFlag, fsSpace, Uring } from "../../ffi/uring.ts";
import {
  decodeHeader,
  decodeSuperblock,
  encodeHeader,
  encodeSuperblock,
  keyBytes,
  newGeneration,
  PAGE_BYTES,
  recordBytes,
} from "./format.ts";
import { type PoolExtent, SsdIo } from "./io.ts";
import { SsdIndex, type SsdLocation } from "./index.ts";
import { recoverIndex, type RecoveryFile, type RecoveryReport } from "./recovery.ts";
import { type Segment, SegmentRing } from "./space.ts";
import type { LayoutIdentity } from "../storage/layout.ts";
import type { StoredLayout } from "./index.ts";
import { lockCacheFile, SsdLockedError } from "./file_lock.ts";

export { SsdLockedError };
export type { StoredLayout };

/** Bytes in a GiB. */
const GIB = 1024 ** 3;
/** Default `--ssd-cache-capacity`: 512 GiB. */
export const DEFAULT_SSD_CAPACITY = 512 * GIB;
/** Default segment: large enough for sequential writes, small enough that reuse drops little. */
export const DEFAULT_SEGMENT_BYTES = 64 * 1024 ** 2;
/** File created inside a directory given as a cache path. */
export const CACHE_FILE_NAME = "pegaflow-ssd.cache";
/** Free space left to the filesystem when capping capacity (metadata, other users). */
const FREE_SPACE_RESERVE_FRACTION = 0.02;
/** Default io_uring depth: enough to saturate an NVMe drive with 2 MiB records. */
const DEFAULT_IO_DEPTH = 128;
/** Default header staging pages (4 MiB). */
const DEFAULT_HDR_PAGES = 1024;
/** A finished prefetch nobody polled for is forgotten after this (its blocks stay cached). */
const DEFAULT_PREFETCH_TTL_MS = 30_000;
/** Index rebuild progress is logged this often (an operator sees a long scan is alive). */
const DEFAULT_RECOVERY_PROGRESS_MS = 5_000;
/** Period of the sweep that forgets finished prefetches. */
const EXPIRY_SWEEP_MS = 1_000;
/** Throughput gauges are exponentially weighted over batches with this weight for the newest. */
const THROUGHPUT_EWMA_WEIGHT = 0.2;

/** Log sink: the server passes its logger; the default writes to stderr. */
export type SsdLog = (level: "info" | "warn" | "error", message: string) => void;

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
  log?: SsdLog;
  /** Metric hooks of the `ssd.write` and `ssd.prefetch` stages (depth gauge, drops, refusals). */
  stageMetrics?: (stage: string) => StageMetrics;
}

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

/**
 * Pool space the caller allocated for one prefetched block. The tier calls
 * exactly one of `commit` (verified: the bytes are the block's, make it
 * visible) or `free` (not delivered: give the space back).
 */
export interface PrefetchAllocation {
  extents: PoolExtent[];
  free(): void;
  commit(): void;
}

/** A block a prefetch wants pool space for. */
export interface PrefetchWant {
  key: string;
  /** Its position in the keys given to {@link SsdTier.prefetch}. */
  index: number;
  payloadBytes: number;
}

/**
 * Allocates pool space for these blocks, in order. May return fewer than
 * asked (the rest is not fetched) or an empty array.
 */
export type PrefetchAllocator = (wanted: readonly PrefetchWant[]) => PrefetchAllocation[];

/** The answer to {@link SsdTier.prefetch}. */
export type PrefetchAnswer =
  | { state: "loading" }
  /** Every read this request waited for has ended; its verified blocks were committed as they landed. */
  | { state: "ready" }
  | {
    state: "miss";
    reason: "not-on-ssd" | "other-layout" | "budget" | "queue-full" | "no-pool-space";
  };

/** What {@link SsdTier.enqueueWrite} did. */
export interface EnqueueResult {
  status: "queued" | "dropped" | "nothing-to-write";
  /** Blocks in the queued (or dropped) batch. */
  blocks: number;
  /** Blocks skipped because already on SSD or already queued. */
  duplicates: number;
}

/** Counters and gauges of the tier (exported as pegaflow_ssd_* metrics). */
export interface SsdStats {
  capacityBytes: number;
  indexBlocks: number;
  indexBytes: number;
  recoveredBlocks: number;
  recoveredBytes: number;
  recoveryTornRecords: number;
  writeBytes: number;
  writeBlocks: number;
  writeFailures: number;
  writeQueueDepth: number;
  writeInflight: number;
  writeQueueFullDrops: number;
  writeQueueFullDroppedBlocks: number;
  writeSkippedEvicted: number;
  writeSkippedNoSpace: number;
  writeThroughputBps: number;
  readBytes: number;
  readBlocks: number;
  readFailures: number;
  checksumFailures: number;
  readThroughputBps: number;
  prefetchQueueDepth: number;
  prefetchInflight: number;
  prefetchBudgetBlocks: number;
  prefetchReservedBlocks: number;
  prefetchBackpressure: number;
  prefetchPartial: number;
  prefetchExpired: number;
  /** Blocks on SSD not served because another layout of their namespace asked. */
  layoutMismatches: number;
  segmentsReused: number;
  alignmentFallbacks: number;
}

type ResolvedOptions = Required<
  Omit<SsdTierOptions, "log" | "ring" | "paths" | "reset" | "stageMetrics">
>;

interface CacheFile {
  path: string;
  /** Held open with the exclusive advisory lock until close. */
  lock: Deno.FsFile;
  handle: number;
  segments: number;
  generation: number;
  direct: boolean;
  /** Size found at open, before the file was sized to its capacity (records past it are torn). */
  sizeAtOpen: number;
}

/**
 * Stage settings of write-behind: a full queue drops the newest batch (a
 * save never waits on the SSD), `inflight` batches run at once.
 */
export function writeStageOptions(queueDepth: number, inflight: number): StageOptions {
  return { concurrency: inflight, queue: { depth: queueDepth, policy: "drop-newest" } };
}

/**
 * Stage settings of prefetch: a full queue refuses at once (the query
 * answers with what RAM has: a miss is cheaper than waiting), `inflight`
 * reads run at once.
 */
export function prefetchStageOptions(queueDepth: number, inflight: number): StageOptions {
  return { concurrency: inflight, queue: { depth: queueDepth, policy: "refuse" } };
}

interface WriteJob {
  blocks: SsdWriteBlock[];
  /** Pins `blocks` (called when the write starts). */
  pin: () => SsdPinned;
}

/** One read of blocks from SSD into pool space; queries of the same blocks join it. */
interface PrefetchJob {
  keys: string[];
  locs: SsdLocation[];
  allocations: PrefetchAllocation[];
  /** Layout fingerprint the blocks must carry. */
  layout: string;
  done: boolean;
  /** Date.now() when it ended. */
  doneAt: number;
  /** Resolves when it ended (every allocation committed or freed). */
  ended: Promise<void>;
  end: () => void;
}

/** What a request id waits for. */
interface PrefetchRequest {
  jobs: PrefetchJob[];
}

/** The tier could not start on any path (the server runs without it). */
export class SsdOpenError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "SsdOpenError";
  }
}

const defaultLog: SsdLog = (level, message) => console.error(`[ssd] ${level}: ${message}`);

function isDirectory(path: string): boolean {
  try {
    return Deno.statSync(path).isDirectory;
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return false;
    throw e;
  }
}

function fileSize(path: string): number {
  try {
    return Deno.statSync(path).size;
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return 0;
    throw e;
  }
}

/**
 * Locks every cache file (a directory names the file inside it). A path
 * that cannot be opened maps to its error (logged and skipped later, like
 * any unusable path); a file another process holds refuses the whole start.
 *
 * @throws SsdLockedError naming the file and the holder.
 */
function lockPaths(paths: string[]): Map<string, Deno.FsFile | Error> {
  const out = new Map<string, Deno.FsFile | Error>();
  try {
    for (const given of paths) {
      const path = isDirectory(given) ? `${given.replace(/\/+$/, "")}/${CACHE_FILE_NAME}` : given;
      if (out.has(path)) continue; // the same file named twice is one file
      try {
        out.set(path, lockCacheFile(path));
      } catch (e) {
        if (e instanceof SsdLockedError) throw e;
        out.set(path, e as Error);
      }
    }
  } catch (e) {
    for (const l of out.values()) if (!(l instanceof Error)) l.close();
    throw e;
  }
  return out;
}

function dirOf(path: string): string {
  const i = path.lastIndexOf("/");
  return i <= 0 ? (i === 0 ? "/" : ".") : path.slice(0, i);
}

/**
 * The SSD tier. One per server, over the server's pool and completion ring.
 *
 * @example
 * ```ts
 * const tier = await SsdTier.open({ pool: pool.handle, ring, paths: ["/mnt/nvme"] });
 * tier.enqueueWrite([{ key, acquire: () => pinAndLocate(key), release: () => unpin(key) }]);
 * const a = tier.prefetch("req-1", keysPastRam, (sizes) => allocate(sizes));
 * // a.state === "loading" → answer "loading"; poll again with the same request id
 * await tier.close();
 * ```
 */
export class SsdTier {
  readonly recovery: RecoveryReport;
  readonly files: readonly CacheFile[];
  readonly #io: SsdIo;
  readonly #ring: SegmentRing;
  readonly #index: SsdIndex;
  readonly #log: SsdLog;
  readonly #opts: ResolvedOptions;
  readonly #writes: Stage<WriteJob, void>;
  readonly #prefetches: Stage<PrefetchJob, void>;
  readonly #pendingKeys = new Set<string>();
  /** Write batches accepted and not yet ended (what {@link flushWrites} waits for). */
  readonly #writesPending = new Set<Promise<unknown>>();
  /** Request id → the reads it waits for (its own and the ones it joined). */
  readonly #requests = new Map<string, PrefetchRequest>();
  /** Key → the read bringing it into the pool now. */
  readonly #fetching = new Map<string, PrefetchJob>();
  readonly #chunk: number;
  #seq: number;
  #reserved = 0;
  #closed = false;
  readonly #expiryTimer: number;
  readonly #s = {
    writeBytes: 0,
    writeBlocks: 0,
    writeFailures: 0,
    writeQueueFullDrops: 0,
    writeQueueFullDroppedBlocks: 0,
    writeSkippedEvicted: 0,
    writeSkippedNoSpace: 0,
    writeThroughputBps: 0,
    readBytes: 0,
    readBlocks: 0,
    readFailures: 0,
    checksumFailures: 0,
    readThroughputBps: 0,
    prefetchBackpressure: 0,
    prefetchPartial: 0,
    prefetchExpired: 0,
    layoutMismatches: 0,
  };

  private constructor(
    io: SsdIo,
    files: CacheFile[],
    ring: SegmentRing,
    index: SsdIndex,
    recovery: RecoveryReport,
    opts: ResolvedOptions,
    log: SsdLog,
    metrics: ((stage: string) => StageMetrics) | undefined,
  ) {
    this.#io = io;
    this.files = files;
    this.#ring = ring;
    this.#index = index;
    this.recovery = recovery;
    this.#opts = opts;
    this.#log = log;
    this.#seq = recovery.maxSeq + 1;
    this.#chunk = Math.max(
      1,
      Math.floor(opts.hdrPages / (opts.writeInflight + opts.prefetchInflight)),
    );
    this.#writes = new Stage<WriteJob, void>(
      "ssd.write",
      {
        ...writeStageOptions(opts.writeQueueDepth, opts.writeInflight),
        metrics: metrics?.("ssd.write"),
      },
      (job) => this.#writeJob(job),
    );
    // Finished prefetches nobody came back for are forgotten even on an idle server.
    this.#expiryTimer = Number(setInterval(() => this.#expire(), EXPIRY_SWEEP_MS));
    Deno.unrefTimer(this.#expiryTimer);
    this.#prefetches = new Stage<PrefetchJob, void>(
      "ssd.prefetch",
      {
        ...prefetchStageOptions(opts.prefetchQueueDepth, opts.prefetchInflight),
        metrics: metrics?.("ssd.prefetch"),
      },
      (job) => this.#prefetchJob(job),
    );
  }

  /**
   * Opens every cache path, rebuilds the index from disk (or starts empty
   * with `reset`), and returns the running tier. A path that cannot be used
   * (read-only, missing parent, no space) is logged and skipped.
   *
   * @throws SsdOpenError when no path is usable, with every path's reason.
   */
  static async open(options: SsdTierOptions): Promise<SsdTier> {
    const log = options.log ?? defaultLog;
    const opts = {
      pool: options.pool,
      capacityBytes: options.capacityBytes ?? DEFAULT_SSD_CAPACITY,
      segmentBytes: options.segmentBytes ?? DEFAULT_SEGMENT_BYTES,
      writeQueueDepth: options.writeQueueDepth ?? 64,
      writeInflight: options.writeInflight ?? 4,
      prefetchQueueDepth: options.prefetchQueueDepth ?? 256,
      prefetchInflight: options.prefetchInflight ?? 8,
      maxPrefetchBlocks: options.maxPrefetchBlocks ?? 4096,
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
      const files = await SsdTier.#openFiles(uring, io, locks, opts, !!options.reset, log);
      const index = new SsdIndex();
      const ring = new SegmentRing(files, opts.segmentBytes, (seg) => index.dropSegment(seg));
      const rfiles: RecoveryFile[] = files.map((f) => ({
        handle: f.handle,
        path: f.path,
        sizeBytes: f.sizeAtOpen,
        generation: f.generation,
      }));
      const capacity = files.reduce((n, f) => n + f.segments * opts.segmentBytes, 0);
      log(
        "info",
        `rebuilding the SSD index: ${ring.segments.length} segments (${capacity} bytes) in ` +
          `${files.length} file(s)`,
      );
      const report = await recoverIndex(io, rfiles, ring, index, opts.hdrPages, {
        intervalMs: opts.recoveryProgressMs,
        report: (p, final) =>
          log(
            "info",
            `SSD index rebuild${final ? " done" : ""}: ${p.segmentsDone}/${p.segmentsTotal} ` +
              `segments, ${p.bytesScanned}/${p.bytesTotal} bytes scanned, ${p.records} records ` +
              `indexed from ${p.headersRead} header reads, ${p.elapsedMs} ms elapsed`,
          ),
      });
      ring.resume(report.maxSeq + 1);
      const tier = new SsdTier(io, files, ring, index, report, opts, log, options.stageMetrics);
      log(
        "info",
        `recovered ${report.blocks} blocks (${report.bytes} bytes) from ${files.length} file(s) ` +
          `with ${report.headerReads} header reads; ${report.stoppedOnBadHeader} chains ended on a ` +
          `bad header, ${report.truncated} truncated records dropped`,
      );
      return tier;
    } catch (e) {
      io.dispose();
      await uring.close();
      for (const l of locks.values()) if (!(l instanceof Error)) l.close();
      throw e;
    }
  }

  static async #openFiles(
    uring: Uring,
    io: SsdIo,
    locks: Map<string, Deno.FsFile | Error>,
    opts: { capacityBytes: number; segmentBytes: number; direct: boolean },
    reset: boolean,
    log: SsdLog,
  ): Promise<CacheFile[]> {
    const files: CacheFile[] = [];
    const problems: string[] = [];
    const share = Math.floor(opts.capacityBytes / locks.size);
    for (const [path, lock] of locks) {
      let handle = 0;
      try {
        if (lock instanceof Error) throw lock;
        const space = fsSpace(dirOf(path));
        const usable = Math.floor(
          (space.availableBytes + fileSize(path)) * (1 - FREE_SPACE_RESERVE_FRACTION),
        );
        let cap = share;
        if (cap > usable) {
          log(
            "info",
            `${path}: capacity ${share} bytes capped to ${usable} (free space of its filesystem)`,
          );
          cap = usable;
        }
        const segments = Math.floor((cap - PAGE_BYTES) / opts.segmentBytes);
        if (segments < 1) {
          throw new Error(`capacity ${cap} bytes holds no ${opts.segmentBytes}-byte segment`);
        }
        handle = uring.openFile(path, FileFlag.CREATE | (opts.direct ? FileFlag.DIRECT : 0));
        const info = uring.fileInfo(handle);
        if (opts.direct && !info.direct) {
          log("warn", `${path}: the filesystem refused O_DIRECT; running through the page cache`);
        }
        const size = PAGE_BYTES + segments * opts.segmentBytes;
        let generation = 0;
        if (!reset && info.sizeBytes >= PAGE_BYTES) {
          const sb = await SsdTier.#readSuper(io, handle);
          if (typeof sb === "string") {
            // An older format is never misread: its records are dropped with the generation.
            log("warn", `${path}: ${sb}; its records are not read: starting this file empty`);
          } else if (sb.segmentBytes !== opts.segmentBytes) {
            log(
              "warn",
              `${path}: written with ${sb.segmentBytes}-byte segments, now ${opts.segmentBytes}; starting empty`,
            );
          } else {
            generation = sb.generation;
            if (sb.segmentCount !== segments) {
              log(
                "info",
                `${path}: ${sb.segmentCount} segments on disk, ${segments} configured; keeping the first ${
                  Math.min(sb.segmentCount, segments)
                }`,
              );
            }
          }
        }
        if (generation === 0) {
          generation = newGeneration();
          uring.truncate(handle, 0); // a reset frees the old records' space at once
        }
        uring.truncate(handle, size);
        await SsdTier.#writeSuper(io, handle, {
          generation,
          segmentBytes: opts.segmentBytes,
          segmentCount: segments,
          createdAtMs: Date.now(),
        }, path);
        files.push({
          path,
          lock,
          handle,
          segments,
          generation,
          direct: info.direct,
          sizeAtOpen: reset ? 0 : info.sizeBytes,
        });
      } catch (e) {
        if (handle) uring.closeFile(handle);
        if (!(lock instanceof Error)) lock.close();
        locks.delete(path);
        problems.push(`${path}: ${(e as Error).message}`);
        log("error", `SSD cache path ${path} is not usable: ${(e as Error).message}`);
      }
    }
    if (files.length === 0) {
      throw new SsdOpenError(`no SSD cache path is usable: ${problems.join("; ")}`);
    }
    return files;
  }

  static async #readSuper(io: SsdIo, handle: number) {
    const b = io.newBatch();
    b.read(handle, 0, true, [], false);
    const r = await io.run(b);
    try {
      if (r.status[0] !== 0) return `superblock read failed: ${r.errorText(0)}`;
      return decodeSuperblock(r.header(0));
    } finally {
      r.release();
    }
  }

  static async #writeSuper(
    io: SsdIo,
    handle: number,
    sb: Parameters<typeof encodeSuperblock>[1],
    path: string,
  ): Promise<void> {
    const b = io.newBatch();
    const i = b.write(handle, 0, true, []);
    encodeSuperblock(b.headerPage(i), sb);
    const r = await io.run(b);
    r.release();
    if (r.status[0] !== 0) {
      throw new Error(
        `writing the superblock of ${path} failed: ${r.errorText(0)} (errno ${r.aux[0]})`,
      );
    }
  }

  // ---- write-behind ------------------------------------------------------

  /**
   * Offers sealed blocks for writing. Never waits: when the write queue is
   * full the batch is dropped and counted (and never pinned). Blocks already
   * on SSD or already queued are skipped.
   */
  enqueueWrite<B extends SsdWriteBlock>(batch: SsdWriteBatch<B>): EnqueueResult {
    const { blocks } = batch;
    if (this.#closed) return { status: "dropped", blocks: blocks.length, duplicates: 0 };
    const fresh: B[] = [];
    let duplicates = 0;
    for (const b of blocks) {
      // A record of the key from another layout does not count: this one is written too.
      const held = this.#index.get(b.key)?.layout === b.layout.fingerprint;
      if (held || this.#pendingKeys.has(b.key)) duplicates++;
      else fresh.push(b);
    }
    if (fresh.length === 0) return { status: "nothing-to-write", blocks: 0, duplicates };
    const sub = this.#writes.submit({ blocks: fresh, pin: () => batch.pin(fresh) });
    if (sub.status === "dropped" || sub.status === "refused") {
      this.#s.writeQueueFullDrops++;
      this.#s.writeQueueFullDroppedBlocks += fresh.length;
      return { status: "dropped", blocks: fresh.length, duplicates };
    }
    for (const b of fresh) this.#pendingKeys.add(b.key);
    const ended = sub.done();
    this.#writesPending.add(ended);
    ended.then(() => this.#writesPending.delete(ended));
    return { status: "queued", blocks: fresh.length, duplicates };
  }

  /** Resolves when every write accepted so far has ended (tests, shutdown). */
  async flushWrites(): Promise<void> {
    while (this.#writesPending.size > 0) await Promise.all(this.#writesPending);
  }

  async #writeJob(job: WriteJob): Promise<void> {
    // Pinned now, not when queued: a queued batch keeps nothing from eviction.
    let pinned: SsdPinned | undefined;
    try {
      pinned = job.pin();
      const chunks = [];
      for (let start = 0; start < job.blocks.length; start += this.#chunk) {
        const end = Math.min(job.blocks.length, start + this.#chunk);
        chunks.push(
          this.#writeChunk(job.blocks.slice(start, end), pinned.extents.slice(start, end)),
        );
      }
      await Promise.all(chunks);
    } finally {
      for (const b of job.blocks) this.#pendingKeys.delete(b.key);
      pinned?.release();
    }
  }

  async #writeChunk(
    blocks: SsdWriteBlock[],
    pinned: readonly (readonly PoolExtent[] | undefined)[],
  ): Promise<void> {
    const batch = this.#io.newBatch();
    const placed: {
      block: SsdWriteBlock;
      seg: Segment;
      off: number;
      bytes: number;
      seq: number;
    }[] = [];
    for (let i = 0; i < blocks.length; i++) {
      const block = blocks[i];
      const extents = pinned[i];
      if (!extents) {
        this.#s.writeSkippedEvicted++;
        continue;
      }
      const bytes = extents.reduce((n, e) => n + e.bytes, 0);
      const seq = this.#seq++;
      const a = this.#ring.allocate(recordBytes(bytes), seq);
      if (typeof a === "string") {
        this.#s.writeSkippedNoSpace++;
        this.#log("warn", `block ${block.key} (${bytes} bytes) not written to SSD: ${a}`);
        continue;
      }
      placed.push({ block, seg: a.segment, off: a.fileOffset, bytes, seq });
      batch.write(this.files[a.segment.file].handle, a.fileOffset, true, [...extents]);
    }
    if (placed.length === 0) return;
    const t0 = performance.now();
    try {
      const crcs = await this.#io.checksum(batch);
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
          generation: this.files[p.seg.file].generation,
          namespace: p.block.namespace,
          layout: p.block.layout.fingerprint,
          layoutSummary: p.block.layout.summary,
        }, keyBytes(p.block.key));
      }
      const r = await this.#io.run(batch);
      r.release();
      let bytes = 0;
      for (let i = 0; i < placed.length; i++) {
        const p = placed[i];
        if (r.status[i] === 0) {
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
          this.#s.writeFailures++;
          this.#log(
            "error",
            `SSD write of block ${p.block.key} failed: ${r.errorText(i)} (errno ${r.aux[i]}) ` +
              `at ${this.files[p.seg.file].path} offset ${p.off}, ${recordBytes(p.bytes)} bytes`,
          );
        }
      }
      this.#s.writeBytes += bytes;
      this.#s.writeThroughputBps = ewma(
        this.#s.writeThroughputBps,
        bytes / ((performance.now() - t0) / 1000),
      );
    } finally {
      for (const p of placed) p.seg.inflightWrites--;
    }
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
    return this.#requests.has(reqId);
  }

  /**
   * Polls request `reqId`: `loading` while any read it waits on runs, then
   * `ready` once (the request is forgotten); undefined for an unknown id.
   */
  poll(reqId: string): "loading" | "ready" | undefined {
    const req = this.#requests.get(reqId);
    if (!req) return undefined;
    if (req.jobs.some((j) => !j.done)) return "loading";
    this.#requests.delete(reqId);
    return "ready";
  }

  /**
   * The prefetch protocol of QueryPrefetch, keyed by request id:
   *  - first call: walks `keys` (the part of the prefix past RAM) from the
   *    first: a key being read for another request joins that read; a key
   *    on SSD under layout `layout` is read into pool space from `allocate`
   *    (within the global budget); the walk stops at the first key that is
   *    neither. Something to wait for → `loading`, else `miss` with why;
   *  - later calls with the same id: `loading` while any of those reads
   *    runs, then `ready` once (the request is forgotten).
   * Every verified block is committed (its allocation's `commit`) the moment
   * it lands, so it is an ordinary cached block for every query, whether or
   * not anyone polls again. A block that fails verification ends its read
   * there; it is dropped from the index and counted.
   */
  prefetch(
    reqId: string,
    keys: readonly string[],
    allocate: PrefetchAllocator,
    layout: string,
  ): PrefetchAnswer {
    const polled = this.poll(reqId);
    if (polled) return { state: polled };
    if (this.#closed) return { state: "miss", reason: "queue-full" };
    const joined = new Set<PrefetchJob>();
    const mine: PrefetchWant[] = [];
    const locs: SsdLocation[] = [];
    const room = this.#opts.maxPrefetchBlocks - this.#reserved;
    let stop: "not-on-ssd" | "other-layout" | "budget" | undefined;
    for (let index = 0; index < keys.length; index++) {
      const key = keys[index];
      const running = this.#fetching.get(key);
      if (running) {
        if (running.layout !== layout) {
          stop = "other-layout";
          break;
        }
        joined.add(running);
        continue;
      }
      const loc = this.#index.get(key);
      if (!loc) {
        stop = "not-on-ssd";
        break;
      }
      if (loc.layout !== layout) {
        stop = "other-layout";
        break;
      }
      if (mine.length >= room) {
        stop = "budget";
        break;
      }
      mine.push({ key, index, payloadBytes: loc.payloadBytes });
      locs.push(loc);
    }
    if (stop === "other-layout") {
      this.#s.layoutMismatches++;
      if (joined.size === 0 && mine.length === 0) return { state: "miss", reason: "other-layout" };
    }
    if (stop === "budget") {
      if (joined.size === 0 && mine.length === 0) {
        this.#s.prefetchBackpressure++;
        return { state: "miss", reason: "budget" };
      }
      if (mine.length > 0) this.#s.prefetchPartial++;
    }
    if (joined.size === 0 && mine.length === 0) return { state: "miss", reason: "not-on-ssd" };
    const jobs = [...joined];
    if (mine.length > 0) {
      const allocations = allocate(mine).slice(0, mine.length);
      if (allocations.length === 0 && jobs.length === 0) {
        this.#s.prefetchBackpressure++;
        return { state: "miss", reason: "no-pool-space" };
      }
      if (allocations.length > 0) {
        const n = allocations.length;
        let end = () => {};
        const ended = new Promise<void>((r) => end = r);
        const job: PrefetchJob = {
          keys: mine.slice(0, n).map((w) => w.key),
          locs: locs.slice(0, n),
          allocations,
          layout,
          done: false,
          doneAt: 0,
          ended,
          end,
        };
        const sub = this.#prefetches.submit(job);
        if (sub.status === "refused" || sub.status === "dropped") {
          for (const a of allocations) a.free();
          this.#s.prefetchBackpressure++;
          if (jobs.length === 0) return { state: "miss", reason: "queue-full" };
        } else {
          this.#reserved += n;
          for (const k of job.keys) this.#fetching.set(k, job);
          jobs.push(job);
        }
      }
    }
    // Swept here too (not only by the timer) so the table stays bounded under a burst;
    // not on the miss paths above, which every cold query takes.
    this.#expire();
    this.#requests.set(reqId, { jobs });
    return { state: "loading" };
  }

  /** Resolves when the prefetch for `reqId` is no longer loading (tests, demos). */
  async prefetchSettled(reqId: string): Promise<void> {
    const req = this.#requests.get(reqId);
    if (req) await Promise.all(req.jobs.map((j) => j.ended));
  }

  async #prefetchJob(job: PrefetchJob): Promise<void> {
    const { keys, locs, allocations } = job;
    let next = 0; // allocations[next..] are neither committed nor freed yet
    try {
      const t0 = performance.now();
      // Every chunk is submitted at once (the header arena bounds what is in
      // flight); verification then walks them in order and stops at the
      // first block that fails, so only a verified prefix is delivered.
      const runs = [];
      for (let start = 0; start < locs.length; start += this.#chunk) {
        const end = Math.min(locs.length, start + this.#chunk);
        const batch = this.#io.newBatch();
        for (let i = start; i < end; i++) {
          const l = locs[i];
          batch.read(
            this.files[l.segment.file].handle,
            l.fileOffset,
            true,
            allocations[i].extents,
            true,
          );
        }
        // A batch the engine refuses (closing) must not become an unhandled rejection.
        runs.push({ start, end, result: this.#io.run(batch).catch((e: Error) => e) });
      }
      let bytes = 0;
      let blocks = 0;
      let ok = true;
      for (const run of runs) {
        const r = await run.result;
        if (r instanceof Error) {
          if (ok) {
            this.#s.readFailures++;
            this.#log(
              "error",
              `SSD prefetch of block ${keys[run.start]} not submitted: ${r.message}`,
            );
          }
          ok = false;
          continue;
        }
        try {
          for (let i = run.start; i < run.end && ok; i++) {
            ok = this.#verify(keys[i], locs[i], job.layout, r, i - run.start);
            if (ok) {
              // Visible to every query from now on, and evictable like any cached block.
              next = i + 1;
              this.#fetching.delete(keys[i]);
              allocations[i].commit();
              bytes += locs[i].payloadBytes;
              blocks++;
            }
          }
        } finally {
          r.release();
        }
      }
      this.#s.readBytes += bytes;
      this.#s.readBlocks += blocks;
      const secs = (performance.now() - t0) / 1000;
      if (bytes > 0) this.#s.readThroughputBps = ewma(this.#s.readThroughputBps, bytes / secs);
    } finally {
      for (let i = next; i < allocations.length; i++) allocations[i].free();
      for (const k of keys) if (this.#fetching.get(k) === job) this.#fetching.delete(k);
      this.#reserved -= allocations.length;
      job.done = true;
      job.doneAt = Date.now();
      job.end();
    }
  }

  /** Checks one read op: I/O status, header identity and layout, payload CRC. */
  #verify(
    key: string,
    loc: SsdLocation,
    layout: string,
    r: Awaited<ReturnType<SsdIo["run"]>>,
    i: number,
  ): boolean {
    const where = `${this.files[loc.segment.file].path} offset ${loc.fileOffset}`;
    if (r.status[i] !== 0) {
      this.#s.readFailures++;
      this.#log(
        "error",
        `SSD read of block ${key} failed: ${r.errorText(i)} (errno ${r.aux[i]}) at ${where}`,
      );
      this.#index.remove(key, loc);
      return false;
    }
    const h = decodeHeader(r.header(i));
    let problem = "";
    if (typeof h === "string") problem = `header ${h}`;
    else if (h.key !== key) problem = `header holds block ${h.key} (the segment was reused)`;
    else if (h.layout !== layout) {
      problem = `written by layout ${h.layout} (${h.layoutSummary}), asked for by layout ${layout}`;
    } else if (h.seq !== loc.seq || h.payloadBytes !== loc.payloadBytes) {
      problem =
        `header seq/length ${h.seq}/${h.payloadBytes}, index ${loc.seq}/${loc.payloadBytes}`;
    } else if (h.payloadCrc !== loc.payloadCrc || r.aux[i] !== loc.payloadCrc) {
      problem = `payload CRC32C ${r.aux[i].toString(16)}, expected ${loc.payloadCrc.toString(16)}`;
    }
    if (problem) {
      this.#s.checksumFailures++;
      this.#log(
        "warn",
        `SSD block ${key} failed verification (${problem}) at ${where}: served as a miss`,
      );
      this.#index.remove(key, loc);
      return false;
    }
    return true;
  }

  /** Forgets finished prefetches nobody polled for (their blocks stay cached). */
  #expire(): void {
    const cutoff = Date.now() - this.#opts.prefetchTtlMs;
    for (const [id, req] of this.#requests) {
      if (req.jobs.every((j) => j.done && j.doneAt < cutoff)) {
        this.#requests.delete(id);
        this.#s.prefetchExpired++;
      }
    }
  }

  // ---- stats and shutdown --------------------------------------------------

  /** True once {@link close} began. */
  get closed(): boolean {
    return this.#closed;
  }

  /** Counters and gauges for /metrics and tests. */
  stats(): SsdStats {
    const w = this.#writes.stats(), p = this.#prefetches.stats();
    return {
      ...this.#s,
      capacityBytes: this.#ring.capacityBytes,
      indexBlocks: this.#index.size,
      indexBytes: this.#index.payloadBytes,
      recoveredBlocks: this.recovery.blocks,
      recoveredBytes: this.recovery.bytes,
      recoveryTornRecords: this.recovery.truncated + this.recovery.stoppedOnBadHeader,
      writeQueueDepth: w.queue.depth,
      writeInflight: w.inflight,
      prefetchQueueDepth: p.queue.depth,
      prefetchInflight: p.inflight,
      prefetchBudgetBlocks: this.#opts.maxPrefetchBlocks,
      prefetchReservedBlocks: this.#reserved,
      segmentsReused: this.#ring.reuses,
      alignmentFallbacks: this.#io.uring.info().alignmentFallbacks,
    };
  }

  /**
   * Finishes queued writes and reads, frees prefetched blocks nobody took,
   * syncs and closes the files. Idempotent.
   */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    clearInterval(this.#expiryTimer);
    await Promise.all([this.#writes.drain(), this.#prefetches.drain()]);
    this.#requests.clear();
    this.#reserved = 0;
    for (const f of this.files) await this.#io.uring.sync(f.handle);
    this.#io.dispose();
    await this.#io.uring.close();
    for (const f of this.files) f.lock.close();
  }
}

function ewma(prev: number, sample: number): number {
  if (!Number.isFinite(sample)) return prev;
  return prev === 0 ? sample : prev + THROUGHPUT_EWMA_WEIGHT * (sample - prev);
}
