/**
 * Register → Save → Query → Load → verify, over real gRPC between separate
 * processes (server child, this process as the engine), host backend, real
 * shared memory.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { PROTOCOL_VERSION } from "../../lib/client/client.ts";
import { hostSim, startServer, uid } from "./harness.ts";

/** Llama-3.1-8B block shape, fewer layers so the test stays small. */
const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };

Deno.test("a saved prefix loads byte-exact into different block ids, with per-layer progress", async () => {
  const srv = await startServer();
  const sim = hostSim(srv, {
    instanceId: uid("rt"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 64,
  });
  try {
    const health = await srv.client.health();
    assert.equal(health.version, PROTOCOL_VERSION);
    assert.equal(health.backend, "host");
    const reg = await sim.register();
    assert.equal(reg.numLayers, 4);
    assert.equal(reg.topologySealed, true);

    const hashes = chainedBlockHashes(syntheticTokens(1, 16 * 20), 16);
    const src = Array.from({ length: 20 }, (_, i) => 3 + i * 2); // scattered source ids
    const dst = Array.from({ length: 20 }, (_, i) => 63 - i); // different, reversed targets
    sim.fill(src, hashes);
    const saved = await sim.save(src, hashes);
    assert.equal(saved.blocksSaved, 20);
    assert.equal(saved.blocksSkipped, 0);
    assert.equal(saved.bytesCopied, 20 * 4 * 2 * 32768);

    // A second save of the same hashes (per-layer lists this time) copies nothing: dedup before copy.
    const again = await sim.save(src, hashes, { perLayer: true });
    assert.equal(again.blocksSaved, 0);
    assert.equal(again.bytesCopied, 0);
    assert.equal(again.blocksSkipped, 20);

    // Query with a longer list: the held prefix is 20, the rest misses.
    const more = chainedBlockHashes(syntheticTokens(1, 16 * 25), 16);
    const q = await sim.query(more, "req-1");
    assert.equal(q.kind, "ready");
    if (q.kind !== "ready") return;
    assert.equal(q.hits, 20);
    assert.equal(q.leaseId.length, 16);

    sim.clear(dst);
    assert.ok(sim.verify(dst, hashes).badSegments > 0, "targets start out wrong");
    const t = await sim.load(q.leaseId, dst);
    assert.equal(t.state, 1);
    const st = sim.verify(dst, hashes);
    assert.equal(st.badSegments, 0, st.first ?? "");
    // The load state reports every layer.
    const shm = await Deno.readFile(`/dev/shm${sim.loadStateName!}`);
    const dv = new DataView(shm.buffer);
    assert.equal(dv.getUint32(0, true), 0x534c4650);
    assert.equal(dv.getUint32(8, true), 4, "num_layers");
    assert.equal(dv.getUint32(16, true), 4, "layers_ready");
    assert.equal(dv.getInt32(20, true), 1, "state ok");

    // The lease was consumed by the only rank: a second load with it is refused.
    await assert.rejects(
      sim.load(q.leaseId, dst),
      (e: Error) => /FAILED_PRECONDITION/.test(e.message),
    );

    // A miss answers 0 hits and no lease.
    const miss = await sim.query(chainedBlockHashes(syntheticTokens(99, 32), 16), "req-2");
    assert.deepEqual(miss.kind === "ready" && [miss.hits, miss.leaseId.length], [0, 0]);

    assert.equal(await srv.metric("pegaflow_rpc_requests_total", '{method="Save",status="OK"}'), 2);
    assert.equal(await srv.metric("pegaflow_save_bytes_total", '{device="0"}'), 20 * 4 * 2 * 32768);
    assert.equal(await srv.metric("pegaflow_cache_blocks"), 20);
    assert.ok(
      (await srv.metric("pegaflow_load_bytes_total", '{device="0"}')) === 20 * 4 * 2 * 32768,
    );

    await srv.client.unregisterContext(sim.instanceId);
  } finally {
    sim.close();
    await srv.stop();
  }
});
