/**
 * The engine's pipelines in-process (real native host backend, real store):
 * the save queue's refuse policy, and cleanup's fence → drain → unmap order.
 */
import assert from "node:assert/strict";
import { KvEngine } from "../../lib/engine/engine.ts";
import { openTestNative } from "../engine/setup.ts";
import { EngineError } from "../../lib/engine/errors.ts";
import { KvStore } from "../../lib/storage/store.ts";
import { Logger } from "../../lib/log.ts";
import { PegaflowClient } from "../../lib/client/client.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B, SimEngine } from "../../lib/client/sim_engine.ts";
import { PROTOCOL_VERSION } from "../../lib/engine/engine.ts";
import { LoadState, STATE_OK } from "../../lib/client/load_state.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };
const silent = new Logger("error", {}, () => {});

async function setup(opts: { saveConcurrency: number; saveQueueDepth: number }) {
  const native = await openTestNative();
  const store = new KvStore({ capacityBytes: native.poolBytes });
  const engine = new KvEngine({ native, store, log: silent, leaseTtlMs: 60_000, ...opts });
  // The simulated engine only needs its regions here; no server connection is made.
  const client = new PegaflowClient("127.0.0.1:1");
  const sim = SimEngine.create({
    client,
    instanceId: "inproc",
    namespace: "ns-inproc",
    model: MODEL,
    numBlocks: 64,
    backend: "host",
  });
  engine.register({ ...sim.registration(), clientVersion: PROTOCOL_VERSION });
  const teardown = async () => {
    await engine.close();
    await native.close();
    sim.close();
    client.close();
  };
  return { engine, store, sim, teardown };
}

function saveArgs(sim: SimEngine, seed: number) {
  const hashes = chainedBlockHashes(syntheticTokens(seed, 16 * 16), 16);
  const ids = Array.from({ length: 16 }, (_, i) => i);
  sim.fill(ids, hashes);
  return {
    instanceId: "inproc",
    tpRank: 0,
    ppRank: 0,
    layers: sim.layerNames.map((layerName) => ({ layerName, blockIds: ids, blockHashes: hashes })),
  };
}

Deno.test("a full save queue refuses with RESOURCE_EXHAUSTED instead of parking the request", async () => {
  const { engine, sim, teardown } = await setup({ saveConcurrency: 1, saveQueueDepth: 1 });
  try {
    const args = [1, 2, 3, 4].map((s) => saveArgs(sim, s));
    // Submitted in one turn: 1 copying, 1 queued, 2 refused.
    const results = await Promise.allSettled(args.map((a) => engine.save(a)));
    assert.deepEqual(results.map((r) => r.status), [
      "fulfilled",
      "fulfilled",
      "rejected",
      "rejected",
    ]);
    for (const r of results.slice(2)) {
      const e = (r as PromiseRejectedResult).reason as EngineError;
      assert.equal(e.code, 8 /* RESOURCE_EXHAUSTED */);
      assert.match(e.message, /save queue full/);
    }
    const [save] = engine.stageStats();
    assert.equal(save.queue.refused, 2);
    assert.equal(save.maxInflight, 1);
  } finally {
    await teardown();
  }
});

Deno.test("cleanup fences new work and drains in-flight saves before unmapping", async () => {
  const { engine, store, sim, teardown } = await setup({ saveConcurrency: 2, saveQueueDepth: 4 });
  try {
    const a = engine.save(saveArgs(sim, 10));
    // What the store holds at the moment cleanup finishes: the drained save has sealed its blocks by then.
    const gone = engine.unregister("inproc", "test").then(() => store.stats().sealedBlocks);
    // Fenced: new work is refused at once.
    await assert.rejects(
      engine.save(saveArgs(sim, 11)),
      (e: EngineError) => e.code === 14, /* UNAVAILABLE */
    );
    const r = await a;
    assert.equal(await gone, 16, "cleanup finished only after the in-flight save completed");
    assert.equal(r.bytesCopied, 16 * 4 * 2 * 32768);
    assert.equal(r.blocksSaved, 16, "the in-flight save finished before the mapping closed");
    assert.equal(store.stats().sealedBlocks, 16);
    assert.equal(store.stats().inflightCopyBytes, 0);
    assert.equal(engine.has("inproc"), false);
  } finally {
    await teardown();
  }
});

Deno.test("a load spanning two saves into targets with gaps lands byte-exact (runs split where pool or target breaks)", async () => {
  const { engine, sim, teardown } = await setup({ saveConcurrency: 2, saveQueueDepth: 4 });
  const st = LoadState.create();
  try {
    const hashes = chainedBlockHashes(syntheticTokens(77, 16 * 16), 16);
    const src = Array.from({ length: 16 }, (_, i) => i);
    sim.fill(src, hashes);
    // Two requests: two runs of blocks in the pool (0..9 and 10..15).
    for (const [from, to] of [[0, 10], [10, 16]]) {
      const r = await engine.save({
        instanceId: "inproc",
        tpRank: 0,
        ppRank: 0,
        layers: [],
        blockIds: src.slice(from, to),
        blockHashes: hashes.slice(from, to),
      });
      assert.equal(r.blocksSaved, to - from);
    }
    // Targets: consecutive stretches broken inside a run (after 4 and 7), across
    // the run boundary (9 → 10 continue), and one reversed pair at the end.
    const dst = [40, 41, 42, 43, 50, 51, 52, 20, 21, 22, 23, 24, 25, 26, 63, 62];
    sim.clear(dst);
    assert.ok(sim.verify(dst, hashes).badSegments > 0, "targets start out wrong");
    const q = engine.query("inproc", hashes, "req-gaps");
    assert.equal(q.hits, 16);
    const l = await engine.load({
      instanceId: "inproc",
      tpRank: 0,
      ppRank: 0,
      leaseId: q.leaseId!,
      blockIds: dst,
      loadStateShm: st.name,
      requestId: "req-gaps",
    });
    await l.done;
    assert.equal(await st.waitAll(), STATE_OK);
    assert.deepEqual(sim.verify(dst, hashes), { badSegments: 0, first: undefined });
  } finally {
    st.close();
    await teardown();
  }
});
