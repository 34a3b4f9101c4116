/**
 * With TP, a layer-wise load can fail on one rank only. That rank drops its
 * saves of the blocks computed over the failed load, but the other ranks
 * computed theirs from its garbage (through the all-reduce) and saved them:
 * the server kept their slots in an inflight block, a later correct save of
 * the prefix filled the failed rank's slot, skipped the others as filled,
 * and sealed the block with the bad slots. Now the failing rank sends those
 * hashes as `discard_hashes`: the store drops the inflight block (a copy
 * still running into it never seals it), evicts a sealed unpinned one, and
 * refuses saves of the hashes for DISCARD_TTL_MS (bounded tombstones).
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import type { SimEngine } from "../../lib/client/sim_engine.ts";
import type { KvEngine } from "../../lib/engine/engine.ts";
import { STATE_OK } from "../../lib/engine/load_state.ts";
import { DISCARD_TTL_MS, type KvStore, MAX_DISCARD_TOMBSTONES } from "../../lib/storage/store.ts";
import { FakeClock, h, hs, makeStore, NS, save } from "../storage/helpers.ts";
import { setup } from "./setup.ts";

/** Two layers, K/V split, TP 2: two rank slots per layer. */
const TP2 = { layers: 2, tpSize: 2, collapseTp: false, segments: 2, segmentBytes: 4096 };

function discard(store: KvStore, hashes: string[], rank = 0) {
  return store.discard({ namespace: NS, instance: "eng", rank, hashes });
}

/** Plans a save of `hashes` by `rank` and completes it; returns the plan. */
function saved(store: KvStore, hashes: string[], rank: number) {
  return save(store, hashes, { rank }).plan;
}

Deno.test("store: rank 0's discard drops rank 1's inflight slot; after the TTL both ranks' new slots seal", () => {
  const { store, clock } = makeStore(16, {}, TP2);
  const old = saved(store, [h(1)], 1);
  assert.equal(old.blockCount, 1);
  assert.equal(store.blockState(NS, h(1)), "inflight");
  const used = store.stats().usedBytes;
  assert.ok(used > 0);
  const r = discard(store, [h(1)]);
  assert.deepEqual(
    [r.dropped, r.copiesCut, r.evicted, r.pinnedKept, r.tombstones],
    [1, 0, 0, 0, 1],
  );
  assert.equal(store.blockState(NS, h(1)), "absent");
  assert.equal(store.stats().usedBytes, 0, "rank 1's slot was freed");
  store.verify();
  // Inside the TTL: a correct save of either rank is refused (rank 1's of the failed step may
  // still be on its way, and rank 0's alone would leave a half block for it to complete).
  for (const rank of [0, 1]) {
    const p = saved(store, [h(1)], rank);
    assert.deepEqual([p.blockCount, p.discarded, p.deduplicated], [0, 1, 0], `rank ${rank}`);
  }
  assert.equal(store.blockState(NS, h(1)), "absent");
  clock.tick(DISCARD_TTL_MS);
  // Past it: both ranks copy their slot anew (neither is skipped as held), and the block seals.
  const p0 = saved(store, [h(1)], 0);
  const p1 = saved(store, [h(1)], 1);
  assert.deepEqual([p0.blockCount, p0.discarded, p1.blockCount, p1.discarded], [1, 0, 1, 0]);
  assert.equal(store.blockState(NS, h(1)), "sealed");
  const s = store.stats();
  assert.deepEqual(
    [s.discardedBlocks, s.discardRefused, s.discardTombstones, s.deduplicated],
    [1, 2, 0, 0],
  );
  store.verify();
});

Deno.test("store: a discard evicts a sealed unpinned block (withdrawn via onEvict) and a pinned one at its unpin", () => {
  const evicted: string[] = [];
  const { store } = makeStore(16, { onEvict: (_ns, hash) => evicted.push(hash) }, TP2);
  for (const rank of [0, 1]) saved(store, hs(1, 3), rank);
  assert.equal(store.blockState(NS, h(1)), "sealed");
  assert.equal(store.blockState(NS, h(2)), "sealed");
  // h(2) is leased (a query's pin): its bytes stay for the lease; h(1) is evicted.
  const q = store.query(NS, [h(2)], "eng", 2);
  assert.equal(q.hits, 1);
  const r = discard(store, hs(1, 3));
  assert.deepEqual([r.dropped, r.evicted, r.pinnedKept], [0, 1, 1]);
  assert.deepEqual(evicted, [h(1)]);
  assert.equal(store.blockState(NS, h(1)), "absent");
  // Not servable any more (tests/storage/discard_review4_test.ts): the lease's end evicts it.
  assert.equal(store.blockState(NS, h(2)), "inflight");
  const s = store.stats();
  assert.deepEqual([s.discardedBlocks, s.discardPinnedKept, s.sealedBlocks], [1, 1, 1]);
  // A held block named again inside the TTL is refused, not counted as held.
  assert.equal(saved(store, [h(2)], 0).discarded, 1);
  store.verify();
  store.releaseLease(q.lease!.id);
  assert.deepEqual(evicted, [h(1), h(2)]);
  assert.equal(store.stats().sealedBlocks, 0);
  store.verify();
});

