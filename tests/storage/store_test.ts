// Behaviour of the storage facade, one rule per test.
import {
  deepStrictEqual as assertEquals,
  notStrictEqual,
  ok as assert,
  strictEqual,
  throws,
} from "node:assert/strict";
import {
  InvalidArgumentError,
  LayoutMismatchError,
  LeaseError,
  PoolExhaustedError,
  StaleHandleError,
} from "../../lib/storage/errors.ts";
import { BLOCK_BYTES, h, hs, makeStore, NS, save, SMALL } from "./helpers.ts";
import { KvStore } from "../../lib/storage/store.ts";
import { fnv1a32 } from "../../lib/storage/cache.ts";
import { hashBucket, hashHex } from "../../lib/storage/keys.ts";

Deno.test("an inflight block is invisible; it is served with a lease once its save completes", () => {
  const { store } = makeStore(8);
  const b = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: hs(0, 3) });
  assert(b.ok);
  strictEqual(b.plan.blockCount, 3);
  strictEqual(store.blockState(NS, h(0)), "inflight");
  strictEqual(store.query(NS, hs(0, 3), "e").hits, 0);
  const done = store.completeSave(b.plan, true);
  strictEqual(done.sealed, 3);
  assertEquals(done.sealedKeys, hs(0, 3).map((x) => `${NS}:${x}`));
  const q = store.query(NS, hs(0, 3), "e");
  strictEqual(q.hits, 3);
  strictEqual(q.lease?.idBytes.length, 16);
  store.verify();
});

Deno.test("the plan lays each layer's K and V of consecutive blocks out as one contiguous run", () => {
  const { store } = makeStore(64);
  const { plan } = save(store, hs(0, 10));
  const n = plan.blockCount;
  const runs = new Set<number>();
  for (let li = 0; li < plan.layers.length; li++) {
    for (let seg = 0; seg < plan.segments; seg++) {
      const base = (li * plan.segments + seg) * n;
      runs.add(plan.offsets[base]);
      for (let k = 1; k < n; k++) {
        strictEqual(plan.offsets[base + k] - plan.offsets[base + k - 1], 4096);
      }
    }
  }
  strictEqual(runs.size, 4); // 2 layers × (K, V), each one run
  strictEqual(plan.bytes, 10 * BLOCK_BYTES);
});

Deno.test("a save of blocks already held or in flight copies nothing (dedup before copy)", () => {
  const { store } = makeStore(8);
  save(store, hs(0, 2));
  const again = store.beginSave({ namespace: NS, instance: "e2", rank: 0, hashes: hs(0, 3) });
  assert(again.ok);
  strictEqual(again.plan.blockCount, 1);
  strictEqual(again.plan.deduplicated, 2);
  strictEqual(again.plan.hashIndex[0], 2);
  // The same block again while its copy is still in flight: a no-op too.
  const dup = store.beginSave({ namespace: NS, instance: "e3", rank: 0, hashes: [h(2), h(2)] });
  assert(dup.ok);
  strictEqual(dup.plan.blockCount, 0);
  strictEqual(dup.plan.deduplicated, 2);
  store.completeSave(dup.plan, true);
  store.completeSave(again.plan, true);
  strictEqual(store.query(NS, hs(0, 3), "e").hits, 3);
  store.verify();
});

Deno.test("TP=2: a half-saved block is never served; the second rank's save seals it", () => {
  const { store } = makeStore(8, {}, { ...SMALL, tpSize: 2 });
  save(store, hs(0, 2), { rank: 0 });
  strictEqual(store.blockState(NS, h(0)), "inflight");
  strictEqual(store.query(NS, hs(0, 2), "e", 2).hits, 0);
  // Rank 0 saving again is a no-op: its slots are there.
  strictEqual(save(store, hs(0, 2), { rank: 0 }).plan.blockCount, 0);
  const { done } = save(store, hs(0, 2), { rank: 1 });
  strictEqual(done.sealed, 2);
  const q = store.query(NS, hs(0, 2), "e", 2);
  strictEqual(q.hits, 2);
  // Each rank reads its own slots: different bytes.
  const t0 = store.consumeLease(q.lease!.id, "e", 0);
  const t1 = store.consumeLease(q.lease!.id, "e", 1);
  for (let i = 0; i < t0.offsets.length; i++) notStrictEqual(t0.offsets[i], t1.offsets[i]);
  store.loadDone(t0);
  store.loadDone(t1);
  store.verify();
});

