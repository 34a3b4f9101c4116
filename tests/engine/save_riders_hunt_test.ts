/**
 * A Save of hashes another save is still copying (another instance of the
 * namespace, or another rank of an MLA instance, at the same moment) skips
 * them before any copy: they "ride" on that copy. That copy can still fail,
 * and its slots are then freed. Before, the rider answered at once, counting
 * them held (`blocks_skipped`): nothing of them was stored, and since an
 * engine saves a block once, nothing ever would be (its prefix missed until
 * recomputed). Now a Save with riders answers once the copy it rode on
 * settled, copying from its own blocks what did not land.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { STATE_OK } from "../../lib/engine/load_state.ts";
import { setup } from "./setup.ts";

const rank0 = { tpRank: 0, ppRank: 0 };
const tick = (ms = 20) => new Promise((r) => setTimeout(r, ms));

Deno.test("a Save riding on another instance's copy that fails copies the blocks itself before it answers", async () => {
  const { engine, store, held, sims: [a, b], teardown } = await setup(
    ["ride-a", "ride-b"],
    64,
    { namespace: "ns-ride" },
  );
  const st = LoadState.create();
  let release = () => {};
  try {
    const hashes = chainedBlockHashes(syntheticTokens(51, 16 * 4), 16);
    a.fill([0, 1, 2, 3], hashes);
    b.fill([4, 5, 6, 7], hashes);
    // A's copy runs (its completion held back), then B saves the same hashes.
    const hold = held.holdNext();
    release = hold.release;
    const savingA = engine.save({
      instanceId: "ride-a",
      ...rank0,
      layers: [],
      blockIds: [0, 1, 2, 3],
      blockHashes: hashes,
    });
    await hold.submitted;
    let bAnswered = false;
    const savingB = engine.save({
      instanceId: "ride-b",
      ...rank0,
      requestId: "r-ride-b",
      layers: [],
      blockIds: [4, 5, 6, 7],
      blockHashes: hashes,
    }).then((r) => {
      bAnswered = true;
      return r;
    });
    await tick();
    assert.equal(bAnswered, false, "B answered while the copy it skipped for was in flight");
    // A's copy fails: its slots are freed.
    hold.fail();
    await assert.rejects(savingA, /injected copy failure/);
    const rb = await savingB;
    assert.equal(rb.blocksSaved, 4, "B copied what A did not land");
    assert.equal(rb.blocksSkipped, 0);
    assert.ok(rb.bytesCopied > 0);
    const stats = store.stats();
    assert.equal(stats.sealedBlocks, 4);
    assert.equal(stats.inflightBlocks, 0);
    assert.equal(stats.inflightCopyBytes, 0);
    assert.equal(stats.deduplicated, 0, "B's blocks were copied, not deduplicated");
    // The blocks are B's bytes, and they load byte-exact.
    const q = engine.query("ride-a", hashes, "r-ride-q");
    assert.equal(q.hits, 4);
    const l = await engine.load({
      instanceId: "ride-a",
      ...rank0,
      leaseId: q.leaseId!,
      blockIds: [20, 21, 22, 23],
      loadStateShm: st.name,
    });
    await l.done;
    assert.equal(st.snapshot().state, STATE_OK);
    assert.deepEqual(a.verify([20, 21, 22, 23], hashes), { badSegments: 0, first: undefined });
  } finally {
    release(); // a failed assertion must not leave A's copy held through the teardown's drain
    st.close();
    await teardown();
  }
});

Deno.test("a Save riding on a copy that lands answers after it, skipped once, with no copy of its own", async () => {
  const { engine, store, held, sims: [a, b], teardown } = await setup(
    ["ride-c", "ride-d"],
    64,
    { namespace: "ns-ride2" },
  );
  let release = () => {};
  try {
    const hashes = chainedBlockHashes(syntheticTokens(52, 16 * 4), 16);
    a.fill([0, 1, 2, 3], hashes);
    b.fill([0, 1, 2, 3], hashes);
    const save = (instanceId: string) =>
      engine.save({
        instanceId,
        ...rank0,
        layers: [],
        blockIds: [0, 1, 2, 3],
        blockHashes: hashes,
      });
    const hold = held.holdNext();
    release = hold.release;
    const savingC = save("ride-c");
    await hold.submitted;
    let dAnswered = false;
    const savingD = save("ride-d").then((r) => {
      dAnswered = true;
      return r;
    });
    await tick();
    assert.equal(dAnswered, false, "D answered before the blocks it skipped were in the pool");
    hold.release();
    assert.equal((await savingC).blocksSaved, 4);
    const rd = await savingD;
    assert.deepEqual(
      [rd.blocksSaved, rd.blocksSkipped, rd.bytesCopied],
      [0, 4, 0],
      "D skipped the 4 blocks C stored, copying nothing",
    );
    const stats = store.stats();
    assert.equal(stats.deduplicated, 4, "each skipped block counted once");
    assert.equal(stats.sealedBlocks, 4);
    assert.equal(stats.inflightCopyBytes, 0);
  } finally {
    release();
    await teardown();
  }
});
