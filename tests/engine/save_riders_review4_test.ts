/**
 * Review of the Save riders (lib/engine/save.ts): a Save that skipped hashes
 * another Save was copying waits (at most RIDER_WAIT_MS) for the saves
 * running when it planned. That wait must not hold its own instance's
 * cleanup (a Session end, UnregisterContext, a server stop) on another
 * instance's copy, and a rider whose instance is being cleaned up copies
 * nothing more from the engine that is going away.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LATE, within } from "../../lib/timer_limit.ts";
import { setup } from "./setup.ts";

const rank0 = { tpRank: 0, ppRank: 0 };
const tick = (ms = 20) => new Promise((r) => setTimeout(r, ms));

Deno.test("a rider's wait ends when its instance is cleaned up: the cleanup is not held by another instance's copy", async () => {
  const { engine, store, held, sims: [a, b], teardown } = await setup(
    ["rv4-a", "rv4-b"],
    64,
    { namespace: "ns-rv4" },
  );
  let release = () => {};
  try {
    const hashes = chainedBlockHashes(syntheticTokens(71, 16 * 4), 16);
    a.fill([0, 1, 2, 3], hashes);
    b.fill([4, 5, 6, 7], hashes);
    const save = (instanceId: string, ids: number[]) =>
      engine.save({ instanceId, ...rank0, layers: [], blockIds: ids, blockHashes: hashes });
    // A's copy runs and does not end (a stuck copy, a very slow device).
    const hold = held.holdNext();
    release = hold.release;
    const savingA = save("rv4-a", [0, 1, 2, 3]);
    await hold.submitted;
    const savingB = save("rv4-b", [4, 5, 6, 7]);
    await tick();
    // B's engine goes away (its session ended): its cleanup must not wait on A's copy.
    const t0 = performance.now();
    const gone = await within(engine.unregister("rv4-b", "session ended"), 3_000);
    const ms = performance.now() - t0;
    release(); // (before the asserts: a failure must not leave A held through the teardown)
    assert.notEqual(gone, LATE, "B's cleanup waited on A's copy (the rider's RIDER_WAIT_MS)");
    assert.ok(ms < 2_000, `B's cleanup took ${Math.round(ms)} ms`);
    // B answered as before riders: its blocks counted skipped, nothing copied from its engine.
    const rb = await savingB;
    assert.deepEqual([rb.blocksSaved, rb.blocksSkipped, rb.bytesCopied], [0, 4, 0]);
    assert.equal((await savingA).blocksSaved, 4);
    const s = store.stats();
    assert.deepEqual([s.sealedBlocks, s.inflightBlocks, s.inflightCopyBytes], [4, 0, 0]);
    store.verify();
  } finally {
    release();
    await teardown();
  }
});

Deno.test("a rider whose ridden copy a discard cut is refused, each block counted once (no negative count)", async () => {
  const { engine, store, held, sims: [a, b], teardown } = await setup(
    ["rv4-c", "rv4-d"],
    64,
    { namespace: "ns-rv4-2" },
  );
  let release = () => {};
  try {
    const hashes = chainedBlockHashes(syntheticTokens(72, 16 * 4), 16);
    const own = chainedBlockHashes(syntheticTokens(73, 16 * 2), 16);
    a.fill([0, 1, 2, 3], hashes);
    b.fill([4, 5, 6, 7, 8, 9], [...hashes, ...own]);
    const hold = held.holdNext();
    release = hold.release;
    const savingC = engine.save({
      instanceId: "rv4-c",
      ...rank0,
      layers: [],
      blockIds: [0, 1, 2, 3],
      blockHashes: hashes,
    });
    await hold.submitted;
    // D rides on C's copy for the 4 shared hashes and copies its own 2.
    const savingD = engine.save({
      instanceId: "rv4-d",
      ...rank0,
      layers: [],
      blockIds: [4, 5, 6, 7, 8, 9],
      blockHashes: [...hashes, ...own],
    });
    await tick();
    // A rank of C's engine discards the 4 (its load failed): C's copy can no longer seal them.
    const d = await engine.save({
      instanceId: "rv4-c",
      ...rank0,
      layers: [],
      discardHashes: hashes,
    });
    assert.equal(d.blocksDiscarded, 4);
    hold.release();
    assert.equal((await savingC).blocksSaved, 4); // copied, then freed at completion
    const rd = await savingD;
    assert.deepEqual(
      [rd.blocksSaved, rd.blocksSkipped, rd.blocksRefused, rd.blocksNotAdmitted],
      [2, 0, 4, 0],
      "each of D's 6 blocks counted once",
    );
    const s = store.stats();
    assert.deepEqual([s.sealedBlocks, s.inflightBlocks, s.inflightCopyBytes], [2, 0, 0]);
    assert.equal(
      s.deduplicated,
      0,
      "refused in the second round, the riders no longer count as deduplicated",
    );
    assert.equal(engine.query("rv4-d", hashes, "r-q").hits, 0);
    store.verify();
  } finally {
    release();
    await teardown();
  }
});