Deno.test("TP=2: a failed copy of rank 1 frees its bytes and leaves the block unsealed", () => {
  const { store } = makeStore(8, {}, { ...SMALL, tpSize: 2 });
  save(store, [h(0)], { rank: 0 });
  const used = store.stats().usedBytes;
  const { done } = save(store, [h(0)], { rank: 1, ok: false });
  strictEqual(done.sealed, 0);
  strictEqual(done.freedBytes, BLOCK_BYTES);
  strictEqual(store.stats().usedBytes, used);
  strictEqual(store.query(NS, [h(0)], "e", 2).hits, 0);
  // A retry of rank 1 can still complete the block.
  strictEqual(save(store, [h(0)], { rank: 1 }).done.sealed, 1);
  store.verify();
});

Deno.test("a failed save of a fresh block drops it and returns every byte", () => {
  const { store } = makeStore(8);
  save(store, hs(0, 4), { ok: false });
  strictEqual(store.blockState(NS, h(0)), "absent");
  strictEqual(store.stats().freeBytes, store.stats().capacityBytes);
  store.verify();
});

Deno.test("a query hits the longest contiguous sealed prefix from the start", () => {
  const { store } = makeStore(8);
  save(store, [h(0), h(1), h(3)]);
  strictEqual(store.query(NS, hs(0, 4), "e").hits, 2);
  strictEqual(store.query(NS, hs(1, 4), "e").hits, 1);
  strictEqual(store.query(NS, [h(9), h(0)], "e").hits, 0);
  strictEqual(store.query("ffffffffffffffff", [h(0)], "e").hits, 0);
  const st = store.stats();
  strictEqual(st.hits, 3);
  strictEqual(st.misses, 4 + 3 + 2 + 1 - 3);
});

Deno.test("a lease keeps its blocks through eviction pressure; unleased LRU blocks go first", () => {
  const { store } = makeStore(4);
  save(store, hs(0, 4));
  const q = store.query(NS, hs(0, 2), "e");
  strictEqual(q.hits, 2);
  save(store, hs(10, 12)); // needs 2 blocks of room: evicts 2 and 3
  for (const x of hs(0, 2)) strictEqual(store.blockState(NS, x), "sealed");
  for (const x of hs(2, 4)) strictEqual(store.blockState(NS, x), "absent");
  strictEqual(store.stats().evictions, 2);
  const t = store.consumeLease(q.lease!.idBytes, "e", 0);
  strictEqual(t.blockCount, 2);
  assertEquals(t.hashes, hs(0, 2));
  store.loadDone(t);
  store.verify();
});

Deno.test("an in-flight load pins its blocks after the lease is used up, until loadDone", () => {
  const { store } = makeStore(2);
  save(store, hs(0, 2));
  const q = store.query(NS, hs(0, 2), "e");
  const t = store.consumeLease(q.lease!.id, "e", 0);
  strictEqual(store.stats().leasesActive, 0); // world size 1: consumed
  const r = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [h(5)] });
  assert(!r.ok);
  strictEqual(store.stats().loadsInflight, 1);
  store.loadDone(t);
  strictEqual(save(store, [h(5)]).done.sealed, 1);
  store.verify();
});

Deno.test("pool exhaustion refuses the save with RESOURCE_EXHAUSTED; releasing a lease recovers", () => {
  const { store } = makeStore(4);
  save(store, hs(0, 4));
  const q = store.query(NS, hs(0, 4), "e");
  const r = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [h(9)] });
  assert(!r.ok);
  assert(r.error instanceof PoolExhaustedError);
  strictEqual(r.error.code, "RESOURCE_EXHAUSTED");
  strictEqual(r.error.neededBytes, BLOCK_BYTES);
  strictEqual(r.error.evictableBytes, 0);
  strictEqual(r.error.fields.instance, "e");
  strictEqual(store.stats().saveRefusals, 1);
  for (const x of hs(0, 4)) strictEqual(store.blockState(NS, x), "sealed"); // nothing harmed
  store.releaseLease(q.lease!.id);
  strictEqual(save(store, [h(9)]).done.sealed, 1);
  strictEqual(store.stats().evictions, 1);
  store.verify();
});

