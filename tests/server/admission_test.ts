/**
 * With `--enable-lfu-admission`, a Save whose new blocks TinyLFU turns away
 * says so: SaveResponse.blocks_not_admitted and
 * pegaflow_admission_rejections_total count them (before, the engine got OK
 * with 0 saved, 0 skipped, 0 refused and could not tell).
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { hostSim, startServer, uid } from "./harness.ts";

// 2 layers x K/V x 32 KiB = 128 KiB per block: a 4 MiB pool holds 32 blocks.
const MODEL = { ...LLAMA_3_1_8B, numLayers: 2 };
const POOL_BLOCKS = 32;

Deno.test("blocks TinyLFU does not admit are reported in SaveResponse and the admission metric", async () => {
  const srv = await startServer(["--pool-size", "4mb", "--enable-lfu-admission"]);
  const e = hostSim(srv, {
    instanceId: uid("lfu"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: POOL_BLOCKS,
  });
  try {
    await e.register();
    const ids = Array.from({ length: POOL_BLOCKS }, (_, i) => i);
    // A popular prefix fills the pool and is asked for again and again.
    const hot = chainedBlockHashes(syntheticTokens(41, 16 * POOL_BLOCKS), 16);
    e.fill(ids, hot);
    const first = await e.save(ids, hot);
    assert.equal(first.blocksSaved, POOL_BLOCKS);
    assert.equal(first.blocksNotAdmitted, 0);
    for (let i = 0; i < 4; i++) {
      const q = await e.query(hot, `hot-${i}`);
      assert.ok(q.kind === "ready" && q.hits === POOL_BLOCKS);
      if (q.kind === "ready") await srv.client.release(q.leaseId);
    }
    const before = await srv.metric("pegaflow_admission_rejections_total");

    // A one-off prefix would have to evict the popular one: turned away, and said so.
    const cold = chainedBlockHashes(syntheticTokens(42, 16 * 4), 16);
    e.fill([0, 1, 2, 3], cold);
    const r = await e.save([0, 1, 2, 3], cold);
    assert.deepEqual(
      { saved: r.blocksSaved, skipped: r.blocksSkipped, refused: r.blocksRefused },
      { saved: 0, skipped: 0, refused: 0 },
    );
    assert.equal(r.blocksNotAdmitted, 4);
    assert.equal(await srv.metric("pegaflow_admission_rejections_total"), before + 4);
    const q = await e.query(hot, "hot-after");
    assert.ok(q.kind === "ready" && q.hits === POOL_BLOCKS, "the popular prefix stayed");
    if (q.kind === "ready") await srv.client.release(q.leaseId);
  } finally {
    e.close();
    await srv.stop();
  }
});
