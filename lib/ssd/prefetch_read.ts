/**
 * The read of one SSD prefetch: its records read into the pool space the
 * caller planned, in io batches submitted at once, verified in order, and
 * each verified block committed the moment it verifies; the space of the
 * rest is given back once every batch of the read ended (a read still in
 * flight lands in its blocks' space, so it is never freed before).
 *
 * Every read is verified: I/O status, header (magic, version, CRC), the
 * expected key, sequence number, length and layout fingerprint, and the
 * payload CRC32C computed by the reaper thread. A block that fails ends its
 * read there (only the verified prefix before it is delivered), is dropped
 * from the index, counted and logged. So does a block whose commit throws
 * (the commit has taken its space all the same: it is not freed after).
 * A block dropped (a discard, drops.ts) while it was read is a miss there
 * too, neither delivered nor counted as damage (logged with its ids). A free
 * that throws is logged; the read still ends.
 *
 * @module
 */

import { decodeHeader, isPad } from "./format.ts";
import type { IoBatchResult, SsdIo } from "./io.ts";
import type { SsdIndex, SsdLocation } from "./index.ts";
import type { CacheFile } from "./cache_files.ts";
import type { PrefetchAllocation } from "./prefetch.ts";
import { ewma } from "./throughput.ts";
import { errorText, type Logger } from "../log.ts";

/** What one read reads: `keys[i]` at `locs[i]` into `allocations[i]`. */
export interface PrefetchRead {
  keys: string[];
  locs: SsdLocation[];
  allocations: PrefetchAllocation[];
  /** Layout fingerprint the blocks must carry. */
  layout: string;
}

/** Read counters (part of `SsdReadStats`). */
export interface PrefetchReadCounters {
  readBytes: number;
  readBlocks: number;
  readFailures: number;
  checksumFailures: number;
  readThroughputBps: number;
}

/** What the reader works on (the tier's io, open files and index). */
export interface PrefetchReaderDeps {
  io: SsdIo;
  files: readonly CacheFile[];
  index: SsdIndex;
  log: Logger;
  /** Blocks per io batch (bounded by the header arena). */
  chunk: number;
}

/** One io batch of a read: blocks [start, end). */
interface ReadRun {
  start: number;
  end: number;
  /** Its result was awaited and released by the verification walk. */
  ended: boolean;
  /** The batch's result, or the Error the engine refused it with. */
  result: Promise<IoBatchResult | Error>;
}

/**
 * Reads prefetched records into the pool.
 *
 * @example
 * ```ts
 * const reader = new PrefetchReader({ io, files, index, log, chunk: 64 });
 * await reader.read({ keys, locs, allocations, layout }, (key) => fetching.delete(key));
 * ```
 */
