/**
 * The transfer plan: the one place that turns a save plan or a load ticket,
 * plus each layer's geometry and the engine's block ids, into copy segments
 * of ONE native batch, merged once (ranges.ts). The store says where the
 * bytes are in the pool (lib/storage/offsets.ts), the geometry where they
 * are in the engine's region (lib/engine/geometry.ts `segmentAddr`); this
 * module pairs them and nothing else does.
 *
 * Hot path: no allocation per block (scratch arrays grow to the largest
 * batch and are reused), no FFI per block (the writer fills a descriptor the
 * native layer reads in one submit).
 *
 * @module
 */

import { type Geometry, segmentAddr } from "../engine/geometry.ts";
import type { BatchWriter, BatchWriterOptions, RegionPort, ShmPort } from "../engine/ports.ts";
import { offsetColumn, offsetIndex } from "../storage/offsets.ts";
import type { LoadTicket, SavePlan } from "../storage/store.ts";
import { RangeMerger } from "./ranges.ts";

/** The merger's sink between batches: a segment written there is a planner bug. */
const NO_BATCH = {
  seg(): void {
    throw new Error("transfer plan: segment written outside a batch");
  },
};

/** One layer of a rank as a copy sees it. */
export interface LayerTarget {
  readonly region: RegionPort;
  /** The namespace's layer id (slot order; the group's id in completions). */
  readonly layerId: number;
  readonly geometry: Geometry;
}

/** One store plan of a Save and the engine side it copies from. */
export interface SavePart {
  readonly plan: SavePlan;
  /** The plan's layers, `layers[li]` for `plan.layers[li]`. */
  readonly layers: readonly LayerTarget[];
  /** The request's block ids, indexed by `plan.hashIndex`. */
  readonly blockIds: readonly number[];
}

/** What a written batch holds. */
export interface BatchShape {
  /** Groups (layers) written. */
  readonly groups: number;
  /** Segments before merging (one per block, layer and segment). */
  readonly segments: number;
}

/**
 * Writes save and load batches. One per batch writer (it keeps scratch
 * between batches).
 *
 * @example
 * ```ts
 * const planner = new TransferPlanner();
 * const shape = planner.writeSave(batch, [{ plan, layers, blockIds }]);
 * if (shape.segments > 0) await native.submit(batch);
 * ```
 */
export class TransferPlanner {
  readonly #merger = new RangeMerger(NO_BATCH);
  /** Load scratch: the next target discontinuity after each block (see {@link writeLoad}). */
  #nextBreak = new Int32Array(0);

  /**
   * Writes ONE gather batch for every part of a Save: per layer a group, per
   * planned block and segment a segment (slots already held are skipped),
   * segment-major (all K, then all V) so consecutive blocks sit next to each
   * other in both the region and the pool and merge.
   */
  writeSave(batch: BatchWriter, parts: readonly SavePart[]): BatchShape {
    let segs = 0;
    let groups = 0;
    for (const { plan } of parts) {
      segs += plan.blockCount * plan.layers.length * plan.segments;
      groups += plan.layers.length;
    }
    if (segs === 0) return { groups: 0, segments: 0 };
    batch.ensure(groups, segs);
    batch.reset("gather");
    const m = this.#merger;
    m.sink = batch;
    let written = 0;
    for (const { plan, layers, blockIds } of parts) {
      const n = plan.blockCount;
      if (n === 0) continue;
      for (let li = 0; li < layers.length; li++) {
        const layer = layers[li];
        const g = layer.geometry;
        let opened = false;
        for (let s = 0; s < plan.segments; s++) {
          const col = offsetIndex(plan, li, 0, s, 0);
          for (let k = 0; k < n; k++) {
            const off = plan.offsets[col + k];
            if (off < 0) continue; // this slot is already held
            if (!opened) {
              m.flush();
              batch.group(layer.region, layer.layerId);
              opened = true;
              written++;
            }
            m.add(segmentAddr(g, blockIds[plan.hashIndex[k]], s), off, g.segBytes);
          }
        }
      }
    }
    m.flush();
    m.sink = NO_BATCH;
    return { groups: written, segments: segs };
  }

  /**
   * Writes ONE scatter batch of a load ticket into the target block ids,
   * one group per layer in `layers` order (the order layers land in the
   * load state), progress published at `progress`.
   *
   * The ticket's runs are blocks one pool stride apart; where the targets
   * are consecutive too (`nextBreak`), a piece of a run is one contiguous
   * copy, so the merger sees ~64 pieces for a prefix saved in one request
   * and loaded into consecutive free blocks, not 40,000 blocks.
   */
  writeLoad(
    batch: BatchWriter,
    ticket: LoadTicket,
    layers: readonly LayerTarget[],
    ids: readonly number[],
    progress: { shm: ShmPort; offset: number },
    opts: BatchWriterOptions = {},
  ): BatchShape {
    let nSegs = 0;
    for (const l of layers) nSegs += ids.length * l.geometry.numSegments;
    batch.ensure(layers.length, nSegs);
    batch.reset("scatter", progress, opts);
    const m = this.#merger;
    m.sink = batch;
    const n = ticket.blockCount;
    const S = ticket.segments;
    const starts = ticket.runStarts;
    const runs = starts.length - 1;
    const runOffsets = ticket.runOffsets;
    const itemStride = ticket.itemStride;
    if (this.#nextBreak.length < n) this.#nextBreak = new Int32Array(n);
    const nextBreak = this.#nextBreak;
    let breaksFor = -1; // blockStride the table was built for
    let breaksLen = -1; // and segBytes
    for (let li = 0; li < layers.length; li++) {
      const l = layers[li];
      const g = l.geometry;
      const len = g.segBytes;
      if (g.blockStride !== breaksFor || len !== breaksLen) {
        targetBreaks(nextBreak, ids, n, g.blockStride, len);
        breaksFor = g.blockStride;
        breaksLen = len;
      }
      // A run's blocks are one pool item apart; they are contiguous only when
      // that is exactly the segment (no padding up to the allocation unit).
      const poolContiguous = itemStride === len;
      m.flush();
      batch.group(l.region, l.layerId);
      for (let s = 0; s < S; s++) {
        // runOffsets is a column-major table over runs (offsets.ts).
        const col = offsetColumn(li, 0, 1, s, S) * runs;
        for (let r = 0; r < runs; r++) {
          const first = starts[r];
          const end = starts[r + 1];
          const pool0 = runOffsets[col + r];
          let k = first;
          while (k < end) {
            const e = poolContiguous ? Math.min(nextBreak[k], end) : k + 1;
            m.add(segmentAddr(g, ids[k], s), pool0 + (k - first) * itemStride, (e - k) * len);
            k = e;
          }
        }
      }
    }
    m.flush();
    m.sink = NO_BATCH;
    return { groups: layers.length, segments: nSegs };
  }
}

/**
 * `next[k]`: the first block after k whose target does not continue its
 * predecessor's in the region (depends on the geometry only).
 */
function targetBreaks(
  next: Int32Array,
  ids: readonly number[],
  n: number,
  blockStride: number,
  segBytes: number,
): void {
  let at = n;
  for (let k = n - 1; k >= 0; k--) {
    next[k] = at;
    if (k > 0 && (ids[k] - ids[k - 1]) * blockStride !== segBytes) at = k;
  }
}
