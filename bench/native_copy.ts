/**
 * Shared pieces of the native copy benchmarks: strided batch building and a
 * timing loop that reports GB/s and per-batch p50/p99.
 */
import {
  type CopyBatch,
  type CopyEngine,
  type CopyPath,
  type Direction,
  type Region,
} from "../ffi/mod.ts";

/** One measured configuration. */
export interface Row {
  direction: Direction;
  path: CopyPath;
  segBytes: number;
  segments: number;
  layers: number;
  bytes: number;
  /** GB/s from the library's submit→last-byte time (median batch). */
  gbps: number;
  /** GB/s from JS wall time submit→done resolved (median batch). */
  wallGbps: number;
  p50Ms: number;
  p99Ms: number;
  /** Wall time submit → first group reported (layer-wise progress), p50. */
  firstLayerMs?: number;
  peakGbps: number;
  /** gbps / peakGbps. */
  ratio: number;
  hugepages: boolean;
  grid?: number;
  note?: string;
}

/**
 * Fills `batch` with `segments` segments of `segBytes` split over `layers`
 * groups. Region side: segment i at 2*i*segBytes (a gap after each, so no
 * two segments merge: the worst case for DMA); pool side: contiguous.
 */
export function fillStrided(
  batch: CopyBatch,
  region: Region,
  direction: Direction,
  path: CopyPath,
  segBytes: number,
  segments: number,
  layers: number,
): CopyBatch {
  batch.reset(direction, path);
  const per = Math.ceil(segments / layers);
  let i = 0;
  for (let l = 0; l < layers && i < segments; l++) {
    batch.group(region, l);
    for (let k = 0; k < per && i < segments; k++, i++) {
      batch.seg(2 * i * segBytes, i * segBytes, segBytes);
    }
  }
  return batch;
}

/** Percentile of a sorted array. */
export function pct(sorted: number[], p: number): number {
  if (sorted.length === 0) return 0;
  return sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))];
}

/** Runs `batch` warm + iters times, serially; returns median lib ns and wall ms stats. */
export async function timeBatch(
  ce: CopyEngine,
  batch: CopyBatch,
  warm: number,
  iters: number,
): Promise<
  { libNs: number; minNs: number; wall: number[]; first: number[]; bytes: number; path: CopyPath }
> {
  const lib: number[] = [];
  const wall: number[] = [];
  const first: number[] = [];
  let bytes = 0;
  let path: CopyPath = batch.path;
  for (let i = 0; i < warm + iters; i++) {
    const t0 = performance.now();
    const s = ce.submit(batch);
    let tFirst = 0;
    s.layers$.subscribe(() => {
      if (!tFirst) tFirst = performance.now();
    });
    const r = await s.done;
    const t1 = performance.now();
    if (r.status !== 0) throw new Error(`batch failed with status ${r.status}`);
    if (i >= warm) {
      lib.push(r.ns);
      wall.push(t1 - t0);
      first.push((tFirst || t1) - t0);
    }
    bytes = r.bytes;
    path = r.path;
  }
  lib.sort((a, b) => a - b);
  wall.sort((a, b) => a - b);
  first.sort((a, b) => a - b);
  return { libNs: pct(lib, 0.5), minNs: lib[0], wall, first, bytes, path };
}

/** Formats rows as a fixed-width table. */
export function table(rows: Row[]): string {
  const head = [
    "dir",
    "path",
    "seg",
    "segs",
    "layers",
    "MB",
    "GB/s",
    "wall GB/s",
    "p50 ms",
    "p99 ms",
    "first ms",
    "peak",
    "ratio",
    "huge",
    "grid",
  ];
  const lines = [head.join("\t")];
  for (const r of rows) {
    lines.push([
      r.direction,
      r.path,
      r.segBytes >= 1 << 20 ? `${r.segBytes >> 20}M` : `${r.segBytes >> 10}K`,
      r.segments,
      r.layers,
      (r.bytes / 1e6).toFixed(0),
      r.gbps.toFixed(1),
      r.wallGbps.toFixed(1),
      r.p50Ms.toFixed(2),
      r.p99Ms.toFixed(2),
      r.firstLayerMs?.toFixed(2) ?? "",
      r.peakGbps.toFixed(1),
      `${(100 * r.ratio).toFixed(0)}%`,
      r.hugepages ? "y" : "n",
      r.grid ?? "",
    ].join("\t"));
  }
  return lines.join("\n");
}
