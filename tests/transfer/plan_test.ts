// The transfer plan pairs the store's pool offsets with the engine's region
// addresses and merges contiguous copies once. A recording writer stands in
// for the native batch, so each test checks the exact segments submitted.
import { deepStrictEqual, strictEqual } from "node:assert/strict";
import { KvStore } from "../../lib/storage/store.ts";
import type { BatchWriter, RegionPort, ShmPort } from "../../lib/engine/ports.ts";
import type { Geometry } from "../../lib/engine/geometry.ts";
import {
  blockExtents,
  BlockRangesWriter,
  mergeExtents,
  RangeMerger,
} from "../../lib/transfer/ranges.ts";
import { type LayerTarget, TransferPlanner } from "../../lib/transfer/plan.ts";

type Seg = [number, number, number];

class RecordingWriter implements BatchWriter {
  direction = "";
  groups: { layer: number; segs: Seg[] }[] = [];
  ensure(): void {}
  reset(direction: "gather" | "scatter"): void {
    this.direction = direction;
    this.groups = [];
  }
  group(_region: RegionPort, layerId: number): void {
    this.groups.push({ layer: layerId, segs: [] });
  }
  seg(r: number, p: number, n: number): void {
    this.groups[this.groups.length - 1].segs.push([r, p, n]);
  }
  get numSegs(): number {
    return this.groups.reduce((n, g) => n + g.segs.length, 0);
  }
}

const SEG = 4096;
const BLOCKS = 8;
/** K plane then V plane per layer: consecutive block ids are contiguous in the region. */
const planes: Geometry = {
  numBlocks: BLOCKS,
  blockStride: SEG,
  segStride: BLOCKS * SEG,
  segBytes: SEG,
  numSegments: 2,
  baseOffset: 0,
  regionBytes: 2 * BLOCKS * SEG,
};
const region: RegionPort = { handle: 1, device: 0, close() {} };
const layers: LayerTarget[] = [0, 1].map((layerId) => ({ region, layerId, geometry: planes }));
const hashes = (from: number, n: number) =>
  Array.from({ length: n }, (_, i) => (from + i).toString(16).padStart(16, "0"));

function storeWithTwoLayers(): KvStore {
  const store = new KvStore({ capacityBytes: 64 * 2 * 2 * SEG });
  store.defineNamespace("ns", {
    layers: 2,
    tpSize: 1,
    collapseTp: false,
    segments: 2,
    segmentBytes: SEG,
  });
  return store;
}

Deno.test("the range merger joins a segment only when both sides continue the previous one", () => {
  const out: Seg[] = [];
  const m = new RangeMerger({ seg: (r, p, n) => void out.push([r, p, n]) });
  m.add(0, 100, 10);
  m.add(10, 110, 10); // continues both: joins
  m.add(20, 200, 10); // pool jumps: new
  m.add(40, 210, 10); // region jumps: new
  m.flush();
  m.flush(); // nothing pending: no empty segment
  deepStrictEqual(out, [[0, 100, 20], [20, 200, 10], [40, 210, 10]]);
  deepStrictEqual(mergeExtents([0, 4096, 65536, 69632], 4096), [
    { offset: 0, bytes: 8192 },
    { offset: 65536, bytes: 8192 },
  ]);
});

Deno.test("flat block ranges merge each block's adjacent items, never across blocks, and read back per block", () => {
  // A column-major table of 3 blocks × 2 items: block k's items at offsets[k], offsets[3 + k].
  const offsets = [0, 8192, 100_000, 4096, 12288, 200_000];
  const w = new BlockRangesWriter(4, 6);
  w.addBlock(offsets, 0, 3, 2, 4096); // 0 then 4096: one range
  w.addEmpty();
  w.addBlock(offsets, 1, 3, 2, 4096); // 8192 then 12288: one range (touches block 0's end, not merged)
  w.addBlock(offsets, 2, 3, 2, 4096); // 100000 then 200000: two ranges
  const r = w.finish();
  deepStrictEqual([...r.starts], [0, 1, 1, 2, 4]);
  deepStrictEqual([...r.ranges], [0, 8192, 8192, 8192, 100_000, 4096, 200_000, 4096]);
  deepStrictEqual(blockExtents(r, 0), [{ offset: 0, bytes: 8192 }]);
  deepStrictEqual(blockExtents(r, 1), []);
  deepStrictEqual(blockExtents(r, 3), [
    { offset: 100_000, bytes: 4096 },
    { offset: 200_000, bytes: 4096 },
  ]);
});

Deno.test("a save of consecutive blocks becomes one merged segment per layer and K/V plane", () => {
  const store = storeWithTwoLayers();
  const begun = store.beginSave({ namespace: "ns", instance: "e", rank: 0, hashes: hashes(0, 4) });
  if (!begun.ok) throw begun.error;
  const w = new RecordingWriter();
  const shape = new TransferPlanner().writeSave(w, [
    { plan: begun.plan, layers, blockIds: [2, 3, 4, 5] },
  ]);
  strictEqual(shape.segments, 4 * 2 * 2);
  strictEqual(w.direction, "gather");
  deepStrictEqual(w.groups.map((g) => g.layer), [0, 1]);
  const p = begun.plan;
  for (let li = 0; li < 2; li++) {
    deepStrictEqual(
      w.groups[li].segs,
      [0, 1].map((s) => {
        const first = p.offsets[(li * 2 + s) * 4];
        return [s * BLOCKS * SEG + 2 * SEG, first, 4 * SEG] as Seg;
      }),
    );
  }
  store.completeSave(p, true);
  store.verify();
});

Deno.test("a load into scattered targets is split exactly where the target ids break", () => {
  const store = storeWithTwoLayers();
  const begun = store.beginSave({ namespace: "ns", instance: "e", rank: 0, hashes: hashes(0, 4) });
  if (!begun.ok) throw begun.error;
  store.completeSave(begun.plan, true);
  const q = store.query("ns", hashes(0, 4), "e");
  const t = store.consumeLease(q.lease!.id, "e", 0);
  const w = new RecordingWriter();
  const shm = { handle: 9 } as ShmPort;
  new TransferPlanner().writeLoad(w, t, layers, [0, 1, 5, 6], { shm, offset: 64 });
  strictEqual(w.direction, "scatter");
  for (let li = 0; li < 2; li++) {
    const want: Seg[] = [];
    for (let s = 0; s < 2; s++) {
      const pool = t.offsets[(li * 2 + s) * 4];
      want.push([s * BLOCKS * SEG + 0, pool, 2 * SEG]);
      want.push([s * BLOCKS * SEG + 5 * SEG, t.offsets[(li * 2 + s) * 4 + 2], 2 * SEG]);
    }
    deepStrictEqual(w.groups[li].segs, want);
  }
  store.loadDone(t);
  store.verify();
});
