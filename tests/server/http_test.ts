/**
 * The HTTP side: /health, /metrics (pegaflow_* names, RPC counts by method
 * and status), /instances, POST /instances/cleanup, POST /cache/memory/cleanup.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { hostSim, startServer, uid } from "./harness.ts";
import { PROTOCOL_VERSION } from "../../lib/client/client.ts";

Deno.test("HTTP endpoints report and act on the server's state", async () => {
  const srv = await startServer();
  const sim = hostSim(srv, {
    instanceId: uid("http"),
    namespace: uid("ns"),
    model: { ...LLAMA_3_1_8B, numLayers: 2 },
    numBlocks: 8,
  });
  try {
    const h = await (await srv.http_get("/health")).json();
    assert.deepEqual(h, { status: "ok", version: PROTOCOL_VERSION, backend: "host" });

    await sim.register();
    const hashes = chainedBlockHashes(syntheticTokens(4, 16 * 4), 16);
    sim.fill([0, 1, 2, 3], hashes);
    await sim.save([0, 1, 2, 3], hashes);
    await assert.rejects(sim.save([0, 1, 2, 9], hashes));

    const inst = await (await srv.http_get("/instances")).json();
    assert.equal(inst.instances.length, 1);
    assert.equal(inst.instances[0].instanceId, sim.instanceId);
    assert.equal(inst.instances[0].sealed, true);
    assert.equal(inst.instances[0].numLayers, 2);
    assert.equal(inst.store.sealedBlocks, 4);

    const text = await (await srv.http_get("/metrics")).text();
    for (
      const name of [
        "pegaflow_pool_capacity_bytes",
        "pegaflow_pool_used_bytes",
        "pegaflow_cache_blocks",
        "pegaflow_cache_hits_total",
        "pegaflow_cache_misses_total",
        "pegaflow_cache_evictions_total",
        "pegaflow_admission_rejections_total",
        "pegaflow_save_bytes_total",
        "pegaflow_save_duration_seconds_bucket",
        "pegaflow_load_duration_seconds_bucket",
        "pegaflow_queue_depth",
        "pegaflow_rpc_duration_seconds_bucket",
      ]
    ) assert.ok(text.includes(name), `/metrics has ${name}`);
    assert.equal(
      await srv.metric("pegaflow_rpc_requests_total", '{method="Save",status="INVALID_ARGUMENT"}'),
      1,
    );
    assert.equal(
      await srv.metric("pegaflow_rpc_requests_total", '{method="RegisterContext",status="OK"}'),
      1,
    );
    assert.equal(await srv.metric("pegaflow_queue_depth", '{queue="save.gather"}'), 0);

    // Cache cleanup frees every unpinned block.
    assert.equal(await srv.metric("pegaflow_pool_used_bytes"), 4 * 2 * 2 * 32768);
    const c = await (await srv.http_post("/cache/memory/cleanup")).json();
    assert.equal(c.blocks_evicted, 4);
    assert.equal(c.bytes_freed, 4 * 2 * 2 * 32768);
    assert.equal(await srv.metric("pegaflow_pool_used_bytes"), 0);

    // Instance cleanup: bad bodies are 400/404, a good one cleans up.
    assert.equal((await srv.http_post("/instances/cleanup", { nope: 1 })).status, 400);
    assert.equal((await srv.http_post("/instances/cleanup", { instance_id: "ghost" })).status, 404);
    const bad = await srv.http_post("/instances/cleanup");
    assert.equal(bad.status, 400);
    await bad.body?.cancel();
    const ok = await (await srv.http_post("/instances/cleanup", { instance_id: sim.instanceId }))
      .json();
    assert.deepEqual(ok.cleaned, [{ instance_id: sim.instanceId, leases_released: 0 }]);
    assert.equal((await (await srv.http_get("/instances")).json()).instances.length, 0);
    const nf = await srv.http_get("/nope");
    assert.equal(nf.status, 404);
    await nf.body?.cancel();
  } finally {
    sim.close();
    await srv.stop();
  }
});
