/**
 * A query-and-load that names one load state for two ranks is refused before
 * anything is pinned or copied: each rank's copy publishes its own progress
 * words into the block, so one rank's waiter would read the other rank's
 * layers as its own (and run a layer whose bytes have not landed).
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { hostSim, refusedWith, startServer, uid } from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 2 };

Deno.test("a load_into naming one load state for two ranks is INVALID_ARGUMENT and pins nothing", async () => {
  const srv = await startServer();
  const st = LoadState.create();
  const id = uid("dup");
  const ns = uid("ns");
  const ranks = [0, 1].map((tpRank) =>
    hostSim(srv, { instanceId: id, namespace: ns, model: MODEL, numBlocks: 16, tpRank, tpSize: 2 })
  );
  try {
    for (const r of ranks) await r.register();
    const hashes = chainedBlockHashes(syntheticTokens(51, 16 * 4), 16);
    for (const r of ranks) {
      r.fill([0, 1, 2, 3], hashes);
      await r.save([0, 1, 2, 3], hashes);
    }
    const before = st.snapshot();
    await assert.rejects(
      srv.client.queryPrefetch({
        instanceId: id,
        blockHashes: hashes,
        requestId: "r-dup",
        loadInto: {
          blockIds: [8, 9, 10, 11],
          ranks: [0, 1].map((tpRank) => ({ tpRank, ppRank: 0, loadStateShm: st.name })),
        },
      }),
      refusedWith(
        "INVALID_ARGUMENT",
        new RegExp(
          `request "r-dup".*load state "${st.name}" for tp_rank 0 pp_rank 0 and tp_rank 1 pp_rank 0`,
        ),
      ),
    );
    assert.deepEqual(st.snapshot(), before, "the refusal wrote into the load state");
    assert.equal(await srv.metric("pegaflow_leases"), 0, "the refusal pinned the hit");
  } finally {
    st.close();
    for (const r of ranks) r.close();
    await srv.stop();
  }
});
