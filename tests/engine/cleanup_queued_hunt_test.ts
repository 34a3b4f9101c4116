/**
 * Loads admitted but not yet submitted (queued behind the load stage) when
 * their instance is cleaned up or their lease expires: each fails with its
 * load state marked (every layer done, so no waiter hangs), and nothing is
 * left behind: no pin, lease, load in flight or load-state mapping. (Found
 * correct while hunting; kept as regression tests.)
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import type { EngineError } from "../../lib/engine/errors.ts";
import { STATE_OK, STATE_REJECTED } from "../../lib/engine/load_state.ts";
import type { KvEngine } from "../../lib/engine/engine.ts";
import type { SimEngine } from "../../lib/client/sim_engine.ts";
import { setup } from "./setup.ts";

const rank0 = { tpRank: 0, ppRank: 0 };

/** How many mappings of `name` this process holds (the engine's side and the server's). */
function mappings(name: string): number {
  return Deno.readTextFileSync("/proc/self/maps").split("\n").filter((l) => l.includes(name))
    .length;
}

async function saved(engine: KvEngine, sim: SimEngine, seed: number) {
  const hashes = chainedBlockHashes(syntheticTokens(seed, 16 * 4), 16);
  const ids = hashes.map((_, i) => i);
  sim.fill(ids, hashes);
  await engine.save({
    instanceId: sim.instanceId,
    ...rank0,
    layers: [],
    blockIds: ids,
    blockHashes: hashes,
  });
  return hashes;
}

Deno.test("a cleanup while loads are queued: the queued ones fail with their state marked, nothing is left pinned or mapped", async () => {
  const { engine, store, held, sims: [sim], teardown } = await setup(["cq"], 64, {
    engine: { loadConcurrency: 1, loadQueueDepth: 8 },
  });
  const states = [0, 1, 2].map(() => LoadState.create());
  let release = () => {};
  try {
    const hashes = await saved(engine, sim, 61);
    const hold = held.holdNext();
    release = hold.release;
    // Three Loads in one turn: the first is submitted (its completion held), two wait in the stage.
    const loads = states.map((st, i) => {
      const q = engine.query("cq", hashes, `r-cq-${i}`);
      return engine.load({
        instanceId: "cq",
        ...rank0,
        requestId: `r-cq-${i}`,
        leaseId: q.leaseId!,
        blockIds: [16, 17, 18, 19].map((b) => b + 4 * i),
        loadStateShm: st.name,
      });
    });
    const cleanup = engine.unregister("cq", "test");
    const [first, ...queued] = await Promise.allSettled(loads);
    assert.equal(first.status, "fulfilled");
    for (const q of queued) {
      assert.equal(q.status, "rejected");
      const e = (q as PromiseRejectedResult).reason as EngineError;
      assert.equal(e.code, 14, e.message);
      assert.match(e.message, /instance "cq" is being cleaned up; Load refused/);
    }
    for (const st of states.slice(1)) {
      assert.deepEqual(st.snapshot(), { numLayers: 4, layersReady: 4, state: STATE_REJECTED });
    }
    release();
    await cleanup;
    await (first as PromiseFulfilledResult<{ done: Promise<void> }>).value.done;
    assert.equal(states[0].snapshot().state, STATE_OK, "the submitted load landed");
    const s = store.stats();
    assert.deepEqual([s.pinnedBlocks, s.leasesActive, s.loadsInflight], [0, 0, 0]);
    for (const st of states) assert.equal(mappings(st.name), 1, `the server still maps ${st.name}`);
  } finally {
    release();
    for (const st of states) st.close();
    await teardown();
  }
});

Deno.test("a lease that expires while its Load waits in the stage: FAILED_PRECONDITION naming the lease, state marked, nothing pinned", async () => {
  let now = 0;
  const { engine, store, sims: [sim], teardown } = await setup(["ce"], 64, {
    engine: { loadConcurrency: 1, loadQueueDepth: 8 },
    clock: () => now,
  });
  const states = [0, 1].map(() => LoadState.create());
  try {
    const hashes = await saved(engine, sim, 62);
    const leases = [0, 1].map((i) => engine.query("ce", hashes, `r-ce-${i}`).leaseId!);
    const loads = states.map((st, i) =>
      engine.load({
        instanceId: "ce",
        ...rank0,
        requestId: `r-ce-${i}`,
        leaseId: leases[i],
        blockIds: [20, 21, 22, 23].map((b) => b + 4 * i),
        loadStateShm: st.name,
      })
    );
    // The second Load was admitted; its lease expires before the stage submits it.
    now += 3_600_000;
    const [first, second] = await Promise.allSettled(loads);
    assert.equal(first.status, "fulfilled");
    await (first as PromiseFulfilledResult<{ done: Promise<void> }>).value.done;
    assert.equal(second.status, "rejected");
    const e = (second as PromiseRejectedResult).reason as EngineError;
    assert.equal(e.code, 9, e.message);
    assert.match(
      e.message,
      /instance "ce" tp_rank 0 pp_rank 0 request "r-ce-1": lease [0-9a-f]{32} is unknown or expired/,
    );
    assert.deepEqual(states[1].snapshot(), { numLayers: 4, layersReady: 4, state: STATE_REJECTED });
    assert.equal(states[0].snapshot().state, STATE_OK);
    const s = store.stats();
    assert.deepEqual([s.pinnedBlocks, s.leasesActive, s.loadsInflight], [0, 0, 0]);
  } finally {
    for (const st of states) st.close();
    await teardown();
  }
});
