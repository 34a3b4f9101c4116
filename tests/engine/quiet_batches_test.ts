/**
 * The server's copies are quiet batches (in-process KvEngine, real host
 * backend): a save or a load of every layer posts one completion record, its
 * BATCH, not one per layer besides — nothing in the server watches a
 * batch's layers land (an engine watches its load's progress words), and
 * each record is a wake, an object and a push on the server's JS thread.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { STATE_OK } from "../../lib/engine/load_state.ts";
import { MODEL, setup } from "./setup.ts";

Deno.test("a save and a load of every layer each post one completion record; the load still reports layer by layer to the engine", async () => {
  const { engine, native, sims: [sim], teardown } = await setup(["quiet"]);
  const st = LoadState.create();
  try {
    const ring = native.copyEngine.ring;
    const hashes = chainedBlockHashes(syntheticTokens(9, 16 * 6), 16);
    const src = hashes.map((_, i) => i);
    sim.fill(src, hashes);
    const before = ring.consumed;
    const saved = await engine.save({
      instanceId: "quiet",
      tpRank: 0,
      ppRank: 0,
      layers: [],
      blockIds: src,
      blockHashes: hashes,
    });
    assert.equal(saved.blocksSaved, 6);
    assert.equal(ring.consumed - before, 1, `a save of ${MODEL.numLayers} layers: records`);

    const dst = hashes.map((_, i) => 20 + i);
    sim.clear(dst);
    const q = engine.query("quiet", hashes, "r-quiet");
    const atLoad = ring.consumed;
    const l = await engine.load({
      instanceId: "quiet",
      tpRank: 0,
      ppRank: 0,
      requestId: "r-quiet",
      leaseId: q.leaseId!,
      blockIds: dst,
      loadStateShm: st.name,
    });
    await l.done;
    assert.equal(ring.consumed - atLoad, 1, `a load of ${MODEL.numLayers} layers: records`);
    assert.deepEqual(st.snapshot(), {
      numLayers: MODEL.numLayers,
      layersReady: MODEL.numLayers,
      state: STATE_OK,
    });
    assert.deepEqual(sim.verify(dst, hashes), { badSegments: 0, first: undefined });
  } finally {
    st.close();
    await teardown();
  }
});
