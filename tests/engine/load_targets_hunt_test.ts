/**
 * A Load (or a query-and-load) naming one target block twice is refused
 * before the lease is spent: both leased blocks would be scattered into that
 * one block, one over the other, and the load state would read done with one
 * block's KV lost (on the host backend the two copies even race, mixing both).
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import type { EngineError } from "../../lib/engine/errors.ts";
import { STATE_OK, STATE_REJECTED } from "../../lib/engine/load_state.ts";
import { setup } from "./setup.ts";

const rank0 = { tpRank: 0, ppRank: 0 };

Deno.test("a Load naming one target twice is refused naming it; nothing is written and the lease stays usable", async () => {
  const { engine, store, sims: [sim], teardown } = await setup(["dup-t"]);
  const st = LoadState.create();
  try {
    const hashes = chainedBlockHashes(syntheticTokens(31, 16 * 3), 16);
    const ids = hashes.map((_, i) => i);
    sim.fill(ids, hashes);
    await engine.save({
      instanceId: "dup-t",
      ...rank0,
      layers: [],
      blockIds: ids,
      blockHashes: hashes,
    });
    const q = engine.query("dup-t", hashes, "r-dup");
    assert.equal(q.hits, 3);
    sim.clear([20, 21, 22]);
    const before = sim.verify([20], [hashes[0]]).badSegments;
    await assert.rejects(
      engine.load({
        instanceId: "dup-t",
        ...rank0,
        requestId: "r-dup",
        leaseId: q.leaseId!,
        blockIds: [20, 21, 20],
        loadStateShm: st.name,
      }),
      (e: EngineError) =>
        e.code === 3 && e.fields.blockId === 20 && e.fields.instance === "dup-t" &&
        /target block id 20 is named twice \(targets 0 and 2\)/.test(e.message) &&
        e.message.includes(`request "r-dup"`),
    );
    assert.equal(st.snapshot().state, STATE_REJECTED, "the refusal is in the load state");
    assert.equal(sim.verify([20], [hashes[0]]).badSegments, before, "block 20 was written");
    assert.equal(store.stats().loadsInflight, 0);
    // The lease was not spent: the corrected Load lands byte-exact.
    st.rearm();
    const l = await engine.load({
      instanceId: "dup-t",
      ...rank0,
      requestId: "r-dup",
      leaseId: q.leaseId!,
      blockIds: [20, 21, 22],
      loadStateShm: st.name,
    });
    await l.done;
    assert.equal(st.snapshot().state, STATE_OK);
    assert.deepEqual(sim.verify([20, 21, 22], hashes), { badSegments: 0, first: undefined });
    assert.equal(store.stats().pinnedBlocks, 0);
  } finally {
    st.close();
    await teardown();
  }
});

Deno.test("a query-and-load naming one target twice is refused for its rank and pins nothing", async () => {
  const { engine, store, sims: [sim], teardown } = await setup(["dup-q"]);
  const st = LoadState.create();
  try {
    const hashes = chainedBlockHashes(syntheticTokens(32, 16 * 2), 16);
    sim.fill([0, 1], hashes);
    await engine.save({
      instanceId: "dup-q",
      ...rank0,
      layers: [],
      blockIds: [0, 1],
      blockHashes: hashes,
    });
    const r = engine.queryLoad("dup-q", hashes, "r-dq", {
      blockIds: [9, 9],
      ranks: [{ ...rank0, loadStateShm: st.name }],
    });
    assert.equal(r.hits, 2);
    assert.equal(r.loads.length, 1);
    assert.match(r.loads[0].error, /target block id 9 is named twice/);
    assert.equal(st.snapshot().state, STATE_REJECTED);
    assert.equal(store.stats().leasesActive, 0, "the lease was given back");
    assert.equal(store.stats().pinnedBlocks, 0);
  } finally {
    st.close();
    await teardown();
  }
});
