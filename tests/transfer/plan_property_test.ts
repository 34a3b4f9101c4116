// Property: the transfer plan copies exactly the (region address, pool offset)
// pairs the store and the geometry define — every planned block, layer and
// segment once, nothing else — and merges them maximally. Expanding the
// written segments back into segment-sized pieces must give the per-block
// reference set computed from segmentAddr() and the plan's / ticket's offsets.
import { deepStrictEqual, ok } from "node:assert/strict";
import fc from "fast-check";
import { KvStore } from "../../lib/storage/store.ts";
import type { BatchWriter, RegionPort, ShmPort } from "../../lib/engine/ports.ts";
import { type Geometry, segmentAddr } from "../../lib/engine/geometry.ts";
import { type LayerTarget, TransferPlanner } from "../../lib/transfer/plan.ts";

type Seg = [number, number, number];

class RecordingWriter implements BatchWriter {
  groups: { layer: number; segs: Seg[] }[] = [];
  ensure(): void {}
  reset(): void {
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

const NUM_BLOCKS = 48;
const region: RegionPort = { handle: 1, device: 0, close() {} };

/** Each written segment cut back into `unit`-byte pieces, per layer, sorted. */
function pieces(w: RecordingWriter, unit: number): Map<number, string[]> {
  const out = new Map<number, string[]>();
  for (const g of w.groups) {
    const list = out.get(g.layer) ?? [];
    for (const [r, p, n] of g.segs) {
      ok(n % unit === 0, `segment of ${n} bytes is not whole ${unit}-byte pieces`);
      for (let o = 0; o < n; o += unit) list.push(`${r + o}:${p + o}`);
    }
    out.set(g.layer, list.sort());
  }
  return out;
}

/** No segment continues its predecessor on both sides: the merge is maximal. */
function maximal(w: RecordingWriter): void {
  for (const g of w.groups) {
    for (let i = 1; i < g.segs.length; i++) {
      const [r0, p0, n0] = g.segs[i - 1];
      const [r1, p1] = g.segs[i];
      ok(
        !(r0 + n0 === r1 && p0 + n0 === p1),
        `segments ${i - 1} and ${i} of layer ${g.layer} were not merged`,
      );
    }
  }
}

const arb = fc.record({
  layers: fc.integer({ min: 1, max: 3 }),
  segments: fc.integer({ min: 1, max: 2 }),
  segBytes: fc.constantFrom(512, 4096, 6144),
  planes: fc.boolean(),
  held: fc.integer({ min: 0, max: 6 }),
  n: fc.integer({ min: 1, max: 20 }),
  src: fc.uniqueArray(fc.integer({ min: 0, max: NUM_BLOCKS - 1 }), {
    minLength: 20,
    maxLength: 20,
  }),
  dst: fc.uniqueArray(fc.integer({ min: 0, max: NUM_BLOCKS - 1 }), {
    minLength: 20,
    maxLength: 20,
  }),
  sortDst: fc.boolean(),
});

Deno.test("property: save and load batches copy exactly the reference pairs, maximally merged", () => {
  fc.assert(
    fc.property(arb, (c) => {
      const S = c.segments;
      const g: Geometry = c.planes
        ? {
          numBlocks: NUM_BLOCKS,
          blockStride: c.segBytes,
          segStride: NUM_BLOCKS * c.segBytes,
          segBytes: c.segBytes,
          numSegments: S,
          baseOffset: 4096,
          regionBytes: 4096 + S * NUM_BLOCKS * c.segBytes,
        }
        : {
          numBlocks: NUM_BLOCKS,
          blockStride: S * c.segBytes,
          segStride: c.segBytes,
          segBytes: c.segBytes,
          numSegments: S,
          baseOffset: 0,
          regionBytes: S * NUM_BLOCKS * c.segBytes,
        };
      const layers: LayerTarget[] = Array.from({ length: c.layers }, (_, layerId) => ({
        region,
        layerId,
        geometry: g,
      }));
      const store = new KvStore({ capacityBytes: 64 * c.layers * S * 8192 });
      store.defineNamespace("ns", {
        layers: c.layers,
        tpSize: 1,
        collapseTp: false,
        segments: S,
        segmentBytes: c.segBytes,
      });
      const hashes = Array.from({ length: c.n }, (_, i) => (i + 1).toString(16).padStart(16, "0"));
      // Some blocks already held (saved apart): dedup holes and broken runs.
      for (let i = 0; i < Math.min(c.held, c.n); i += 2) {
        const r = store.beginSave({ namespace: "ns", instance: "e", rank: 0, hashes: [hashes[i]] });
        if (!r.ok) throw r.error;
        store.completeSave(r.plan, true);
      }
      const ids = c.src.slice(0, c.n);
      const begun = store.beginSave({ namespace: "ns", instance: "e", rank: 0, hashes });
      if (!begun.ok) throw begun.error;
      const p = begun.plan;
      const w = new RecordingWriter();
      new TransferPlanner().writeSave(w, [{ plan: p, layers, blockIds: ids }]);
      const want = new Map<number, string[]>();
      for (let li = 0; li < c.layers; li++) {
        const list: string[] = [];
        for (let s = 0; s < S; s++) {
          for (let k = 0; k < p.blockCount; k++) {
            const off = p.offsets[(li * S + s) * p.blockCount + k];
            if (off >= 0) list.push(`${segmentAddr(g, ids[p.hashIndex[k]], s)}:${off}`);
          }
        }
        if (list.length > 0) want.set(li, list.sort());
      }
      deepStrictEqual(pieces(w, c.segBytes), want);
      maximal(w);
      store.completeSave(p, true);

      const q = store.query("ns", hashes, "e");
      ok(q.hits === c.n && q.lease);
      const dst = c.dst.slice(0, c.n);
      if (c.sortDst) dst.sort((a, b) => a - b);
      const t = store.consumeLease(q.lease.id, "e", 0);
      const lw = new RecordingWriter();
      new TransferPlanner().writeLoad(lw, t, layers, dst, {
        shm: { handle: 1 } as ShmPort,
        offset: 16,
      });
      const wantLoad = new Map<number, string[]>();
      for (let li = 0; li < c.layers; li++) {
        const list: string[] = [];
        for (let s = 0; s < S; s++) {
          for (let k = 0; k < t.blockCount; k++) {
            list.push(`${segmentAddr(g, dst[k], s)}:${t.offsets[(li * S + s) * t.blockCount + k]}`);
          }
        }
        wantLoad.set(li, list.sort());
      }
      deepStrictEqual(pieces(lw, c.segBytes), wantLoad);
      maximal(lw);
      store.loadDone(t);
      store.verify();
    }),
    { numRuns: 300 },
  );
});
