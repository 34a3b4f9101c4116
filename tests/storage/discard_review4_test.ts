/**
 * Review of the discards (lib/storage/discard.ts). A sealed block a discard
 * names while something pins it (a query's lease, a load, the SSD
 * write-behind's or a peer's transfer lock) cannot be freed under that
 * reader; it was left sealed, and stayed an ordinary cached block once the
 * pin ended: served to every later query (the garbage the discard was for,
 * e.g. MLA's one shared slot computed over another rank's failed load),
 * locked for peers, and dedup'd against by correct saves after the TTL.
 * Now it is doomed: no new query, lock or save finds it, and the last unpin
 * evicts it (withdrawn through onEvict), with the pool accounting exact.
 */
import assert from "node:assert/strict";
import { Tombstones } from "../../lib/storage/discard.ts";
import { DISCARD_TTL_MS, type KvStore, MAX_DISCARD_TOMBSTONES } from "../../lib/storage/store.ts";
import { h, makeStore, NS, save } from "./helpers.ts";

/** MLA: one K/V slot per layer shared by every TP rank (any rank's save seals the block). */
const MLA = { layers: 2, tpSize: 2, collapseTp: true, segments: 1, segmentBytes: 4096 };

function discard(store: KvStore, hashes: string[], rank = 1) {
  return store.discard({ namespace: NS, instance: "eng", rank, hashes });
}

Deno.test("a sealed block a discard names under a lease is never served again and goes at the lease's end", () => {
  const evicted: string[] = [];
  const { store, clock } = makeStore(16, { onEvict: (_ns, hash) => evicted.push(hash) }, MLA);
  save(store, [h(1), h(2)], { rank: 0 }); // rank 0's garbage seals at once (one shared slot)
  const used = store.stats().usedBytes;
  // Another request's query leases the prefix just before rank 1's discard arrives.
  const q = store.query(NS, [h(1), h(2)], "eng", 2);
  assert.equal(q.hits, 2);
  const r = discard(store, [h(1), h(2)]);
  assert.deepEqual([r.evicted, r.pinnedKept], [0, 2]);
  // Still pinned: its bytes stay (the lease's loads may read them), but nothing new finds it.
  assert.equal(store.stats().usedBytes, used);
  assert.equal(store.query(NS, [h(1)], "eng", 2).hits, 0, "a later query hit the discarded block");
  assert.notEqual(store.blockState(NS, h(1)), "sealed");
  assert.equal(store.lockForTransfer(NS, [h(1), h(2)], "peer"), null, "a peer could lock it");
  store.verify();
  // The lease ends: the blocks go, withdrawn like any eviction, and the pool is empty.
  store.releaseLease(q.lease!.id);
  assert.deepEqual(evicted.sort(), [h(1), h(2)]);
  assert.equal(store.blockState(NS, h(1)), "absent");
  const s = store.stats();
  assert.deepEqual([s.usedBytes, s.sealedBlocks, s.pinnedBlocks, s.evictableBytes], [0, 0, 0, 0]);
  store.verify();
  // Past the TTL a correct save stores the prefix anew (it is not skipped as held).
  clock.tick(DISCARD_TTL_MS);
  const again = save(store, [h(1), h(2)], { rank: 0 }).plan;
  assert.deepEqual([again.blockCount, again.deduplicated], [2, 0]);
  assert.equal(store.query(NS, [h(1), h(2)], "eng", 2).hits, 2);
  store.verify();
});

Deno.test("a sealed block a transfer lock reads when a discard names it goes when the lock is released, not before", () => {
  const evicted: string[] = [];
  const { store } = makeStore(16, { onEvict: (_ns, hash) => evicted.push(hash) }, MLA);
  save(store, [h(3)], { rank: 0 });
  // The SSD write-behind (or a peer) locked it and is reading its bytes.
  const lock = store.lockForTransfer(NS, [h(3)], "ssd");
  assert.ok(lock);
  const r = discard(store, [h(3)]);
  assert.deepEqual([r.evicted, r.pinnedKept], [0, 1]);
  assert.deepEqual(evicted, [], "freed under the reader");
  assert.ok(store.stats().usedBytes > 0);
  // A save of the hash (another rank's of the same step) is refused, not skipped as held.
  const p = save(store, [h(3)], { rank: 1 }).plan;
  assert.deepEqual([p.blockCount, p.deduplicated, p.discarded], [0, 0, 1]);
  store.verify();
  store.releaseTransferLock(lock.id);
  assert.deepEqual(evicted, [h(3)]);
  const s = store.stats();
  assert.deepEqual([s.usedBytes, s.sealedBlocks, s.pinnedBlocks], [0, 0, 0]);
  store.verify();
});

