/**
 * MLA / TP collapse through a real server: ranks that register with
 * `kv_shared_across_tp` hold the same KV bytes, and the server stores each
 * block once for all TP ranks.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import type { PegaflowError } from "../../lib/client/client.ts";
import { hostSim, startServer, uid } from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };
const TP = 2;

function ids(from: number, n: number): number[] {
  return Array.from({ length: n }, (_, i) => from + i);
}

Deno.test("TP=2 MLA: each rank saves the same bytes, the pool holds them once, each rank loads them byte-exact", async () => {
  const srv = await startServer();
  const instanceId = uid("mla");
  const namespace = uid("ns");
  const ranks = Array.from({ length: TP }, (_, tpRank) =>
    hostSim(srv, {
      instanceId,
      namespace,
      model: MODEL,
      numBlocks: 32,
      tpRank,
      tpSize: TP,
      mla: true,
    }));
  try {
    for (const r of ranks) await r.register();
    const listed = (await (await srv.http_get("/instances")).json()).instances;
    assert.equal(listed[0].kvSharedAcrossTp, true, "GET /instances shows the TP sharing");
    const hashes = chainedBlockHashes(syntheticTokens(11, 16 * 10), 16);
    for (const r of ranks) r.fill(ids(0, 10), hashes);

    const first = await ranks[0].save(ids(0, 10), hashes);
    assert.equal(first.blocksSaved, 10);
    assert.equal(
      await srv.metric("pegaflow_blocks_sealed_total"),
      10,
      "one rank's save completes an MLA block: there is one rank slot",
    );
    const second = await ranks[1].save(ids(0, 10), hashes);
    assert.equal(
      second.blocksSaved,
      0,
      "the other rank's copy of the same bytes is not stored again",
    );
    assert.equal(second.blocksSkipped, 10);
    // Every rank offered 10 blocks of blockBytes; the pool keeps 1/tp of that.
    const offered = TP * 10 * ranks[0].blockBytes;
    assert.equal(await srv.metric("pegaflow_pool_used_bytes"), offered / TP);

    const q = await ranks[1].query(hashes, "q-mla");
    assert.ok(q.kind === "ready" && q.hits === 10, `query: ${JSON.stringify(q)}`);
    if (q.kind !== "ready") return;
    for (let r = 0; r < TP; r++) {
      const target = ids(10 + 10 * r, 10);
      ranks[r].clear(target);
      await ranks[r].load(q.leaseId, target);
      const v = ranks[r].verify(target, hashes);
      assert.equal(v.badSegments, 0, `rank ${r}: ${v.first ?? ""}`);
    }
  } finally {
    for (const r of ranks) r.close();
    await srv.stop();
  }
});

Deno.test("a namespace keeps its TP sharing: a rank that disagrees is refused before anything is mapped", async () => {
  const srv = await startServer();
  const namespace = uid("ns");
  const mla = hostSim(srv, {
    instanceId: uid("mla"),
    namespace,
    model: MODEL,
    numBlocks: 8,
    mla: true,
  });
  const other = hostSim(srv, {
    instanceId: uid("other"),
    namespace,
    model: MODEL,
    numBlocks: 8,
    mla: true,
  });
  try {
    await mla.register();
    await assert.rejects(
      other.register({ kvSharedAcrossTp: false }),
      (e: unknown) =>
        (e as PegaflowError).codeName === "FAILED_PRECONDITION" &&
        /kv_shared_across_tp/.test((e as Error).message),
    );
    assert.equal((await other.register()).topologySealed, true, "the agreeing retry registers");
  } finally {
    mla.close();
    other.close();
    await srv.stop();
  }
});