Deno.test("when only part of a save fits, the prefix that fits is planned and the rest counted", () => {
  const { store } = makeStore(4);
  save(store, hs(0, 2));
  store.query(NS, hs(0, 2), "e"); // leased: 2 blocks of room left
  const b = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: hs(10, 14) });
  assert(b.ok);
  strictEqual(b.plan.blockCount, 2);
  strictEqual(b.plan.refusedForRoom, 2);
  assertEquals([...b.plan.hashIndex], [0, 1]);
  store.completeSave(b.plan, true);
  store.verify();
});

Deno.test("an expired lease is refused with FAILED_PRECONDITION and its blocks become evictable", () => {
  const { store, clock } = makeStore(2);
  save(store, hs(0, 2));
  const q = store.query(NS, hs(0, 2), "e");
  strictEqual(store.stats().evictableBytes, 0);
  clock.tick(600_000);
  throws(
    () => store.consumeLease(q.lease!.id, "e", 0),
    (e: unknown) =>
      e instanceof LeaseError && e.code === "FAILED_PRECONDITION" &&
      e.reason === "unknown-or-expired",
  );
  strictEqual(store.stats().leasesExpired, 1);
  strictEqual(store.stats().evictableBytes, 2 * BLOCK_BYTES);
  throws(() => store.releaseLease(q.lease!.id), LeaseError);
  store.verify();
});

Deno.test("a lease allows one consume per rank of the world size, bound to its instance", () => {
  const { store } = makeStore(4, {}, { ...SMALL, tpSize: 2 });
  save(store, [h(0)], { rank: 0 });
  save(store, [h(0)], { rank: 1 });
  const q = store.query(NS, [h(0)], "e", 4); // TP 2 × PP 2
  throws(() => store.consumeLease(q.lease!.id, "other", 0), LeaseError);
  const ts = [0, 1, 2, 3].map((r) => store.consumeLease(q.lease!.id, "e", r, { layers: [r >> 1] }));
  throws(() => store.consumeLease(q.lease!.id, "e", 0), LeaseError);
  assertEquals(ts.map((t) => [...t.layers]), [[0], [0], [1], [1]]);
  for (const t of ts) store.loadDone(t);
  throws(() => store.loadDone(ts[0]), StaleHandleError);
  store.verify();
});

Deno.test("a bad layer list in consumeLease is refused without spending the rank's consume", () => {
  const { store } = makeStore(4);
  save(store, [h(0)]);
  const q = store.query(NS, [h(0)], "e");
  throws(
    () => store.consumeLease(q.lease!.id, "e", 0, { layers: [7] }),
    (e: unknown) => e instanceof InvalidArgumentError && e.fields.layer === 7,
  );
  const t = store.consumeLease(q.lease!.id, "e", 0);
  store.loadDone(t);
  store.verify();
});

Deno.test("consumeLease with a count reads that prefix; the lease pins the rest until every rank consumed", () => {
  const { store } = makeStore(8, {}, { ...SMALL, tpSize: 2 });
  save(store, hs(0, 4), { rank: 0 });
  save(store, hs(0, 4), { rank: 1 });
  const q = store.query(NS, hs(0, 4), "e", 2);
  strictEqual(q.hits, 4);
  // More than the lease holds: refused, and the rank's consume is not spent.
  throws(
    () => store.consumeLease(q.lease!.id, "e", 0, { count: 5 }),
    (e: unknown) =>
      e instanceof InvalidArgumentError && e.fields.expected === 4 && e.fields.got === 5,
  );
  const t0 = store.consumeLease(q.lease!.id, "e", 0, { count: 3 });
  strictEqual(t0.blockCount, 3);
  assertEquals(t0.hashes, hs(0, 3));
  store.loadDone(t0);
  strictEqual(store.stats().pinnedBlocks, 4, "the lease still pins every block");
  const t1 = store.consumeLease(q.lease!.id, "e", 1, { count: 0 });
  strictEqual(t1.blockCount, 0);
  strictEqual(store.stats().pinnedBlocks, 0, "the last consume dropped the lease's pins");
  store.loadDone(t1);
  strictEqual(store.stats().pinnedBlocks, 0);
  store.verify();
});

