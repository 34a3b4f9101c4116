// Eviction under fragmentation: blocks of namespaces with different item
// sizes share the pool, so a hole left between pinned items may be too small
// for another namespace's item. Eviction that cannot open a large enough hole
// must not flush the cache on the way to refusing the save.
import { deepStrictEqual as assertEquals, ok as assert, strictEqual } from "node:assert/strict";
import { KvStore } from "../../lib/storage/store.ts";

const UNIT = 4096;
const SMALL = { layers: 1, tpSize: 1, collapseTp: false, segments: 1, segmentBytes: UNIT };
const LARGE = { layers: 1, tpSize: 1, collapseTp: false, segments: 1, segmentBytes: 2 * UNIT };
const A = Array.from({ length: 8 }, (_, i) => `a${i}`);

/**
 * Units 0..7 hold a0..a7 of SMALL; a0 and a4 failed (their units are free),
 * `pinned` are under a transfer lock, the rest are cached (evictable).
 */
function fragmented(pinned: string[]): { store: KvStore; evicted: string[] } {
  const evicted: string[] = [];
  const store = new KvStore({
    capacityBytes: 8 * UNIT,
    onEvict: (_ns, hash) => void evicted.push(hash),
  });
  store.defineNamespace("small", SMALL);
  store.defineNamespace("large", LARGE);
  const b = store.beginSave({ namespace: "small", instance: "e1", rank: 0, hashes: A });
  assert(b.ok);
  store.completeSave(b.plan, (k) => k !== 0 && k !== 4); // a0 and a4 failed: their units are free
  assert(store.lockForTransfer("small", pinned, "ssd"));
  assertEquals(store.allocator.freeExtents(), [[0, UNIT], [4 * UNIT, UNIT]]);
  return { store, evicted };
}

Deno.test("a save no eviction can place is refused without evicting the cached blocks", () => {
  const { store, evicted } = fragmented(["a1", "a3", "a5", "a7"]);
  // One LARGE item needs two adjacent units; evicting a2 or a6 only opens
  // one-unit holes between pinned blocks, so nothing can ever place it.
  const r = store.beginSave({ namespace: "large", instance: "e2", rank: 0, hashes: ["bb"] });
  assert(!r.ok);
  strictEqual(r.error.code, "RESOURCE_EXHAUSTED");
  assertEquals(evicted, [], "blocks evicted for a save that was refused anyway");
  strictEqual(store.blockState("small", "a2"), "sealed");
  strictEqual(store.blockState("small", "a6"), "sealed");
  strictEqual(store.stats().evictions, 0);
  store.verify();
});

Deno.test("fragmentation eviction still evicts, in LRU order, until a hole the save fits opens", () => {
  const { store, evicted } = fragmented(["a1", "a5", "a7"]);
  // LRU: a2, a3, a6. Evicting a2 leaves one-unit holes; evicting a3 too joins
  // units 2..4, where the LARGE item fits: a6 stays.
  const r = store.beginSave({ namespace: "large", instance: "e2", rank: 0, hashes: ["bb"] });
  assert(r.ok, r.ok ? "" : r.error.message);
  assertEquals(evicted, ["a2", "a3"]);
  strictEqual(r.plan.offsets[0], 2 * UNIT);
  strictEqual(store.blockState("small", "a6"), "sealed");
  store.completeSave(r.plan, true);
  store.verify();
});
