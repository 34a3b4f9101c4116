/**
 * Sessions and cleanup: a dropped session (client closed it, or the engine
 * was SIGKILLed mid-save) cleans the instance up — in-flight copies drained,
 * mappings closed, leases released — and re-registration then works.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { hostSim, type ServerProc, shmMappings, startServer, uid } from "./harness.ts";
import { settlesWithin } from "../../lib/http/shutdown.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };
const ROOT = new URL("../../", import.meta.url).pathname;

async function instanceIds(srv: ServerProc): Promise<string[]> {
  const j = await (await srv.http_get("/instances")).json();
  return j.instances.map((i: { instanceId: string }) => i.instanceId);
}

async function until(
  what: string,
  cond: () => Promise<boolean>,
  timeoutMs = 20_000,
): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

Deno.test("closing the session cleans the instance up (leases released) and re-registration works", async () => {
  const srv = await startServer();
  const instanceId = uid("sess");
  const sim = hostSim(srv, {
    instanceId,
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 16,
  });
  try {
    await sim.register();
    const session = srv.client.openSession(instanceId);
    const hashes = chainedBlockHashes(syntheticTokens(3, 16 * 4), 16);
    sim.fill([0, 1, 2, 3], hashes);
    await sim.save([0, 1, 2, 3], hashes);
    const q = await sim.query(hashes, "pinned");
    assert.ok(q.kind === "ready" && q.hits === 4);
    assert.equal(await srv.metric("pegaflow_leases"), 1);
    const regionName = new TextDecoder().decode(sim.regions[0].handle).replace(/\0+$/, "");
    assert.equal(shmMappings(srv.pid, regionName.slice(1)).length, 1, "the server maps the region");

    session.close();
    await until("instance gone", async () => (await instanceIds(srv)).length === 0);
    assert.equal(await srv.metric("pegaflow_leases"), 0, "its leases were released");
    assert.equal(await srv.metric("pegaflow_pinned_blocks"), 0);
    assert.equal(shmMappings(srv.pid, regionName.slice(1)).length, 0, "its mapping was closed");
    assert.equal(
      await srv.metric("pegaflow_instance_cleanups_total", '{reason="session_lost"}'),
      1,
    );
    // The session's end is counted, but its lifetime is no handling time for the RPC histogram.
    const ended = '{method="Session",status="CANCELLED"}';
    assert.equal(await srv.metric("pegaflow_rpc_requests_total", ended), 1);
    assert.ok(Number.isNaN(await srv.metric("pegaflow_rpc_duration_seconds_count", ended)));

    // Re-registration of the same instance works and the cache still serves it.
    await sim.register();
    const again = srv.client.openSession(instanceId);
    const q2 = await sim.query(hashes, "after");
    assert.ok(q2.kind === "ready" && q2.hits === 4);
    if (q2.kind !== "ready") return;
    sim.clear([8, 9, 10, 11]);
    await sim.load(q2.leaseId, [8, 9, 10, 11]);
    assert.equal(sim.verify([8, 9, 10, 11], hashes).badSegments, 0);

    // Unregister ends the session from the server side.
    await srv.client.unregisterContext(instanceId);
    const last = await again.closed;
    assert.equal(last?.kind, 2 /* CLEANED_UP */);
  } finally {
    sim.close();
    await srv.stop();
  }
});

