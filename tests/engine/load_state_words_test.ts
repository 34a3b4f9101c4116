/**
 * Who writes an engine's load state, and when (in-process KvEngine, real
 * host backend): a block whose header is not a load state's is refused
 * without a byte written into it, and a failed load whose completion reaches
 * the server late does not write its failure over the load the engine has
 * since started with the same block.
 */
import assert from "node:assert/strict";
import { SharedMemory } from "../../ffi/mod.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import type { EngineError } from "../../lib/engine/errors.ts";
import {
  initLoadState,
  LOAD_STATE_BYTES,
  OFF_VERSION,
  STATE_OK,
} from "../../lib/engine/load_state.ts";
import { setup } from "./setup.ts";

/** PF_EFAULT: the state of a load whose target memory faulted under the copy. */
const PF_EFAULT = -13;

function shmName(handle: Uint8Array): string {
  return new TextDecoder().decode(handle).replace(/\0+$/, "");
}

Deno.test("a block whose header is not a load state's is refused and never written", async () => {
  const { engine, teardown } = await setup(["hdr"]);
  const name = `/pegaflow-not-ls-${Deno.pid}-${Date.now().toString(36)}`;
  const shm = SharedMemory.open(name, LOAD_STATE_BYTES, { create: true, unlink: true });
  try {
    const bytes = shm.view();
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const cases: [string, () => void, RegExp][] = [
      ["another object's bytes", () => bytes.fill(0xa5), /magic 0xa5a5a5a5/],
      ["a load state of another version", () => {
        initLoadState(view);
        view.setUint32(OFF_VERSION, 2, true);
      }, /version 2, expected 1/],
    ];
    for (const [what, init, why] of cases) {
      init();
      const before = bytes.slice();
      await assert.rejects(
        engine.load({
          instanceId: "hdr",
          tpRank: 0,
          ppRank: 0,
          requestId: "r-hdr",
          leaseId: new Uint8Array(16),
          blockIds: [0],
          loadStateShm: name,
        }),
        (e: EngineError) => e.code === 3 && why.test(e.message) && e.message.includes(name),
      );
      assert.deepEqual(bytes, before, `${what}: the server wrote into a block it refused`);
    }
  } finally {
    shm.close();
    await teardown();
  }
});

Deno.test("a failed load's late completion leaves alone the load the engine started since with the same load state", async () => {
  const { engine, held, sims: [sim], teardown } = await setup(["reuse"]);
  const st = LoadState.create();
  try {
    const hashes = chainedBlockHashes(syntheticTokens(5, 16 * 8), 16);
    const src = hashes.map((_, i) => i);
    sim.fill(src, hashes);
    const saved = await engine.save({
      instanceId: "reuse",
      tpRank: 0,
      ppRank: 0,
      layers: [],
      blockIds: src,
      blockHashes: hashes,
    });
    assert.equal(saved.blocksSaved, 8);
    // The engine shrinks its last layer's region (K plane, then V plane) to end after
    // block 31's V segment: a load into blocks 40.. faults there, one into 16..23 does not.
    const plane = sim.numBlocks * sim.segBytes;
    Deno.truncateSync(`/dev/shm${shmName(sim.regions[3].handle)}`, plane + 32 * sim.segBytes);

    // Load 1 fails in the native layer, which writes state and layers_ready at once;
    // its completion record reaches the server's JS late (a busy event loop).
    const q1 = engine.query("reuse", hashes, "r-fail");
    const hold = held.holdNext();
    const l1 = await engine.load({
      instanceId: "reuse",
      tpRank: 0,
      ppRank: 0,
      requestId: "r-fail",
      leaseId: q1.leaseId!,
      blockIds: hashes.map((_, i) => 40 + i),
      loadStateShm: st.name,
    });
    assert.equal(await st.waitAll(), PF_EFAULT, "the native layer reported the fault");

    // The engine saw load 1 end: it rearms its load state and loads again with it.
    st.rearm();
    const dst = hashes.map((_, i) => 16 + i);
    sim.clear(dst);
    const q2 = engine.query("reuse", hashes, "r-again");
    const l2 = await engine.load({
      instanceId: "reuse",
      tpRank: 0,
      ppRank: 0,
      requestId: "r-again",
      leaseId: q2.leaseId!,
      blockIds: dst,
      loadStateShm: st.name,
    });
    await l2.done;
    assert.equal(st.snapshot().state, STATE_OK);

    // Now load 1's completion arrives.
    hold.release();
    await l1.done;
    assert.deepEqual(
      st.snapshot(),
      { numLayers: 4, layersReady: 4, state: STATE_OK },
      "load 2's words, not load 1's failure written over them",
    );
    assert.deepEqual(sim.verify(dst, hashes), { badSegments: 0, first: undefined });
  } finally {
    st.close();
    await teardown();
  }
});
