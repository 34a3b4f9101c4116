/**
 * The options of the SSD tier (`SsdTier.open`), their defaults and their
 * checks; the CLI flags map onto them 1:1 (flags.ts, docs/ssd.md).
 *
 * @module
 */

import type { Observable } from "rxjs";
import type { StageMetrics } from "../pipeline/stage.ts";
import type { Completion } from "../../ffi/ring.ts";
import type { Logger } from "../log.ts";
import { DEFAULT_IO_STALL_MS } from "./io.ts";
import { DEFAULT_CLOSE_TIMEOUT_MS } from "./stall.ts";
import { SsdOpenError } from "./cache_files.ts";

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
  /**
   * An io batch outstanding longer marks the tier degraded (stall.ts); also
   * the deadline of each filesystem call of `open()` (open_fs.ts). Default 30 s.
   */
  ioStallMs?: number;
  /** `flush()` and `close()` give up past this, or at once when the io stalls. Default 60 s. */
  closeTimeoutMs?: number;
  /** The server's logger (a child with `tier: "ssd"`); default: stderr at info. */
  log?: Logger;
  /** Metric hooks of the `ssd.write` and `ssd.prefetch` stages (depth gauge, drops, refusals). */
  stageMetrics?: (stage: string) => StageMetrics;
}

export type ResolvedOptions = Required<
  Omit<SsdTierOptions, "log" | "ring" | "paths" | "reset" | "stageMetrics">
>;

/**
 * The options with their defaults, checked: every count a non-negative
 * integer, at least one path, and a header arena that holds every write and
 * prefetch in flight.
 */
export function resolveOptions(options: SsdTierOptions): ResolvedOptions {
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
    ioStallMs: options.ioStallMs ?? DEFAULT_IO_STALL_MS,
    closeTimeoutMs: options.closeTimeoutMs ?? DEFAULT_CLOSE_TIMEOUT_MS,
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