Deno.test("store: a save inside the TTL is refused and one after it is admitted; tombstones expire", () => {
  const { store, clock } = makeStore(16, {}, TP2);
  discard(store, [h(5)]);
  clock.tick(DISCARD_TTL_MS - 1);
  assert.equal(saved(store, [h(5)], 0).discarded, 1, "refused 1 ms before the TTL");
  const fill = store.beginFill({ namespace: NS, instance: "ssd", hashes: [h(5)] });
  assert.ok(fill.ok);
  assert.deepEqual([fill.plan.blockCount, fill.plan.discarded], [0, 1], "a fill is refused too");
  store.completeSave(fill.plan, true);
  clock.tick(1);
  const p = saved(store, [h(5), h(6)], 0);
  assert.deepEqual([p.blockCount, p.discarded], [2, 0]);
  assert.equal(store.stats().discardTombstones, 0, "swept at its expiry");
  store.verify();
});

Deno.test("store: the tombstones stay bounded; past the bound the oldest go first", () => {
  const { store } = makeStore(4, {}, TP2);
  const many = hs(0, MAX_DISCARD_TOMBSTONES);
  assert.equal(discard(store, many).tombstones, MAX_DISCARD_TOMBSTONES);
  assert.equal(discard(store, many.slice(0, 3)).tombstones, MAX_DISCARD_TOMBSTONES, "refreshed");
  const more = hs(MAX_DISCARD_TOMBSTONES, MAX_DISCARD_TOMBSTONES + 10);
  assert.equal(discard(store, more).tombstones, MAX_DISCARD_TOMBSTONES);
  assert.equal(store.stats().discardTombstones, MAX_DISCARD_TOMBSTONES);
  // The oldest not refreshed (3..12) went; the refreshed 0..2 and the newest stay.
  assert.equal(saved(store, [h(3)], 0).discarded, 0);
  assert.equal(saved(store, [h(12)], 0).discarded, 0);
  assert.equal(saved(store, [h(13)], 0).discarded, 1);
  assert.equal(saved(store, [h(0)], 0).discarded, 1);
  assert.equal(saved(store, [h(MAX_DISCARD_TOMBSTONES + 9)], 0).discarded, 1);
  store.verify();
});

Deno.test("store: a discard racing a copy into the inflight block never lets it seal", () => {
  const { store, clock } = makeStore(16, {}, TP2);
  saved(store, [h(7)], 0); // rank 0's slot filled (an earlier, correct save)
  const b = store.beginSave({ namespace: NS, instance: "eng", rank: 1, hashes: [h(7)] });
  assert.ok(b.ok);
  assert.equal(b.plan.blockCount, 1); // rank 1's copy is running
  const r = discard(store, [h(7)]);
  assert.deepEqual([r.dropped, r.copiesCut], [1, 1]);
  store.verify();
  // Past the TTL but with the copy still running: nothing plans into the doomed block.
  clock.tick(DISCARD_TTL_MS + 1);
  assert.equal(saved(store, [h(7)], 0).discarded, 1);
  const done = store.completeSave(b.plan, true);
  assert.equal(done.sealed, 0, "the copy completed into a discarded block: not sealed");
  assert.ok(done.freedBytes > 0);
  assert.equal(store.blockState(NS, h(7)), "absent");
  const s = store.stats();
  assert.deepEqual([s.usedBytes, s.inflightBlocks, s.sealedBlocks], [0, 0, 0]);
  store.verify();
  for (const rank of [0, 1]) assert.equal(saved(store, [h(7)], rank).blockCount, 1);
  assert.equal(store.blockState(NS, h(7)), "sealed");
  store.verify();
});

Deno.test("store: a malformed discard hash or an unknown namespace changes nothing", () => {
  const { store } = makeStore(16, {}, TP2);
  saved(store, [h(1)], 1);
  assert.throws(() => discard(store, [h(1), ""]), /block hash must be/);
  assert.throws(
    () => store.discard({ namespace: "nope", instance: "eng", rank: 0, hashes: [h(1)] }),
    /namespace nope has no layout/,
  );
  const s = store.stats();
  assert.deepEqual([s.inflightBlocks, s.discardTombstones], [1, 0]);
});

// ---- the engine: bytes, the Save's response, a copy in flight ----

const CLOCK = () => new FakeClock();

async function saveRank(
  engine: KvEngine,
  sim: SimEngine,
  ids: number[],
  hashes: Uint8Array[],
  extra: { discardHashes?: Uint8Array[]; requestId?: string } = {},
) {
  return await engine.save({
    instanceId: sim.instanceId,
    tpRank: sim.tpRank,
    ppRank: 0,
    layers: [],
    blockIds: ids,
    blockHashes: hashes,
    ...extra,
  });
}