Deno.test("stale inflight blocks are collected after the TTL, but never under an in-flight copy", () => {
  const { store, clock } = makeStore(8, {}, { ...SMALL, tpSize: 2 });
  save(store, [h(0)], { rank: 0 }); // half a block, never completed by rank 1
  const pending = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [h(1)] });
  assert(pending.ok);
  clock.tick(5 * 60_000 - 1);
  strictEqual(store.collect().staleFreed, 0);
  clock.tick(1);
  strictEqual(store.collect().staleFreed, 1);
  strictEqual(store.blockState(NS, h(0)), "absent");
  strictEqual(store.blockState(NS, h(1)), "inflight"); // its copy is still running
  store.completeSave(pending.plan, true);
  strictEqual(store.collect().staleFreed, 1);
  strictEqual(store.stats().freeBytes, store.stats().capacityBytes);
  strictEqual(store.stats().staleCollected, 2);
  store.verify();
});

Deno.test("dropping an instance releases its leases and frees the partial blocks it wrote", () => {
  const { store } = makeStore(8, {}, { ...SMALL, tpSize: 2 });
  save(store, hs(0, 2), { rank: 0, instance: "a" });
  save(store, hs(0, 2), { rank: 1, instance: "a" });
  save(store, [h(5)], { rank: 0, instance: "a" }); // half-saved
  save(store, [h(6)], { rank: 0, instance: "b" }); // another engine's, kept
  store.query(NS, hs(0, 2), "a", 2);
  const other = store.query(NS, hs(0, 2), "b", 2);
  assertEquals(store.dropInstance("a"), { leases: 1, inflightFreed: 1 });
  strictEqual(store.blockState(NS, h(5)), "absent");
  strictEqual(store.blockState(NS, h(6)), "inflight");
  strictEqual(store.stats().leasesActive, 1);
  store.releaseLease(other.lease!.id);
  store.verify();
});

Deno.test("MLA collapses TP: one rank's save seals, every rank loads the same bytes", () => {
  const { store } = makeStore(4, {}, {
    layers: 2,
    tpSize: 4,
    collapseTp: true,
    segments: 1,
    segmentBytes: 8192,
  });
  strictEqual(save(store, hs(0, 2), { rank: 3 }).done.sealed, 2);
  strictEqual(save(store, hs(0, 2), { rank: 1 }).plan.blockCount, 0);
  const q = store.query(NS, hs(0, 2), "e", 4);
  const t0 = store.consumeLease(q.lease!.id, "e", 0);
  const t2 = store.consumeLease(q.lease!.id, "e", 2);
  assertEquals([...t0.offsets], [...t2.offsets]);
  store.loadDone(t0);
  store.loadDone(t2);
  store.verify();
});

Deno.test("a second layout under one namespace is refused; the same layout again is fine", () => {
  const { store } = makeStore(4);
  store.defineNamespace(NS, { ...SMALL });
  throws(
    () => store.defineNamespace(NS, { ...SMALL, segmentBytes: 8192 }),
    (e: unknown) =>
      e instanceof LayoutMismatchError && e.code === "FAILED_PRECONDITION" &&
      e.fields.expected === "4096" && e.fields.got === "8192",
  );
});

Deno.test("bad save input is refused with INVALID_ARGUMENT naming what was wrong; nothing stored", () => {
  const { store } = makeStore(4);
  const bad = (f: () => unknown, field: string, value: unknown) =>
    throws(f, (e: unknown) =>
      e instanceof InvalidArgumentError && e.code === "INVALID_ARGUMENT" &&
      (e.fields as Record<string, unknown>)[field] === value);
  bad(() => store.beginSave({ namespace: NS, instance: "e", rank: 1, hashes: [h(0)] }), "rank", 1);
  bad(
    () => store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [h(0)], layers: [2] }),
    "layer",
    2,
  );
  bad(
    () =>
      store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [h(0)], layers: [1, 1] }),
    "layer",
    1,
  );
  bad(
    () => store.beginSave({ namespace: "nope", instance: "e", rank: 0, hashes: [h(0)] }),
    "namespace",
    "nope",
  );
  bad(
    () => store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [new Uint8Array(0)] }),
    "got",
    0,
  );
  bad(() => store.query(NS, [h(0)], "e", 0), "got", 0);
  bad(() => store.query(NS, [h(0)], ""), "instance", "");
  bad(() => store.query(NS, Array(65_537).fill(h(0)), "e"), "got", 65_537);
  bad(() => store.defineNamespace("x", { ...SMALL, layers: 0 }), "got", "0");
  strictEqual(store.stats().usedBytes, 0);
  strictEqual(store.stats().inflightBlocks, 0);
  store.verify();
});

