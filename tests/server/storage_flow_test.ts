/**
 * Storage behaviour seen through the gRPC API: TP sealing, eviction under
 * pressure with leases held, pool exhaustion.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import type { PegaflowError } from "../../lib/client/client.ts";
import { hostSim, startServer, uid } from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };
/** 4 layers x K/V x 32 KiB. */
const BLOCK_BYTES = 4 * 2 * 32768;

function grpcCode(name: string) {
  return (e: unknown) => (e as PegaflowError).codeName === name;
}

function ids(from: number, n: number): number[] {
  return Array.from({ length: n }, (_, i) => from + i);
}

Deno.test("TP=2: a block saved by one rank only is never served; both ranks load their own bytes", async () => {
  const srv = await startServer();
  const instanceId = uid("tp");
  const namespace = uid("ns");
  const r0 = hostSim(srv, {
    instanceId,
    namespace,
    model: MODEL,
    numBlocks: 32,
    tpRank: 0,
    tpSize: 2,
  });
  const r1 = hostSim(srv, {
    instanceId,
    namespace,
    model: MODEL,
    numBlocks: 32,
    tpRank: 1,
    tpSize: 2,
  });
  try {
    const a = await r0.register();
    assert.equal(a.topologySealed, false);
    assert.equal(a.ranksRegistered, 1);
    const hashes = chainedBlockHashes(syntheticTokens(7, 16 * 10), 16);
    r0.fill(ids(0, 10), hashes);
    r1.fill(ids(0, 10), hashes);
    // Before the topology is sealed nothing is accepted.
    await assert.rejects(r0.save(ids(0, 10), hashes), grpcCode("FAILED_PRECONDITION"));
    const b = await r1.register();
    assert.equal(b.topologySealed, true);

    await r0.save(ids(0, 10), hashes);
    const half = await r0.query(hashes, "q-half");
    assert.equal(half.kind === "ready" && half.hits, 0, "half-saved blocks are not served");
    assert.equal(await srv.metric("pegaflow_inflight_blocks"), 10);

    assert.equal(await srv.metric("pegaflow_blocks_sealed_total"), 0);
    await r1.save(ids(0, 10), hashes);
    assert.equal(
      await srv.metric("pegaflow_blocks_sealed_total"),
      10,
      "the second rank's save sealed them",
    );
    const q = await r0.query(hashes, "q-full");
    assert.ok(q.kind === "ready" && q.hits === 10);
    if (q.kind !== "ready") return;
    r0.clear(ids(10, 10));
    r1.clear(ids(20, 10));
    await r0.load(q.leaseId, ids(10, 10));
    await r1.load(q.leaseId, ids(20, 10));
    const v0 = r0.verify(ids(10, 10), hashes);
    const v1 = r1.verify(ids(20, 10), hashes);
    assert.equal(v0.badSegments, 0, v0.first ?? "");
    assert.equal(v1.badSegments, 0, v1.first ?? "");
    // Each rank consumes once: world_size consumes in all.
    await assert.rejects(r0.load(q.leaseId, ids(10, 10)), grpcCode("FAILED_PRECONDITION"));
  } finally {
    r0.close();
    r1.close();
    await srv.stop();
  }
});