/** Loads `hashes` into `ids` on both ranks and checks every byte of both. */
async function loadsRight(
  engine: KvEngine,
  sims: SimEngine[],
  ids: number[],
  hashes: Uint8Array[],
) {
  const q = engine.query(sims[0].instanceId, hashes, "r-check");
  assert.equal(q.hits, hashes.length);
  for (const sim of sims) {
    sim.clear(ids);
    const st = LoadState.create();
    try {
      const l = await engine.load({
        instanceId: sim.instanceId,
        tpRank: sim.tpRank,
        ppRank: 0,
        leaseId: q.leaseId!,
        blockIds: ids,
        loadStateShm: st.name,
      });
      await l.done;
      assert.equal(st.snapshot().state, STATE_OK);
    } finally {
      st.close();
    }
    assert.deepEqual(
      sim.verify(ids, hashes),
      { badSegments: 0, first: undefined },
      `rank ${sim.tpRank}`,
    );
  }
}

Deno.test("engine: rank 1's slot computed over rank 0's failed load is never served; the prefix seals right after the TTL", async () => {
  const clock = CLOCK();
  const { engine, store, sims, teardown } = await setup(["disc-a"], 16, {
    clock: clock.read,
    tpSize: 2,
  });
  try {
    const [r0, r1] = sims;
    const ids = [0, 1, 2, 3];
    const hashes = chainedBlockHashes(syntheticTokens(61, 16 * 4), 16);
    const garbage = chainedBlockHashes(syntheticTokens(62, 16 * 4), 16);
    r1.fill(ids, garbage); // rank 1 computed from rank 0's garbage KV
    assert.equal((await saveRank(engine, r1, ids, hashes)).blocksSaved, 4);
    // Rank 0 dropped its save (its load failed) and discards the hashes: a Save of no block.
    const d = await saveRank(engine, r0, [], [], { discardHashes: hashes, requestId: "b" });
    assert.deepEqual([d.blocksSaved, d.blocksDiscarded], [0, 4]);
    assert.equal(store.stats().inflightBlocks, 0);
    // The same prompt computed right on both ranks, inside the TTL: refused, nothing stored.
    r0.fill(ids, hashes);
    r1.fill(ids, hashes);
    for (const sim of sims) {
      const r = await saveRank(engine, sim, ids, hashes);
      assert.deepEqual([r.blocksSaved, r.blocksSkipped, r.blocksRefused], [0, 0, 4]);
    }
    assert.equal(engine.query("disc-a", hashes, "r-miss").hits, 0);
    clock.tick(DISCARD_TTL_MS);
    for (const sim of sims) assert.equal((await saveRank(engine, sim, ids, hashes)).blocksSaved, 4);
    await loadsRight(engine, sims, [8, 9, 10, 11], hashes);
    store.verify();
  } finally {
    await teardown();
  }
});

Deno.test("engine: a discard arriving while another rank's copy runs into the block frees it when the copy ends", async () => {
  const clock = CLOCK();
  const { engine, store, held, sims, teardown } = await setup(["disc-b"], 16, {
    clock: clock.read,
    tpSize: 2,
  });
  let release = () => {};
  try {
    const [r0, r1] = sims;
    const ids = [0, 1, 2, 3];
    const hashes = chainedBlockHashes(syntheticTokens(63, 16 * 4), 16);
    const garbage = chainedBlockHashes(syntheticTokens(64, 16 * 4), 16);
    r0.fill(ids, hashes);
    assert.equal((await saveRank(engine, r0, ids, hashes)).blocksSaved, 4); // a correct slot 0
    r1.fill(ids, garbage);
    const hold = held.holdNext();
    release = hold.release;
    const saving = saveRank(engine, r1, ids, hashes);
    await hold.submitted; // rank 1's copy is running
    const d = await saveRank(engine, r0, [], [], { discardHashes: hashes });
    assert.equal(d.blocksDiscarded, 4);
    hold.release();
    await saving;
    const s = store.stats();
    assert.deepEqual([s.sealedBlocks, s.inflightBlocks, s.usedBytes], [0, 0, 0]);
    store.verify();
    clock.tick(DISCARD_TTL_MS);
    r1.fill(ids, hashes);
    for (const sim of sims) assert.equal((await saveRank(engine, sim, ids, hashes)).blocksSaved, 4);
    await loadsRight(engine, sims, [8, 9, 10, 11], hashes);
  } finally {
    release();
    await teardown();
  }
});

Deno.test("engine: a bad discard hash is INVALID_ARGUMENT naming its index, and nothing is discarded", async () => {
  const { engine, store, sims, teardown } = await setup(["disc-c"], 16, { tpSize: 2 });
  try {
    const [r0, r1] = sims;
    const hashes = chainedBlockHashes(syntheticTokens(65, 16 * 2), 16);
    r1.fill([0, 1], hashes);
    await saveRank(engine, r1, [0, 1], hashes);
    await assert.rejects(
      saveRank(engine, r0, [], [], { discardHashes: [hashes[0], new Uint8Array(0)] }),
      (e: Error & { code?: number }) =>
        e.code === 3 && /tp_rank 0 pp_rank 0.*discard_hashes\[1\] is 0 bytes/.test(e.message),
    );
    const s = store.stats();
    assert.deepEqual([s.inflightBlocks, s.discardTombstones], [2, 0]);
  } finally {
    await teardown();
  }
});