export class PrefetchReader {
  readonly #io: SsdIo;
  readonly #files: readonly CacheFile[];
  readonly #index: SsdIndex;
  readonly #log: Logger;
  readonly #chunk: number;
  readonly #s: PrefetchReadCounters = {
    readBytes: 0,
    readBlocks: 0,
    readFailures: 0,
    checksumFailures: 0,
    readThroughputBps: 0,
  };

  constructor(d: PrefetchReaderDeps) {
    this.#io = d.io;
    this.#files = d.files;
    this.#index = d.index;
    this.#log = d.log;
    this.#chunk = d.chunk;
  }

  /**
   * Reads `job`: every allocation is committed (a verified prefix) or freed,
   * exactly once; `committing(key)` is called right before a block's commit.
   * Resolves when every io batch of the read ended.
   */
  async read(job: PrefetchRead, committing: (key: string) => void): Promise<void> {
    const { keys, locs } = job;
    let next = 0; // allocations[next..] are neither committed nor freed yet
    const runs: ReadRun[] = [];
    try {
      const t0 = performance.now();
      this.#submit(job, runs);
      let bytes = 0;
      let blocks = 0;
      let ok = true;
      for (const run of runs) {
        const r = await run.result;
        run.ended = true;
        if (r instanceof Error) {
          if (ok) this.#notSubmitted(job, run.start, r);
          ok = false;
          continue;
        }
        try {
          for (let i = run.start; i < run.end && ok; i++) {
            ok = this.#verify(keys[i], locs[i], job.layout, r, i - run.start);
            if (!ok) break;
            next = i + 1; // the commit takes the space even when it throws
            committing(keys[i]);
            ok = this.#commit(job, i);
            if (ok) {
              bytes += locs[i].payloadBytes;
              blocks++;
            }
          }
        } finally {
          r.release();
        }
      }
      this.#count(bytes, blocks, t0);
    } finally {
      // After a throw above, batches not yet awaited may still be reading into their space.
      for (const run of runs) {
        if (run.ended) continue;
        const r = await run.result;
        if (!(r instanceof Error)) r.release();
      }
      this.freeFrom(job, next);
    }
  }

  /**
   * Gives back the space of `job`'s blocks from `from` on (not delivered),
   * each once; a free that throws is logged and the others are still freed.
   */
  freeFrom(job: PrefetchRead, from: number): void {
    for (let i = from; i < job.allocations.length; i++) this.#free(job, i);
  }

  /** Counters. */
  stats(): PrefetchReadCounters {
    return { ...this.#s };
  }

  /** Submits `job`'s reads, one io batch per chunk, into `runs` (a refused batch is its Error). */
  #submit(job: PrefetchRead, runs: ReadRun[]): void {
    const { locs, allocations } = job;
    for (let start = 0; start < locs.length; start += this.#chunk) {
      const end = Math.min(locs.length, start + this.#chunk);
      const batch = this.#io.newBatch();
      for (let i = start; i < end; i++) {
        const l = locs[i];
        batch.read(
          this.#files[l.segment.file].handle,
          l.fileOffset,
          true,
          allocations[i].extents,
          true,
        );
      }
      // A batch the engine refuses (closing) must not become an unhandled rejection.
      runs.push({ start, end, ended: false, result: this.#io.run(batch).catch((e: Error) => e) });
    }
  }

  #count(bytes: number, blocks: number, t0: number): void {
    this.#s.readBytes += bytes;
    this.#s.readBlocks += blocks;
    const secs = (performance.now() - t0) / 1000;
    if (bytes > 0) this.#s.readThroughputBps = ewma(this.#s.readThroughputBps, bytes / secs);
  }

  #notSubmitted(job: PrefetchRead, i: number, e: Error): void {
    this.#s.readFailures++;
    this.#log.error("SSD prefetch not submitted", {
      block: job.keys[i],
      namespace: job.locs[i].namespace,
      error: e.message,
    });
  }

  /**
   * Commits block `i` of `job`: visible to every query from now on. A commit
   * that throws has taken the space all the same (it is not freed after); it
   * ends the delivered prefix there, counted and logged.
   */
  #commit(job: PrefetchRead, i: number): boolean {
    try {
      job.allocations[i].commit();
      return true;
    } catch (e) {
      this.#s.readFailures++;
      this.#log.error("SSD prefetch: a verified block could not be committed into RAM", {
        block: job.keys[i],
        namespace: job.locs[i].namespace,
        error: errorText(e),
      });
      return false;
    }
  }

  /** Gives back block `i`'s space (not delivered); a free that throws is logged, the read still ends. */
  #free(job: PrefetchRead, i: number): void {
    try {
      job.allocations[i].free();
    } catch (e) {
      this.#log.error("SSD prefetch: the pool space of a block not delivered could not be freed", {
        block: job.keys[i],
        namespace: job.locs[i].namespace,
        error: errorText(e),
      });
    }
  }

  /** Checks one read op: I/O status, header identity and layout, payload CRC. */
  #verify(key: string, loc: SsdLocation, layout: string, r: IoBatchResult, i: number): boolean {
    const where = {
      namespace: loc.namespace,
      path: this.#files[loc.segment.file].path,
      offset: loc.fileOffset,
    };
    if (r.status[i] !== 0) {
      this.#s.readFailures++;
      this.#log.error("SSD read failed", {
        block: key,
        error: r.errorText(i),
        errno: r.aux[i],
        ...where,
      });
      this.#index.remove(key, loc);
      return false;
    }
    const h = decodeHeader(r.header(i));
    if (typeof h !== "string" && (isPad(h) || h.key === key) && this.#index.get(key) !== loc) {
      // Dropped while read (a discard): its pad landed first, or is still to land over the
      // record read whole. Neither damage nor a block to deliver: a miss, not counted.
      this.#log.info("SSD block dropped while it was read: served as a miss", {
        block: key,
        ...where,
      });
      return false;
    }
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
      this.#log.warn("SSD block failed verification: served as a miss", {
        block: key,
        problem,
        ...where,
      });
      this.#index.remove(key, loc);
      return false;
    }
    return true;
  }
}
