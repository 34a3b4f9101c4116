/**
 * The tier port's metrics in the real server (child process, real gRPC,
 * host backend, SSD tier on a temp dir): the depth gauges of the
 * write-behind stages exist and drain to 0, the SSD tier reports health and
 * capacity, and a query whose prefix came back from SSD is attributed to it.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { MODEL, queryUntilReady, until, withSsdServer } from "./_server.ts";

const BLOCKS = 6;

Deno.test("server: write-behind stage depths, SSD tier health and per-tier query attribution are on /metrics", async () => {
  const hashes = chainedBlockHashes(syntheticTokens(31, 16 * BLOCKS), 16);
  const ids = Array.from({ length: BLOCKS }, (_, i) => 1 + i);
  await withSsdServer("pf-ssd-tier-metrics-", async (s, eng) => {
    assert.equal(await s.metric("pegaflow_tier_up", '{tier="ssd"}'), 1);
    assert.ok((await s.metric("pegaflow_tier_capacity_bytes", '{tier="ssd"}')) > 0);
    assert.equal(await s.metric("pegaflow_tier_used_bytes", '{tier="ssd"}'), 0);
    eng.fill(ids, hashes);
    assert.equal((await eng.save(ids, hashes)).blocksSaved, BLOCKS);
    await until(
      "write-behind",
      async () => (await s.metric("pegaflow_ssd_write_blocks_total")) === BLOCKS,
    );
    for (const queue of ["tier.admit", "ssd.write", "ssd.prefetch"]) {
      assert.equal(await s.metric("pegaflow_queue_depth", `{queue="${queue}"}`), 0, queue);
    }
    assert.equal(await s.metric("pegaflow_tier_admit_dropped_blocks_total"), 0);
    // K and V of every layer: the SSD holds each block's payload once.
    const blockBytes = MODEL.numLayers * 2 * MODEL.kvHeads * MODEL.headDim * MODEL.blockTokens *
      MODEL.dtypeBytes;
    assert.equal(await s.metric("pegaflow_tier_used_bytes", '{tier="ssd"}'), BLOCKS * blockBytes);
    assert.equal((await s.http_post("/cache/memory/cleanup")).status, 200);
    const r = await queryUntilReady(eng, hashes, "tier-attribution");
    assert.equal(r.hits, BLOCKS);
    assert.equal(
      await s.metric("pegaflow_tier_queries_total", '{tier="ssd",answer="loading"}'),
      1,
      "one fetch started for the request",
    );
    assert.equal(await s.metric("pegaflow_tier_queries_total", '{tier="ssd",answer="ready"}'), 1);
  });
});

Deno.test("server: a query over the hash limit is refused before any tier counts it or starts a read", async () => {
  await withSsdServer("pf-ssd-tier-limit-", async (srv, eng) => {
    const tooMany = chainedBlockHashes(syntheticTokens(32, 65_537), 1);
    await assert.rejects(eng.query(tooMany, "over-limit"), /INVALID_ARGUMENT.*65537 block hashes/);
    // A series never counted is absent (NaN): 0.
    const count = async (name: string, labels: string) => (await srv.metric(name, labels)) || 0;
    assert.equal(
      await count("pegaflow_tier_queries_total", '{tier="ssd",answer="miss_not-held"}'),
      0,
    );
    assert.equal(await count("pegaflow_query_source_total", '{source="miss"}'), 0);
  });
});
