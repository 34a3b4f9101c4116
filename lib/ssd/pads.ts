/**
 * Pads over records that hold no block (format.ts: a header with key length
 * 0 and the record's own seq, epoch and length, which a restart's scan steps
 * over, never indexes):
 *  - over a failed write's header page (a gap): the records placed after it
 *    in its segment stay reachable at a restart;
 *  - over a dropped block's record (a Save's discard, {@link SsdPads.dropped}):
 *    a restart does not index the block again. A later save of the key is a
 *    new record with a higher seq, which the pad does not touch.
 *
 * Why a pad in place and not a journal of drops: the pad is a form the scan
 * already reads, it takes no ring space, it dies with its segment like the
 * record it stands for, and it needs no second place to keep consistent. It
 * costs one 4 KiB header write per dropped record, all of a drop in one io
 * batch per `chunk` (the header arena's share), and one `fdatasync` per file
 * the drop touched: a dropped record must not come back after a power loss
 * either (a lost record is a miss, a lost drop serves wrong bytes).
 *
 * The caller keeps each site's segment from reuse (`inflightWrites`) until
 * the pad ended: a pad written into a refilled segment would land in another
 * record.
 *
 * @module
 */

import { encodePadHeader, recordBytes } from "./format.ts";
import type { IoBatchResult, SsdIo } from "./io.ts";
import type { Segment } from "./space.ts";
import type { CacheFile } from "./cache_files.ts";
import { errorText, type Logger } from "../log.ts";

/** A record to pad over: its block (named in logs), where it lies, its seq and size. */
export interface PadSite {
  block: { key: string; namespace: string };
  seg: Segment;
  /** File offset of the record's header page. */
  off: number;
  /** Payload bytes of the record (its length on disk is `recordBytes(bytes)`). */
  bytes: number;
  seq: number;
}

/** Pad counters (part of `SsdStats`). */
export interface SsdPadStats {
  /** Pads written over failed records (a restart's scan steps over each gap). */
  writePads: number;
  /** Pads that could not be written (the records after each such gap are lost at a restart). */
  writePadFailures: number;
  /** Pads written over dropped blocks' records and synced (a restart does not index them again). */
  dropPads: number;
  /**
   * Drop pads that could not be written, or whose file's sync failed (that block's record may
   * come back at a restart).
   */
  dropPadFailures: number;
}

/** One site whose pad was not written, and why. */
interface PadFailure {
  site: PadSite;
  error: string;
  errno?: number;
}

/**
 * Writes pads for the writer: over failed writes' gaps and dropped records.
 *
 * @example
 * ```ts
 * const pads = new SsdPads(io, files, log, chunk);
 * site.seg.inflightWrites++; // held until the pad ended
 * await pads.dropped([site]);
 * site.seg.inflightWrites--;
 * ```
 */
export class SsdPads {
  readonly #s: SsdPadStats = { writePads: 0, writePadFailures: 0, dropPads: 0, dropPadFailures: 0 };
  readonly #io: SsdIo;
  readonly #files: readonly CacheFile[];
  readonly #log: Logger;
  readonly #chunk: number;
  /** File → syncs after a drop's pads not returned yet. */
  readonly #syncing = new Map<number, number>();

  /** `chunk`: pads per io batch (bounded by the header arena). */
  constructor(io: SsdIo, files: readonly CacheFile[], log: Logger, chunk: number) {
    this.#io = io;
    this.#files = files;
    this.#log = log;
    this.#chunk = chunk;
  }