Deno.test("a lease keeps its blocks through eviction pressure; a full pool refuses saves and keeps serving", async () => {
  // 8 MiB pool = 32 blocks of 256 KiB.
  const srv = await startServer(["--pool-size", "8mb"]);
  const sim = hostSim(srv, {
    instanceId: uid("ev"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 64,
  });
  try {
    await sim.register();
    assert.equal(await srv.metric("pegaflow_pool_capacity_bytes"), 8 * 1024 * 1024);
    const A = chainedBlockHashes(syntheticTokens(100, 16 * 8), 16);
    sim.fill(ids(0, 8), A);
    await sim.save(ids(0, 8), A);
    const qa = await sim.query(A, "lease-A");
    assert.ok(qa.kind === "ready" && qa.hits === 8);
    if (qa.kind !== "ready") return;

    // Write 5 more prefixes of 8 blocks: 48 blocks into a 32-block pool.
    for (let p = 0; p < 5; p++) {
      const H = chainedBlockHashes(syntheticTokens(200 + p, 16 * 8), 16);
      sim.fill(ids(8, 8), H);
      const r = await sim.save(ids(8, 8), H);
      assert.equal(r.blocksSaved, 8, `prefix ${p} saved`);
    }
    assert.ok((await srv.metric("pegaflow_cache_evictions_total")) >= 16);
    assert.ok((await srv.metric("pegaflow_pool_used_bytes")) <= 8 * 1024 * 1024);
    assert.equal(
      (await srv.metric("pegaflow_cache_blocks")) * BLOCK_BYTES,
      await srv.metric("pegaflow_pool_used_bytes"),
      "every allocated byte belongs to a sealed block",
    );

    // A survived under its lease: load it into other blocks, byte-exact.
    sim.clear(ids(40, 8));
    await sim.load(qa.leaseId, ids(40, 8));
    const v = sim.verify(ids(40, 8), A);
    assert.equal(v.badSegments, 0, v.first ?? "");

    // Pin the whole pool: lease every resident prefix, then a new save cannot fit.
    const leases: Uint8Array[] = [];
    for (const seed of [100, 202, 203, 204]) {
      const q = await sim.query(
        chainedBlockHashes(syntheticTokens(seed, 16 * 8), 16),
        `pin-${seed}`,
      );
      if (q.kind === "ready" && q.hits > 0) leases.push(q.leaseId);
    }
    assert.equal(
      await srv.metric("pegaflow_cache_evictable_bytes"),
      0,
      "everything resident is pinned",
    );
    const N = chainedBlockHashes(syntheticTokens(999, 16 * 4), 16);
    sim.fill(ids(50, 4), N);
    await assert.rejects(sim.save(ids(50, 4), N), (e: unknown) => {
      const pe = e as PegaflowError;
      return pe.codeName === "RESOURCE_EXHAUSTED" && /pool exhausted/.test(pe.details);
    });
    assert.ok(
      (await srv.metric("pegaflow_save_failures_total", '{reason="pool_exhausted",device="0"}')) >=
        1,
    );
    // The server keeps serving: health, queries, and after release the save fits.
    assert.equal((await srv.client.health()).status, "ok");
    const again = await sim.query(A, "still-there");
    assert.ok(again.kind === "ready" && again.hits === 8);
    if (again.kind === "ready") leases.push(again.leaseId);
    for (const l of leases) await srv.client.release(l);
    const ok = await sim.save(ids(50, 4), N);
    assert.equal(ok.blocksSaved, 4);
    assert.ok((await srv.metric("pegaflow_pool_used_bytes")) <= 8 * 1024 * 1024);
  } finally {
    sim.close();
    await srv.stop();
  }
});

Deno.test("a block saved layer by layer in separate requests is served only once every layer arrived", async () => {
  const srv = await startServer();
  const sim = hostSim(srv, {
    instanceId: uid("layers"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 16,
  });
  try {
    await sim.register();
    const hashes = chainedBlockHashes(syntheticTokens(31, 16 * 4), 16);
    sim.fill(ids(0, 4), hashes);
    const part = (names: string[]) =>
      srv.client.save({
        instanceId: sim.instanceId,
        tpRank: 0,
        ppRank: 0,
        layers: names.map((layerName) => ({ layerName, blockIds: ids(0, 4), blockHashes: hashes })),
      });
    const first = await part(sim.layerNames.slice(0, 2));
    assert.equal(first.bytesCopied, 4 * 2 * 2 * 32768);
    const q0 = await sim.query(hashes, "partial");
    assert.equal(q0.kind === "ready" && q0.hits, 0, "2 of 4 layers: not servable");
    await part(sim.layerNames.slice(2));
    const q = await sim.query(hashes, "complete");
    assert.ok(q.kind === "ready" && q.hits === 4);
    if (q.kind !== "ready") return;
    sim.clear(ids(8, 4));
    await sim.load(q.leaseId, ids(8, 4));
    const v = sim.verify(ids(8, 4), hashes);
    assert.equal(v.badSegments, 0, v.first ?? "");
  } finally {
    sim.close();
    await srv.stop();
  }
});