Deno.test("a save plan completes once; a second completion is refused", () => {
  const { store } = makeStore(4);
  const { plan } = save(store, [h(0)]);
  throws(() => store.completeSave(plan, false), StaleHandleError);
  strictEqual(store.blockState(NS, h(0)), "sealed");
  store.verify();
});

Deno.test("TinyLFU: a one-off scan does not flush blocks that are asked for often", () => {
  const { store } = makeStore(4, { lfuCapacityBlocks: 64 });
  save(store, hs(0, 4));
  for (let i = 0; i < 3; i++) {
    const q = store.query(NS, hs(0, 4), "e");
    store.releaseLease(q.lease!.id);
  }
  const scan = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: hs(100, 104) });
  assert(scan.ok);
  strictEqual(scan.plan.blockCount, 0);
  strictEqual(scan.plan.admissionRejected, 4);
  strictEqual(store.stats().admissionRejections, 4);
  strictEqual(store.query(NS, hs(0, 4), "e").hits, 4);
  store.verify();
});

Deno.test("TinyLFU: a block missed often enough is admitted and evicts the coldest", () => {
  const { store } = makeStore(2, { lfuCapacityBlocks: 64 });
  save(store, [h(0)]);
  save(store, [h(1)]);
  // h(7) is asked for 5 times (misses) before its save: more popular than h(0).
  for (let i = 0; i < 5; i++) strictEqual(store.query(NS, [h(7)], "e").hits, 0);
  const b = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [h(7)] });
  assert(b.ok);
  strictEqual(b.plan.blockCount, 1);
  store.completeSave(b.plan, true);
  strictEqual(store.blockState(NS, h(0)), "absent");
  strictEqual(store.blockState(NS, h(7)), "sealed");
  store.verify();
});

Deno.test("a transfer lock pins any sealed subset until released", () => {
  const { store } = makeStore(3);
  save(store, [h(0), h(2)]);
  const lock = store.lockForTransfer(NS, hs(0, 3), "peer-1")!;
  assertEquals([...lock.found], [0, 2]);
  strictEqual(lock.offsets.length, 2 * 2 * 2); // 2 blocks × 2 layers × 2 segments
  strictEqual(store.evictAll(), 0);
  store.releaseTransferLock(lock.id);
  strictEqual(store.evictAll(), 2);
  strictEqual(store.lockForTransfer(NS, hs(0, 3), "peer-1"), null);
  store.verify();
});

Deno.test("after every plan, lease and load ends, evictAll returns the pool to empty", () => {
  const { store } = makeStore(16, {}, { ...SMALL, tpSize: 2 });
  save(store, hs(0, 6), { rank: 0 });
  save(store, hs(0, 4), { rank: 1 });
  const q = store.query(NS, hs(0, 6), "e", 2);
  strictEqual(q.hits, 4);
  const t = store.consumeLease(q.lease!.id, "e", 0);
  store.loadDone(t);
  store.releaseLease(q.lease!.id);
  store.dropInstance("eng");
  strictEqual(store.evictAll(), 4);
  const st = store.stats();
  strictEqual(st.freeBytes, st.capacityBytes);
  assertEquals([st.sealedBlocks, st.inflightBlocks, st.pinnedBlocks, st.evictableBytes], [
    0,
    0,
    0,
    0,
  ]);
  store.verify();
});

