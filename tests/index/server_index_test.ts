/**
 * A real server process with --index-redis: blocks it seals are advertised,
 * blocks it evicts are withdrawn, it keeps serving locally while Redis is
 * down, and re-advertises when Redis is back.
 */

import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { RedisBlockIndex } from "../../lib/index/block_index.ts";
import { hostSim, startServer, uid } from "../server/harness.ts";
import { startRedis, waitFor } from "./_redis.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 2 };

Deno.test("a server advertises what it seals, withdraws what it evicts, and survives a Redis restart", async () => {
  const redis = await startRedis();
  const srv = await startServer([
    "--index-redis",
    redis.url,
    "--node-id",
    "node-a",
    "--index-timeout-ms",
    "100",
    "--index-node-ttl-ms",
    "1000",
  ]);
  const probe = new RedisBlockIndex({
    url: redis.url,
    nodeId: "probe",
    advertiseAddr: "probe:1",
    listSealed: () => [],
  });
  probe.start();
  const namespace = uid("ns");
  const sim = hostSim(srv, {
    instanceId: uid("inst"),
    namespace,
    model: MODEL,
    numBlocks: 16,
  });
  try {
    await sim.register();
    const hashes = chainedBlockHashes(syntheticTokens(3, 16 * 8), 16);
    const ids = Array.from({ length: 8 }, (_, i) => i);
    sim.fill(ids, hashes);
    await sim.save(ids, hashes);
    // The store's namespace for this instance is what the server logs and keys by.
    const lookup = () => probe.lookup(namespace, hashes);
    await waitFor("the save is advertised", async () => (await lookup()).length === 8);
    const r = await lookup();
    assert.deepEqual(r.owners, [{ nodeId: "node-a", addr: srv.grpc, length: 8 }]);

    // Redis restarted empty: the server keeps serving and re-advertises on its own.
    await redis.restart();
    const q = await sim.query(hashes, "q-after-restart");
    assert.ok(q.kind === "ready" && q.hits === 8, "local queries do not depend on the index");
    await waitFor("re-advertised after the restart", async () => (await lookup()).length === 8);

    // Redis killed: still serving locally, one log line for the outage.
    await redis.kill();
    const q2 = await sim.query(hashes, "q-redis-down");
    assert.ok(q2.kind === "ready" && q2.hits === 8);
    await waitFor("the outage is logged", () => srv.logs().some((l) => l.includes("unreachable")));
    await redis.restart();
    await waitFor("back after the outage", async () => (await lookup()).length === 8);
    // The outage is counted, under whichever call met it first (a heartbeat, a
    // reconnect, an advertise: that depends on timing, not on behaviour).
    let errors = 0;
    for (const op of ["advertise", "withdraw", "lookup", "heartbeat", "connect"]) {
      const n = await srv.metric("pegaflow_index_errors_total", `{op="${op}"}`);
      if (!Number.isNaN(n)) errors += n;
    }
    assert.ok(errors >= 1, `index errors counted during the outage: ${errors}`);
    assert.ok(await srv.metric("pegaflow_index_readvertised_blocks_total") >= 16);
    assert.equal(await srv.metric("pegaflow_index_redis_up"), 1);
    // One line per outage (down, then back), not one per failed call or reconnect attempt.
    // The quick restart above may or may not have been seen as an outage; either way the
    // node re-joined (its registration was gone) and re-advertised.
    const down = srv.logs().filter((l) => l.includes("unreachable")).length;
    const back = srv.logs().filter((l) => l.includes("reachable again")).length;
    assert.ok(down >= 1 && down <= 2, `${down} outage lines`);
    assert.equal(back, down);

    // Eviction withdraws.
    for (const x of [q, q2]) if (x.kind === "ready") await srv.client.release(x.leaseId);
    const res = await srv.http_post("/cache/memory/cleanup");
    await res.body?.cancel();
    await waitFor("evicted blocks withdrawn", async () => (await lookup()).length < 8);
  } finally {
    sim.close();
    await probe.close();
    await srv.stop();
    await redis.stop();
  }
});