  /**
   * Pads over failed records: a restart's scan steps over each gap to the
   * records placed after it in its segment. A pad not written is logged: the
   * records after its gap are served until a restart only. Never throws.
   */
  async gaps(sites: readonly PadSite[]): Promise<void> {
    const failed = await this.#write(sites);
    this.#s.writePads += sites.length - failed.length;
    this.#s.writePadFailures += failed.length;
    for (const f of failed) {
      this.#log.error(
        "SSD write gap could not be padded: records after it in its segment are lost at a restart",
        this.#where(f),
      );
    }
  }

  /**
   * Pads over dropped blocks' records, then syncs the files they lie in. A
   * pad not written, or written to a file whose sync failed, is logged with
   * the block, file and offset and counted as a failure: that record may be
   * indexed again at a restart (a failed `fdatasync` may have lost it). Never
   * throws.
   */
  async dropped(sites: readonly PadSite[]): Promise<void> {
    const failed = await this.#write(sites);
    for (const f of failed) {
      this.#log.error(
        "SSD dropped block could not be padded: its record is indexed again at a restart",
        this.#where(f),
      );
    }
    const bad = new Set(failed.map((f) => f.site));
    const byFile = new Map<number, PadSite[]>(); // file → the sites padded there
    for (const s of sites) {
      if (bad.has(s)) continue;
      const padded = byFile.get(s.seg.file);
      if (padded) padded.push(s);
      else byFile.set(s.seg.file, [s]);
    }
    const unsynced = await Promise.all(
      [...byFile].map(([file, padded]) => this.#sync(file, padded)),
    );
    const lost = failed.length + unsynced.reduce((n, u) => n + u, 0);
    this.#s.dropPads += sites.length - lost;
    this.#s.dropPadFailures += lost;
  }

  /** The ids of `site` for a log line: its block, namespace, file path and offset. */
  site(site: PadSite): { block: string; namespace: string; path: string; offset: number } {
    const { block, namespace, path, offset } = this.#where({ site, error: "" });
    return { block, namespace, path, offset };
  }

  /** Counters. */
  stats(): SsdPadStats {
    return { ...this.#s };
  }

  /** The files whose sync after a drop's pads has not returned yet (what a give-up names). */
  syncing(): string[] {
    return [...this.#syncing.keys()].map((file) => this.#files[file].path);
  }

  /**
   * fdatasync of `file` after the pads `padded`; returns how many of them it
   * did not make durable (all when it failed, logged with the first one's ids).
   */
  async #sync(file: number, padded: readonly PadSite[]): Promise<number> {
    this.#syncing.set(file, (this.#syncing.get(file) ?? 0) + 1);
    try {
      await this.#io.uring.sync(this.#files[file].handle);
      return 0;
    } catch (e) {
      this.#log.error(
        "SSD drop not synced: dropped blocks may be indexed again after a power loss",
        { ...this.#where({ site: padded[0], error: errorText(e) }), blocks: padded.length },
      );
      return padded.length;
    } finally {
      const n = this.#syncing.get(file)! - 1;
      if (n > 0) this.#syncing.set(file, n);
      else this.#syncing.delete(file);
    }
  }

  /**
   * Writes a pad over each site, `chunk` per io batch, one batch after the
   * other (a large drop takes one writer's share of the header arena, not
   * all of it); returns the ones not written.
   */
  async #write(sites: readonly PadSite[]): Promise<PadFailure[]> {
    const failed: PadFailure[] = [];
    for (let start = 0; start < sites.length; start += this.#chunk) {
      failed.push(...await this.#batch(sites.slice(start, start + this.#chunk)));
    }
    return failed;
  }

  async #batch(sites: readonly PadSite[]): Promise<PadFailure[]> {
    const batch = this.#io.newBatch();
    const now = Date.now();
    for (const p of sites) {
      const i = batch.write(this.#files[p.seg.file].handle, p.off, true, []);
      encodePadHeader(batch.headerPage(i), {
        seq: p.seq,
        // The segment is held from reuse: its epoch is still the record's fill.
        epoch: p.seg.epoch,
        recordBytes: recordBytes(p.bytes),
        writtenAtMs: now,
        generation: this.#files[p.seg.file].generation,
      });
    }
    let r: IoBatchResult;
    try {
      r = await this.#io.run(batch);
    } catch (e) {
      return sites.map((site) => ({ site, error: errorText(e) }));
    }
    r.release();
    const failed: PadFailure[] = [];
    for (let i = 0; i < sites.length; i++) {
      if (r.status[i] !== 0) {
        failed.push({ site: sites[i], error: r.errorText(i), errno: r.aux[i] });
      }
    }
    return failed;
  }

  #where(f: PadFailure) {
    return {
      block: f.site.block.key,
      namespace: f.site.block.namespace,
      error: f.error,
      errno: f.errno,
      path: this.#files[f.site.seg.file].path,
      offset: f.site.off,
    };
  }
}