Deno.test("a whole-block fill (SSD or peer) covers every layer and rank slot and seals at once", () => {
  const { store } = makeStore(4, {}, { ...SMALL, tpSize: 2 });
  save(store, [h(1)], { rank: 0 }); // rank 0's half of h(1) is already here
  const f = store.beginFill({
    namespace: NS,
    instance: "ssd",
    hashes: [h(0), h(1)],
    cacheClass: "reclaimable",
  });
  assert(f.ok);
  assertEquals([...f.plan.rankSlots], [0, 1]);
  strictEqual(f.plan.rankSlot, -1);
  strictEqual(f.plan.blockCount, 2);
  const n = 2;
  const at = (li: number, ri: number, seg: number, b: number) =>
    f.plan.offsets[((li * 2 + ri) * 2 + seg) * n + b];
  // h(0) needs every slot; h(1) only rank 1's.
  for (let li = 0; li < 2; li++) {
    for (let seg = 0; seg < 2; seg++) {
      assert(at(li, 0, seg, 0) >= 0 && at(li, 1, seg, 0) >= 0);
      strictEqual(at(li, 0, seg, 1), -1);
      assert(at(li, 1, seg, 1) >= 0);
    }
  }
  strictEqual(f.plan.bytes, (4 + 2) * 2 * 4096);
  strictEqual(store.completeSave(f.plan, true).sealed, 2);
  strictEqual(store.query(NS, [h(0), h(1)], "e", 2).hits, 2);
  store.verify();
});

Deno.test("blocks fetched from a peer (reclaimable) are evicted before blocks saved here", () => {
  const { store } = makeStore(2);
  save(store, [h(0)]);
  const f = store.beginFill({
    namespace: NS,
    instance: "peer",
    hashes: [h(1)],
    cacheClass: "reclaimable",
  });
  assert(f.ok);
  store.completeSave(f.plan, true);
  save(store, [h(2)]); // one block must go: the peer's, though h(0) is older
  strictEqual(store.blockState(NS, h(1)), "absent");
  strictEqual(store.blockState(NS, h(0)), "sealed");
  store.verify();
});

Deno.test("onEvict reports each evicted block; completion reports the sealed hashes", () => {
  const evicted: string[] = [];
  const { store } = makeStore(2, { onEvict: (ns, hash) => evicted.push(`${ns}:${hash}`) });
  assertEquals(save(store, hs(0, 2)).done.sealedHashes, hs(0, 2));
  save(store, [h(5)]);
  assertEquals(evicted, [`${NS}:${h(0)}`]);
});

Deno.test("evicting blocks side by side across a NUMA part boundary frees each part's bytes to that part", () => {
  // One 4 KiB item per block, a pool of two 2-unit parts: the saves fill part 0
  // up to its end and part 1 from its start, so the victims' items are neighbours.
  const one = { layers: 1, tpSize: 1, collapseTp: false, segments: 1, segmentBytes: 4096 };
  const { store } = makeStore(4, { parts: [2 * 4096, 2 * 4096] }, one);
  for (const [part, hashes] of [[0, hs(0, 2)], [1, hs(2, 4)]] as const) {
    const b = store.beginSave({ namespace: NS, instance: "eng", rank: 0, hashes, poolPart: part });
    assert(b.ok);
    store.completeSave(b.plan, true);
  }
  assertEquals(store.stats().partUsedBytes, [2 * 4096, 2 * 4096]);
  strictEqual(store.evictAll(), 4);
  store.verify();
  assertEquals(store.allocator.freeExtents(), [[0, 2 * 4096], [2 * 4096, 2 * 4096]]);
  assertEquals(store.stats().partUsedBytes, [0, 0]);
  // Three blocks for part 0: two fit there, the third spills into part 1.
  const b = store.beginSave({
    namespace: NS,
    instance: "eng",
    rank: 0,
    hashes: hs(4, 7),
    poolPart: 0,
  });
  assert(b.ok);
  assertEquals(store.stats().partUsedBytes, [2 * 4096, 4096]);
  store.completeSave(b.plan, false);
});

Deno.test("the same content hash in two namespaces is two different blocks", () => {
  const { store } = makeStore(8);
  const other = "fedcba9876543210";
  store.defineNamespace(other, { ...SMALL, segmentBytes: 8192 });
  save(store, [h(0)]);
  strictEqual(store.blockState(other, h(0)), "absent");
  strictEqual(store.query(other, [h(0)], "e").hits, 0);
  const b = store.beginSave({ namespace: other, instance: "e", rank: 0, hashes: [h(0)] });
  assert(b.ok);
  strictEqual(b.plan.blockCount, 1);
  store.completeSave(b.plan, true);
  strictEqual(store.query(NS, [h(0)], "e").hits, 1);
  strictEqual(store.query(other, [h(0)], "e").hits, 1);
  store.verify();
});

