/**
 * Engines come and go for as long as a server lives (restarts, scale-downs,
 * crashes cleaned up by an operator). Each one registers shared-memory
 * regions, saves, loads and leaves; what it leaves behind must be nothing:
 * no instance, no lease, no descriptor, no mapping of its shm files. The
 * server is a separate process; its figures come from its /metrics
 * (`process_open_fds`) and its /proc/PID/maps.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { hostSim, type ServerProc, startServer, uid } from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };

/** Lines of the server's memory map that map a /dev/shm file (engine regions, load states). */
async function shmMappings(pid: number): Promise<number> {
  const maps = await Deno.readTextFile(`/proc/${pid}/maps`);
  return maps.split("\n").filter((l) => l.includes("/dev/shm/")).length;
}

/** One engine's life: register, save 4 blocks, hit them, load them, leave. */
async function engineLife(srv: ServerProc, ns: string, i: number): Promise<void> {
  const sim = hostSim(srv, {
    instanceId: uid("churn"),
    namespace: ns,
    model: MODEL,
    numBlocks: 16,
  });
  try {
    await sim.register();
    const hashes = chainedBlockHashes(syntheticTokens(5000 + i, 16 * 4), 16);
    sim.fill([0, 1, 2, 3], hashes);
    await sim.save([0, 1, 2, 3], hashes);
    const q = await sim.query(hashes, `req-${i}`);
    assert.equal(q.kind, "ready");
    if (q.kind !== "ready") return;
    assert.equal(q.hits, 4);
    const t = await sim.load(q.leaseId, [8, 9, 10, 11]);
    assert.equal(t.state, 1);
    assert.equal(sim.verify([8, 9, 10, 11], hashes).badSegments, 0);
    // Half leave by themselves, half are cleaned up by the operator (a crashed engine).
    if (i % 2 === 0) await srv.client.unregisterContext(sim.instanceId);
    else {
      const r = await srv.http_post("/instances/cleanup", { instance_id: sim.instanceId });
      assert.equal(r.status, 200, await r.text());
    }
  } finally {
    sim.close();
  }
}

Deno.test("engines that come and go leave no instance, lease, descriptor or shm mapping behind", async () => {
  const srv = await startServer();
  const ns = uid("ns");
  try {
    // Warm-up: whatever the server opens once (its load-state pool, lazily built parts) opens here.
    for (let i = 0; i < 20; i++) await engineLife(srv, ns, i);
    const fds0 = await srv.metric("process_open_fds");
    const maps0 = await shmMappings(srv.pid);
    assert.ok(fds0 > 0, `process_open_fds reads ${fds0}`);
    for (let i = 20; i < 220; i++) await engineLife(srv, ns, i);
    assert.equal(await srv.metric("pegaflow_instances"), 0);
    assert.equal(await srv.metric("pegaflow_leases"), 0);
    const fds1 = await srv.metric("process_open_fds");
    const maps1 = await shmMappings(srv.pid);
    // 200 engines each opened two regions and a load state: a leak of one per engine is +200.
    assert.ok(fds1 <= fds0 + 2, `open descriptors ${fds0} -> ${fds1} over 200 engines`);
    assert.ok(maps1 <= maps0, `shm mappings ${maps0} -> ${maps1} over 200 engines`);
    assert.ok(await srv.metric("process_resident_memory_bytes") > 0);
    assert.ok(await srv.metric("process_cpu_seconds_total") > 0);
    assert.ok(await srv.metric("pegaflow_js_heap_used_bytes") > 0);
  } finally {
    await srv.stop();
  }
});