Deno.test("a doomed block held by a lease and a load goes only at the last of them (expiry included)", () => {
  const evicted: string[] = [];
  const { store, clock } = makeStore(
    16,
    { onEvict: (_ns, hash) => evicted.push(hash), leaseTtlMs: 1_000 },
    MLA,
  );
  save(store, [h(4)], { rank: 0 });
  const q = store.query(NS, [h(4)], "eng", 2);
  const ticket = store.consumeLease(q.lease!.id, "eng", 0); // rank 0's load runs
  discard(store, [h(4)]);
  clock.tick(1_000);
  store.collect(); // the lease expires (rank 1 never consumed): the load still pins it
  assert.deepEqual(evicted, []);
  assert.ok(store.stats().usedBytes > 0);
  store.verify();
  store.loadDone(ticket);
  assert.deepEqual(evicted, [h(4)]);
  assert.equal(store.stats().usedBytes, 0);
  store.verify();
});

// ---- the tombstones' bound ----

const NS2 = "fedcba9876543210";

Deno.test("past the tombstone bound a hot namespace recycles its own tombstones, never another's within the TTL", () => {
  const { store, clock } = makeStore(16, {}, MLA);
  store.defineNamespace(NS2, MLA);
  // Engine B's rank discards 2 hashes; its other ranks' saves of that step are still queued.
  store.discard({ namespace: NS2, instance: "b", rank: 1, hashes: [h(1), h(2)] });
  clock.tick(1);
  // Engine A's rank discards a maximal prompt's worth (a 1M-token load that failed), twice.
  const many = Array.from({ length: MAX_DISCARD_TOMBSTONES }, (_, i) => h(0x100000 + i));
  const r = store.discard({ namespace: NS, instance: "a", rank: 1, hashes: many });
  assert.equal(r.tombstones, MAX_DISCARD_TOMBSTONES, "the bound holds");
  store.discard({ namespace: NS, instance: "a", rank: 1, hashes: [h(0x7fffffff)] });
  assert.equal(store.stats().discardTombstones, MAX_DISCARD_TOMBSTONES);
  // B's queued saves of the discarded hashes are still refused.
  const b = store.beginSave({ namespace: NS2, instance: "b", rank: 0, hashes: [h(1), h(2)] });
  assert.ok(b.ok);
  assert.deepEqual([b.plan.blockCount, b.plan.discarded], [0, 2], "B's tombstones were evicted");
  store.completeSave(b.plan, true);
  // A's own oldest went instead (the newest stay).
  const a = store.beginSave({
    namespace: NS,
    instance: "a",
    rank: 0,
    hashes: [many[0], many[many.length - 1], h(0x7fffffff)],
  });
  assert.ok(a.ok);
  assert.deepEqual([a.plan.blockCount, a.plan.discarded], [1, 2]);
  store.completeSave(a.plan, false);
  clock.tick(DISCARD_TTL_MS);
  store.collect();
  assert.equal(store.stats().discardTombstones, 0);
  store.verify();
});

Deno.test("a tombstone added where the bound took its namespace's last one still refuses, and expires cleanly", () => {
  const t = new Tombstones(1_000, 2);
  t.add("x", h(1), 1, 0);
  t.add("y", h(2), 2, 1);
  // At the bound: x's only tombstone may be the one that goes to make room for x's next.
  t.add("x", h(3), 3, 2);
  assert.equal(t.size, 2);
  const x = t.live("x", 3);
  assert.ok(x && Tombstones.holds(x, h(3), 3), "x's new tombstone refuses nothing");
  t.sweep(10_000); // threw a TypeError on the lost namespace entry
  assert.equal(t.size, 0);
  assert.equal(t.live("x", 10_000), undefined);
});