Deno.test("unregistering keeps a partial block that a live instance wrote after it", () => {
  const { store } = makeStore(8, {}, { ...SMALL, tpSize: 2 });
  save(store, [h(0)], { rank: 0, instance: "dead" });
  save(store, [h(0)], { rank: 1, instance: "alive", layers: [0] }); // half of rank 1's layers
  strictEqual(store.dropInstance("dead").inflightFreed, 0);
  strictEqual(save(store, [h(0)], { rank: 1, instance: "alive", layers: [1] }).done.sealed, 1);
  store.verify();
});

Deno.test("a ticket that reuses a settled ticket's buffer holds its own offsets, never stale ones", () => {
  const { store } = makeStore(8);
  const { plan } = save(store, hs(0, 4));
  const big = store.consumeLease(store.query(NS, hs(0, 4), "e").lease!.id, "e", 0);
  const bigOffsets = [...big.offsets];
  assertEquals(bigOffsets, [...plan.offsets]);
  store.loadDone(big); // its buffer goes back to the store
  // Blocks 2 and 3 under a two-rank lease: rank 0 gets the reused (larger)
  // buffer, rank 1 a fresh one; both must read exactly those blocks' slots.
  const lease = store.query(NS, hs(2, 4), "e", 2).lease!.id;
  const t0 = store.consumeLease(lease, "e", 0);
  const t1 = store.consumeLease(lease, "e", 1);
  const cols = SMALL.layers * SMALL.segments;
  const expected = Array.from(
    { length: cols * 2 },
    (_, i) => bigOffsets[Math.floor(i / 2) * 4 + 2 + (i % 2)],
  );
  strictEqual(t0.offsets.length, cols * 2);
  assertEquals([...t0.offsets], expected);
  assertEquals([...t1.offsets], expected);
  store.loadDone(t0);
  store.loadDone(t1);
  store.verify();
});

Deno.test("block records beyond one offset slab keep their own offsets (save, load, evict, reuse)", () => {
  // 600 blocks span three slabs of records; then every block is evicted and the
  // recycled records take 600 new blocks.
  const { store } = makeStore(600);
  for (const from of [0, 600]) {
    const { plan } = save(store, hs(from, from + 600));
    const t = store.consumeLease(store.query(NS, hs(from, from + 600), "e").lease!.id, "e", 0);
    assertEquals([...t.offsets], [...plan.offsets]);
    strictEqual(new Set(t.offsets).size, t.offsets.length); // no two slots share pool bytes
    store.loadDone(t);
    store.verify();
    strictEqual(store.evictAll(), 600);
  }
  store.verify();
});

Deno.test("a lease across several saves gets each block's planned offsets (run links and run heads)", () => {
  const { store } = makeStore(16);
  const first = save(store, hs(0, 2)).plan; // blocks 0, 1
  const second = save(store, hs(0, 5)).plan; // dedups 0, 1; blocks 2, 3, 4 in one run
  strictEqual(second.blockCount, 3);
  strictEqual(store.evictAll(), 5); // the next saves are fresh blocks in the freed space
  const a = save(store, hs(0, 3)).plan; // 0, 1, 2 fresh again, into freed space
  const b = save(store, hs(3, 6)).plan; // 3, 4, 5: another save, another run
  const lease = store.query(NS, hs(0, 6), "e").lease!.id;
  const t = store.consumeLease(lease, "e", 0);
  const cols = SMALL.layers * SMALL.segments;
  for (let c = 0; c < cols; c++) {
    for (let k = 0; k < 6; k++) {
      const want = k < 3 ? a.offsets[c * 3 + k] : b.offsets[c * 3 + k - 3];
      strictEqual(t.offsets[c * 6 + k], want, `column ${c} block ${k}`);
    }
  }
  strictEqual(first.blockCount, 2);
  store.loadDone(t);
  store.verify();
});

