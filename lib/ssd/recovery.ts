/**
 * Rebuilding the index from disk at start.
 *
 * Every record carries its own header, so the disk alone says what it holds
 * (no journal to keep consistent with the data, no second write per block).
 * Records never straddle a segment, and every segment starts with a record,
 * so all segments are scanned at once: round r reads the r-th header of
 * every segment still going, in one io batch. A 512 GB cache of 2 MiB
 * blocks in 64 MiB segments is ~32 rounds of ~8K parallel 4 KiB reads.
 *
 * A segment's chain stops at the first header that does not verify (magic,
 * version, checksum, lengths), belongs to another generation or fill
 * (epoch), or whose record would end past the segment or the file's end (a
 * torn or truncated last write). A pad (the header written over a failed
 * write, format.ts) is stepped over: the records placed after the failure
 * in the same fill stay reachable. Payload checksums are not read here (that
 * would read the whole disk); every read verifies them before serving.
 *
 * @module
 */

import { decodeHeader, isPad, PAGE_BYTES, type RecordHeader } from "./format.ts";
import type { IoBatchResult, SsdIo } from "./io.ts";
import type { SsdIndex } from "./index.ts";
import type { Segment, SegmentRing } from "./space.ts";
import type { Logger } from "../log.ts";

/** One cache file as recovery needs it. */
export interface RecoveryFile {
  handle: number;
  path: string;
  sizeBytes: number;
  generation: number;
}

/** What recovery found. */
export interface RecoveryReport {
  /** Records indexed. */
  blocks: number;
  /** Payload bytes indexed. */
  bytes: number;
  /**
   * Segment chains that ended on a header that did not verify (a torn write, damage) or whose
   * record would run past its segment; not the normal end of a chain (space never written, a
   * record of an older fill or generation).
   */
  stoppedOnBadHeader: number;
  /** Records whose end lay past the end of the file (truncated). */
  truncated: number;
  /** Highest sequence number seen (the next write continues after it). */
  maxSeq: number;
  /** Header reads issued. */
  headerReads: number;
  /**
   * Header reads that failed with an I/O error (not a read past the written
   * end of a sparse file): the disk is failing there; that segment's chain
   * ends at the failed read (its records beyond cannot be read).
   */
  readErrors: number;
  /** The first of those, to name in the log. */
  firstReadError?: { path: string; offset: number; error: string };
}

/** Linux errno of a short read (the io reaper's code for reading past the written end). */
const ENODATA = 61;

/** Where a segment's scan stands: its next header's offset and the last record's seq. */
interface Chain {
  seg: Segment;
  cursor: number;
  lastSeq: number;
}

/**
 * The first sequence number after a recovery: above every record on disk, also those past a gap
 * or a tear that the scan did not reach (a chain stops at its first gap; records placed after it
 * keep their higher seqs). Those fit in the ring, a page at least each: skipping as many seqs as
 * it has pages puts new records above all of them, so a record of an older write is never taken
 * for a newer one.
 *
 * @example
 * ```ts
 * ring.resume(nextSeqAfter(report, ring));
 * ```
 */
export function nextSeqAfter(report: RecoveryReport, ring: SegmentRing): number {
  return report.maxSeq + 1 + ring.capacityBytes / PAGE_BYTES;
}

/** Where the scan stands (logged while it runs: a large cache takes a while). */
export interface RecoveryProgress {
  /** Segments whose chain has ended / segments to scan. */
  segmentsDone: number;
  segmentsTotal: number;
  /** Record headers read and records indexed so far. */
  headersRead: number;
  records: number;
  /** Bytes of the files covered so far (finished segments + chains walked) / to cover. */
  bytesScanned: number;
  bytesTotal: number;
  elapsedMs: number;
}

/** How {@link recoverIndex} reports progress. */
export interface RecoveryProgressSink {
  /** Called after a round once this long has passed since the last call (0: every round). */
  intervalMs: number;
  report(p: RecoveryProgress, final: boolean): void;
}

/**
 * Scans every segment of `ring` and fills `index`.
 *
 * @param maxBatch most header reads per io batch (≤ the staging pages).
 * @param progress told where the scan stands every `intervalMs`, and at the end.
 */