Deno.test("an onEvict that throws at a doomed block's eviction leaves no other block of the lease pinned", () => {
  let calls = 0;
  const onEvict = () => {
    calls++;
    throw new Error("listener bug");
  };
  const { store } = makeStore(16, { onEvict }, MLA);
  save(store, [h(5), h(6)], { rank: 0 });
  const q = store.query(NS, [h(5), h(6)], "eng", 2);
  discard(store, [h(5), h(6)]);
  assert.throws(() => store.releaseLease(q.lease!.id), /listener bug/);
  assert.equal(calls, 2, "the second block was left pinned");
  const s = store.stats();
  assert.deepEqual([s.usedBytes, s.pinnedBlocks, s.sealedBlocks], [0, 0, 0]);
  store.verify();
});

Deno.test("an inflight block with two copies running when a discard cuts it frees each slot once, at each copy's end", () => {
  const TP2 = { layers: 2, tpSize: 2, collapseTp: false, segments: 2, segmentBytes: 4096 };
  const { store } = makeStore(16, {}, TP2);
  const begin = (rank: number, layers?: number[]) => {
    const b = store.beginSave({ namespace: NS, instance: "eng", rank, hashes: [h(9)], layers });
    assert.ok(b.ok);
    return b.plan;
  };
  save(store, [h(9)], { rank: 0, layers: [0] }); // rank 0 layer 0: FILLED
  const p0 = begin(0, [1]); // rank 0 layer 1: PENDING
  const p1 = begin(1); // rank 1 both layers: PENDING
  const r = discard(store, [h(9)]);
  assert.deepEqual([r.dropped, r.copiesCut], [1, 1]);
  store.verify(); // the filled slot was freed at once; the pending ones are their copies'
  const first = store.completeSave(p0, true);
  assert.deepEqual([first.sealed, first.freedBytes > 0], [0, true]);
  assert.equal(store.blockState(NS, h(9)), "inflight", "freed while rank 1's copy still runs");
  store.verify();
  const second = store.completeSave(p1, true);
  assert.equal(second.sealed, 0);
  assert.equal(store.blockState(NS, h(9)), "absent");
  const s = store.stats();
  assert.deepEqual([s.usedBytes, s.inflightBlocks, s.inflightCopyBytes], [0, 0, 0]);
  store.verify();
});

Deno.test("an onEvict that throws when expired leases free doomed blocks leaves no lease's blocks pinned", () => {
  let calls = 0;
  const onEvict = () => {
    calls++;
    throw new Error("listener bug");
  };
  const { store, clock } = makeStore(16, { onEvict, leaseTtlMs: 1_000 }, MLA);
  save(store, [h(7), h(8)], { rank: 0 });
  store.query(NS, [h(7)], "eng", 2);
  store.query(NS, [h(8)], "eng", 2);
  discard(store, [h(7), h(8)]);
  clock.tick(1_000);
  assert.throws(() => store.collect(), /listener bug/);
  assert.equal(calls, 2, "the second expired lease's block was left pinned");
  const s = store.stats();
  assert.deepEqual([s.usedBytes, s.pinnedBlocks, s.leasesActive], [0, 0, 0]);
  store.verify();
});

Deno.test("an onEvict that throws at the last consume (a doomed block past the load's prefix) leaves nothing pinned", () => {
  const onEvict = () => {
    throw new Error("listener bug");
  };
  const { store } = makeStore(16, { onEvict }, MLA);
  save(store, [h(10), h(11)], { rank: 0 });
  const q = store.query(NS, [h(10), h(11)], "eng", 1);
  const one = store.stats().usedBytes / 2;
  discard(store, [h(11)]);
  // The one rank loads only the first block: the lease's end frees the second, doomed.
  // (A load naming the doomed block itself is refused: discard_lease_test.ts.)
  assert.throws(() => store.consumeLease(q.lease!.id, "eng", 0, { count: 1 }), /listener bug/);
  const s = store.stats();
  assert.deepEqual([s.usedBytes, s.pinnedBlocks, s.loadsInflight], [one, 0, 0]);
  store.verify();
});