Deno.test("an engine killed with SIGKILL mid-save is cleaned up with nothing leaked", async () => {
  const srv = await startServer(["--pool-size", "32mb"]);
  const instanceId = uid("kill");
  const namespace = uid("ns");
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", "tests/server/fixtures/engine_child.ts", srv.grpc, instanceId, namespace],
    cwd: ROOT,
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  let regions: string[] = [];
  try {
    const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    let saves = 0;
    while (saves < 2) {
      const r = await reader.read();
      if (r.done) throw new Error("engine child exited early");
      buf += r.value;
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const msg = JSON.parse(buf.slice(0, i));
        buf = buf.slice(i + 1);
        if (msg.ready) regions = msg.regions;
        if (msg.saved) saves++;
      }
    }
    assert.equal(regions.length, 8);
    assert.equal(shmMappings(srv.pid, regions[0].slice(1)).length, 1);
    // Kill it while its save loop keeps a Save in flight.
    child.kill("SIGKILL");
    await child.status;
    reader.releaseLock();

    await until("instance cleaned up", async () => (await instanceIds(srv)).length === 0);
    for (const name of regions) {
      assert.equal(shmMappings(srv.pid, name.slice(1)).length, 0, `mapping of ${name} closed`);
    }
    assert.equal(await srv.metric("pegaflow_inflight_copy_bytes"), 0, "no copy reservation left");
    assert.equal(await srv.metric("pegaflow_inflight_blocks"), 0, "no half-written block left");
    assert.equal(await srv.metric("pegaflow_leases"), 0);
    // Everything still allocated belongs to sealed blocks, and freeing them returns the pool.
    const cleanup = await (await srv.http_post("/cache/memory/cleanup")).json();
    assert.ok(cleanup.blocks_evicted >= 64);
    assert.equal(await srv.metric("pegaflow_pool_used_bytes"), 0, "pool usage returns to zero");

    // The server keeps serving: the same instance id registers again.
    const sim = hostSim(srv, {
      instanceId,
      namespace,
      model: { ...LLAMA_3_1_8B, numLayers: 8 },
      numBlocks: 64,
    });
    try {
      const r = await sim.register();
      assert.equal(r.topologySealed, true);
      await srv.client.unregisterContext(instanceId);
    } finally {
      sim.close();
    }
  } finally {
    try {
      child.kill("SIGKILL");
    } catch (_e) { /* already dead */ }
    // The killed child could not unlink its shm files: remove them.
    for (const name of regions) {
      await Deno.remove(`/dev/shm${name}`).catch((e) => {
        if (!(e instanceof Deno.errors.NotFound)) throw e;
      });
    }
    await srv.stop();
  }
});

Deno.test("a newer session for the same rank supersedes the old one without a cleanup", async () => {
  const srv = await startServer();
  const instanceId = uid("super");
  const sim = hostSim(srv, {
    instanceId,
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 8,
  });
  try {
    await sim.register();
    const first = srv.client.openSession(instanceId);
    const second = srv.client.openSession(instanceId);
    const ev = await first.closed;
    assert.equal(ev?.kind, 1 /* SUPERSEDED */);
    // The superseded stream ending did not clean the instance up.
    assert.deepEqual(await instanceIds(srv), [instanceId]);
    second.close();
    await until(
      "instance gone after the current session drops",
      async () => (await instanceIds(srv)).length === 0,
    );
  } finally {
    sim.close();
    await srv.stop();
  }
});

Deno.test("a session for a rank outside a registered instance's topology is refused, and the instance stays", async () => {
  const srv = await startServer();
  const instanceId = uid("topo");
  const sim = hostSim(srv, { instanceId, namespace: uid("ns"), model: MODEL, numBlocks: 8 });
  try {
    await sim.register(); // tp_size 1, pp_size 1
    const own = srv.client.openSession(instanceId);
    const stray = srv.client.openSession(instanceId, 1, 0);
    assert.ok(await settlesWithin(stray.closed, 5_000), "the stray session was not refused");
    assert.equal(await stray.closed, null);
    assert.equal(stray.error?.codeName, "INVALID_ARGUMENT");
    assert.match(
      stray.error?.details ?? "",
      /tp_rank 1 pp_rank 0 is outside its topology \(tp_size 1/,
    );
    // Its end cleaned nothing up: the instance and its own session stand.
    assert.deepEqual(await instanceIds(srv), [instanceId]);
    own.close();
  } finally {
    sim.close();
    await srv.stop();
  }
});