export async function recoverIndex(
  io: SsdIo,
  files: RecoveryFile[],
  ring: SegmentRing,
  index: SsdIndex,
  maxBatch: number,
  progress?: RecoveryProgressSink,
): Promise<RecoveryReport> {
  const report: RecoveryReport = {
    blocks: 0,
    bytes: 0,
    stoppedOnBadHeader: 0,
    truncated: 0,
    maxSeq: 0,
    headerReads: 0,
    readErrors: 0,
  };
  // Segments still scanning, with their cursor (bytes into the segment).
  let active: Chain[] = ring.segments
    .filter((s) => s.fileOffset < files[s.file].sizeBytes)
    .map((seg) => ({ seg, cursor: 0, lastSeq: -1 }));
  const t0 = performance.now();
  let lastReport = t0;
  const total = active.length;
  const where = (): RecoveryProgress => {
    let walked = 0;
    for (const a of active) walked += a.cursor;
    const done = total - active.length;
    return {
      segmentsDone: done,
      segmentsTotal: total,
      headersRead: report.headerReads,
      records: index.size,
      bytesScanned: done * ring.segmentBytes + walked,
      bytesTotal: total * ring.segmentBytes,
      elapsedMs: Math.round(performance.now() - t0),
    };
  };
  while (active.length > 0) {
    const now = performance.now();
    if (progress && now - lastReport >= progress.intervalMs) {
      lastReport = now;
      progress.report(where(), false);
    }
    const next: Chain[] = [];
    for (let start = 0; start < active.length; start += maxBatch) {
      const chunk = active.slice(start, start + maxBatch);
      const batch = io.newBatch();
      for (const a of chunk) {
        batch.read(files[a.seg.file].handle, a.seg.fileOffset + a.cursor, true, [], false);
      }
      report.headerReads += chunk.length;
      const res = await io.run(batch);
      try {
        for (let i = 0; i < chunk.length; i++) {
          const a = chunk[i];
          const file = files[a.seg.file];
          if (res.status[i] !== 0) {
            countReadError(res, i, file.path, a.seg.fileOffset + a.cursor, report);
            continue; // the chain ends
          }
          const more = takeHeader(a, res.header(i), file, ring, index, report);
          if (more) next.push(more);
        }
      } finally {
        res.release();
      }
    }
    active = next;
  }
  progress?.report(where(), true);
  report.bytes = index.payloadBytes;
  report.blocks = index.size;
  return report;
}

/**
 * A failed header read: reading past the written part of a sparse file is not
 * an error (the reaper reports short reads as ENODATA); any other errno is the
 * disk failing there, counted and, the first time, kept to be named.
 */
function countReadError(
  res: IoBatchResult,
  i: number,
  path: string,
  offset: number,
  report: RecoveryReport,
): void {
  if (res.aux[i] === ENODATA) return;
  report.readErrors++;
  report.firstReadError ??= { path, offset, error: res.errorText(i) };
}

/**
 * One header read at `a`'s cursor: indexes its record (when it belongs to
 * the segment's chain and lies inside the segment and the file) and answers
 * where the chain goes on, or null where it ends.
 */
function takeHeader(
  a: Chain,
  bytes: Uint8Array,
  file: RecoveryFile,
  ring: SegmentRing,
  index: SsdIndex,
  report: RecoveryReport,
): Chain | null {
  const h = decodeHeader(bytes);
  // The normal end of a chain is space never written (no magic: a sparse file reads zeros)
  // or a record of an older fill or life of the file; only a header that does not verify
  // is damage (counted: a torn write, a flipped bit).
  if (typeof h === "string") {
    if (h !== "magic") report.stoppedOnBadHeader++;
    return null;
  }
  if (!belongs(h, a, file.generation)) return null;
  const offset = a.seg.fileOffset + a.cursor;
  if (a.cursor + h.recordBytes > ring.segmentBytes) {
    report.stoppedOnBadHeader++;
    return null;
  }
  if (offset + h.recordBytes > file.sizeBytes) {
    report.truncated++;
    return null;
  }
  if (a.cursor === 0) a.seg.epoch = h.epoch;
  a.seg.fill = a.cursor + h.recordBytes;
  if (h.seq > report.maxSeq) report.maxSeq = h.seq;
  const next = a.cursor + h.recordBytes < ring.segmentBytes
    ? { seg: a.seg, cursor: a.cursor + h.recordBytes, lastSeq: h.seq }
    : null;
  if (isPad(h)) return next; // a failed write's space: the chain goes on past it
  const fresh = index.put(h.key, {
    segment: a.seg,
    fileOffset: offset,
    payloadBytes: h.payloadBytes,
    payloadCrc: h.payloadCrc,
    seq: h.seq,
    namespace: h.namespace,
    layout: h.layout,
  }, h.layoutSummary);
  if (fresh) report.blocks++;
  return next;
}

/** A header continues its segment's chain: same generation, same fill. */
function belongs(
  h: RecordHeader,
  a: Chain,
  generation: number,
): boolean {
  if (h.generation !== generation) return false;
  // The first record of a fill opened it: its seq is the fill's epoch.
  if (a.cursor === 0) return h.epoch === h.seq;
  // A fill's records are placed in seq order: a lower one is an older record of this fill,
  // left past a gap and reached again once newer records were written up to it.
  return h.epoch === a.seg.epoch && h.seq > a.lastSeq;
}

/**
 * The one line an operator watches during a long index rebuild: a sentence
 * with the counts, and the same counts as fields.
 */
export function logRebuildProgress(log: Logger, p: RecoveryProgress, final: boolean): void {
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
