/**
 * A lease granted before a discard: with MLA (one KV slot shared by every TP
 * rank) the first rank's save seals a block at once, so another request can
 * lease it in the instant before the failing rank's discard arrives. The
 * discard dooms the pinned block (no new query finds it), but a Load that
 * consumed the lease afterwards still copied its garbage into that request's
 * KV. Now such a Load is refused (FAILED_PRECONDITION naming the block, the
 * load state marked failed) before the rank's share is spent: the engine
 * recomputes. A load of the prefix before the discarded block still runs.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { STATE_OK } from "../../lib/engine/load_state.ts";
import { LeaseError } from "../../lib/storage/errors.ts";
import { h, makeStore, NS, save } from "../storage/helpers.ts";
import { setup } from "./setup.ts";

/** MLA: one K/V slot per layer shared by every TP rank (any rank's save seals the block). */
const MLA = { layers: 2, tpSize: 2, collapseTp: true, segments: 1, segmentBytes: 4096 };

Deno.test("store: a lease's load of a block discarded since the grant is refused, the prefix before it still loads", () => {
  const evicted: string[] = [];
  const { store } = makeStore(16, { onEvict: (_ns, hash) => evicted.push(hash) }, MLA);
  save(store, [h(1), h(2)], { rank: 0 }); // rank 0's garbage seals at once
  const q = store.query(NS, [h(1), h(2)], "eng", 2);
  assert.equal(q.hits, 2);
  store.discard({ namespace: NS, instance: "eng", rank: 1, hashes: [h(2)] });
  for (const rank of [0, 1]) {
    assert.throws(
      () => store.consumeLease(q.lease!.id, "eng", rank),
      (e: unknown) =>
        e instanceof LeaseError && e.reason === "block-discarded" &&
        e.message.includes(`block 1 (hash ${h(2)}) was discarded`) &&
        e.message.includes(q.lease!.id),
    );
  }
  // Refused before its share was spent: each rank still loads the prefix before the block.
  const t0 = store.consumeLease(q.lease!.id, "eng", 0, { count: 1 });
  const t1 = store.consumeLease(q.lease!.id, "eng", 1, { count: 1 });
  assert.deepEqual([t0.blockCount, t1.blockCount], [1, 1]);
  store.loadDone(t0);
  store.loadDone(t1);
  // The lease ended with its last consume: the discarded block went, the good one stays.
  assert.deepEqual(evicted, [h(2)]);
  assert.equal(store.query(NS, [h(1), h(2)], "eng", 2).hits, 1);
  store.verify();
});

Deno.test("engine: a Load consuming a lease after a discard named one of its blocks fails its load state and copies nothing", async () => {
  const { engine, sims, teardown } = await setup(["disc-lease"], 16);
  const st = LoadState.create();
  try {
    const [sim] = sims;
    const ids = [0, 1, 2, 3];
    const hashes = chainedBlockHashes(syntheticTokens(71, 16 * 4), 16);
    sim.fill(ids, hashes);
    const s = await engine.save({
      instanceId: sim.instanceId,
      tpRank: 0,
      ppRank: 0,
      layers: [],
      blockIds: ids,
      blockHashes: hashes,
    });
    assert.equal(s.blocksSaved, 4);
    const q = engine.query(sim.instanceId, hashes, "r-lease");
    assert.equal(q.hits, 4);
    const d = await engine.save({
      instanceId: sim.instanceId,
      tpRank: 0,
      ppRank: 0,
      layers: [],
      blockIds: [],
      blockHashes: [],
      discardHashes: [hashes[2]],
      requestId: "r-failed",
    });
    assert.equal(d.blocksDiscarded, 0, "pinned by the lease: doomed, not evicted yet");
    const targets = [8, 9, 10, 11];
    sim.clear(targets);
    const before = sim.verify(targets, hashes).badSegments;
    assert.ok(before > 0);
    await assert.rejects(
      engine.load({
        instanceId: sim.instanceId,
        tpRank: 0,
        ppRank: 0,
        leaseId: q.leaseId!,
        blockIds: targets,
        loadStateShm: st.name,
        requestId: "r-lease",
      }),
      /block 2 \(hash [0-9a-f]+\) was discarded after the lease was granted/,
    );
    const snap = st.snapshot();
    assert.ok(snap.state < 0, `load state ${snap.state}: a refused load reads failed`);
    assert.equal(snap.layersReady, snap.numLayers, "a waiter on layers_ready wakes");
    assert.equal(sim.verify(targets, hashes).badSegments, before, "the refused load copied bytes");
    // The prefix before the discarded block loads, byte-exact.
    st.rearm();
    const l = await engine.load({
      instanceId: sim.instanceId,
      tpRank: 0,
      ppRank: 0,
      leaseId: q.leaseId!,
      blockIds: targets.slice(0, 2),
      loadStateShm: st.name,
      requestId: "r-lease",
    });
    await l.done;
    assert.equal(st.snapshot().state, STATE_OK);
    assert.deepEqual(sim.verify(targets.slice(0, 2), hashes.slice(0, 2)), {
      badSegments: 0,
      first: undefined,
    });
  } finally {
    st.close();
    await teardown();
  }
});