Deno.test("new hashes named twice in one request are planned once, even when two share a bucket", () => {
  const { store } = makeStore(8);
  // Two different 4-byte hashes whose buckets collide under this namespace's seed.
  const seed = fnv1a32(NS);
  const seen = new Map<number, Uint8Array>();
  let a: Uint8Array | undefined, b: Uint8Array | undefined;
  // FNV-1a is a bijection on 4-byte inputs; 8-byte ones collide after ~2^16 tries (birthday).
  for (let i = 0; !a; i++) {
    const x = new Uint8Array(new Uint32Array([i, Math.imul(i, 0x9e3779b1)]).buffer);
    const k = hashBucket(x, seed);
    const y = seen.get(k);
    if (y) [a, b] = [y, x];
    else seen.set(k, x);
  }
  const r = store.beginSave({
    namespace: NS,
    instance: "e",
    rank: 0,
    hashes: [a, b!, b!, hashHex(a), Uint8Array.from(b!)],
  });
  assert(r.ok);
  strictEqual(r.plan.blockCount, 2);
  strictEqual(r.plan.deduplicated, 3);
  assertEquals([...r.plan.hashIndex], [0, 1]);
  store.completeSave(r.plan, true);
  strictEqual(store.query(NS, [a, b!], "e").hits, 2);
  store.verify();
});

Deno.test("leases expire by the monotonic clock: a system clock set back does not keep them pinning", async () => {
  const wall = Date.now;
  let back = 0;
  Date.now = () => wall() - back; // the system clock, which NTP (or an operator) may step
  try {
    const store = new KvStore({ capacityBytes: 4 * BLOCK_BYTES, leaseTtlMs: 20 });
    store.defineNamespace(NS, SMALL);
    save(store, hs(0, 2));
    const q = store.query(NS, hs(0, 2), "e");
    assert(q.lease);
    back = 3_600_000; // set back an hour
    await new Promise((r) => setTimeout(r, 60));
    throws(() => store.consumeLease(q.lease!.id, "e", 0), LeaseError);
    strictEqual(store.stats().evictableBytes, 2 * BLOCK_BYTES);
  } finally {
    Date.now = wall;
  }
});

Deno.test("a save of every layer is one run: its columns back to back, and evicting its blocks together frees it in one call", () => {
  const { store } = makeStore(16);
  save(store, hs(100, 104)); // 4 blocks the next save's plan must not touch
  const { plan } = save(store, hs(0, 3));
  const items = plan.layers.length * plan.segments * plan.blockCount;
  strictEqual(plan.offsets.length, items);
  for (let i = 1; i < items; i++) strictEqual(plan.offsets[i] - plan.offsets[i - 1], 4096);
  // The run's column order is the plan's: layer 0's K, layer 0's V, layer 1's K, ...
  strictEqual(plan.offsets[plan.blockCount], plan.offsets[0] + plan.blockCount * 4096);

  // Evict all 7 blocks (the first save's leave first, in LRU order): two calls, one per save.
  const frees: number[] = [];
  const alloc = store.allocator;
  const free = alloc.free.bind(alloc);
  alloc.free = (offset, itemBytes, n = 1) => {
    frees.push(n);
    free(offset, itemBytes, n);
  };
  try {
    const r = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: hs(200, 216) });
    assert(r.ok);
    assertEquals(frees, [4 * 4, 3 * 4], "each save's items freed as one run");
    store.completeSave(r.plan, true);
  } finally {
    alloc.free = free;
  }
  store.verify();
});

Deno.test("a save that finds no hole for all its columns places them column by column, each column still one run", () => {
  const { store } = makeStore(8);
  save(store, hs(0, 8)); // one run: column c's blocks at units c * 8 + k
  // Blocks 0, 1, 4 and 5 out: a 2-unit hole in each column, 16 units free, no hole of 8.
  store.discard({ namespace: NS, instance: "eng", rank: 0, hashes: [h(0), h(1), h(4), h(5)] });
  strictEqual(store.allocator.freeBytes, 16 * 4096);
  strictEqual(store.allocator.largestFreeBytes(), 2 * 4096);
  const { plan } = save(store, hs(50, 52));
  strictEqual(plan.blockCount, 2);
  const starts = new Set<number>();
  for (let c = 0; c < plan.layers.length * plan.segments; c++) {
    starts.add(plan.offsets[c * 2]);
    strictEqual(
      plan.offsets[c * 2 + 1] - plan.offsets[c * 2],
      4096,
      "a column's blocks side by side",
    );
  }
  strictEqual(starts.size, 4);
  store.verify();
});
