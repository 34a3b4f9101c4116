/**
 * "Query and load" over real gRPC against a server child: a QueryPrefetch
 * that names targets (`loadInto`) starts every rank's load of the hit before
 * it answers; a bad `loadInto` is refused before anything is pinned; a rank
 * whose load is refused is named in the answer, no rank copies (every load
 * state fails), and the lease is given back.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { STATE_OK } from "../../lib/engine/load_state.ts";
import {
  hostSim,
  metricBecomes,
  refusedWith,
  type ServerProc,
  startServer,
  uid,
} from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 3 };

/** A TP-2 instance whose two ranks saved the same 4 blocks (ids 0..3). */
async function savedPair(srv: ServerProc, seed: number) {
  const id = uid("ql");
  const ns = uid("ns");
  const ranks = [0, 1].map((tpRank) =>
    hostSim(srv, { instanceId: id, namespace: ns, model: MODEL, numBlocks: 16, tpRank, tpSize: 2 })
  );
  for (const r of ranks) await r.register();
  const hashes = chainedBlockHashes(syntheticTokens(seed, 16 * 5), 16);
  for (const r of ranks) {
    r.fill([0, 1, 2, 3], hashes.slice(0, 4));
    await r.save([0, 1, 2, 3], hashes.slice(0, 4));
  }
  return { id, ranks, hashes };
}

Deno.test("a query with loadInto loads every rank's hit byte-exact and spends the lease", async () => {
  const srv = await startServer();
  const states = [LoadState.create(), LoadState.create()];
  const { id, ranks, hashes } = await savedPair(srv, 41);
  try {
    for (const r of ranks) r.clear([8, 9, 10, 11, 12]);
    // 5 hashes asked, 4 held: the hit loads into the 4 leading targets.
    const q = await srv.client.queryPrefetch({
      instanceId: id,
      blockHashes: hashes,
      requestId: "r-ql",
      loadInto: {
        blockIds: [8, 9, 10, 11, 12],
        ranks: [1, 0].map((tpRank) => ({ tpRank, ppRank: 0, loadStateShm: states[tpRank].name })),
      },
    });
    assert.ok(q.kind === "ready");
    if (q.kind !== "ready") return;
    assert.equal(q.hits, 4);
    assert.deepEqual(q.loads, [
      { tpRank: 1, ppRank: 0, error: "", numBlocks: 4 },
      { tpRank: 0, ppRank: 0, error: "", numBlocks: 4 },
    ]);
    for (const [i, r] of ranks.entries()) {
      assert.equal(await states[i].waitAll(), STATE_OK, `rank ${i}`);
      const v = r.verify([8, 9, 10, 11], hashes.slice(0, 4));
      assert.equal(v.badSegments, 0, v.first ?? "");
      assert.equal(
        r.verify([12], hashes.slice(4, 5)).badSegments > 0,
        true,
        "the miss was not written",
      );
    }
    await metricBecomes(srv, "pegaflow_pinned_blocks", 0);
    assert.equal(await srv.metric("pegaflow_leases"), 0, "both ranks spent their share");
    // A miss loads nothing and leaves the load states as they were.
    const fresh = chainedBlockHashes(syntheticTokens(42, 16 * 2), 16);
    for (const st of states) st.rearm();
    const miss = await srv.client.queryPrefetch({
      instanceId: id,
      blockHashes: fresh,
      requestId: "r-miss",
      loadInto: {
        blockIds: [8, 9],
        ranks: [0, 1].map((tpRank) => ({ tpRank, ppRank: 0, loadStateShm: states[tpRank].name })),
      },
    });
    assert.ok(miss.kind === "ready" && miss.hits === 0 && miss.loads.length === 0);
    for (const st of states) assert.equal(st.snapshot().state, 0, "untouched by a miss");
  } finally {
    for (const st of states) st.close();
    for (const r of ranks) r.close();
    await srv.stop();
  }
});

Deno.test("a bad loadInto is refused before anything is pinned, naming what was wrong", async () => {
  const srv = await startServer();
  const states = [LoadState.create(), LoadState.create()];
  const { id, ranks, hashes } = await savedPair(srv, 43);
  try {
    const ask = (loadInto: { blockIds: number[]; ranks: number[][] }) =>
      srv.client.queryPrefetch({
        instanceId: id,
        blockHashes: hashes.slice(0, 4),
        requestId: "r-bad",
        loadInto: {
          blockIds: loadInto.blockIds,
          ranks: loadInto.ranks.map(([tpRank, ppRank]) => ({
            tpRank,
            ppRank,
            loadStateShm: states[tpRank % 2].name,
          })),
        },
      });
    const both = [[0, 0], [1, 0]];
    await assert.rejects(
      ask({ blockIds: [8, 9, 10], ranks: both }),
      refusedWith("INVALID_ARGUMENT", /request "r-bad".*names 3 targets for 4 hashes/),
    );
    await assert.rejects(
      ask({ blockIds: [8, 9, 10, 11], ranks: [[0, 0]] }),
      refusedWith("INVALID_ARGUMENT", /names 1 ranks; every rank of the instance once \(2\)/),
    );
    await assert.rejects(
      ask({ blockIds: [8, 9, 10, 11], ranks: [[0, 0], [0, 0]] }),
      refusedWith("INVALID_ARGUMENT", /tp_rank 0 pp_rank 0 twice/),
    );
    await assert.rejects(
      ask({ blockIds: [8, 9, 10, 11], ranks: [[0, 0], [2, 0]] }),
      refusedWith("INVALID_ARGUMENT", /tp_rank 2 pp_rank 0 \(tp_size 2, pp_size 1\)/),
    );
    assert.equal(await srv.metric("pegaflow_leases"), 0, "no refusal pinned anything");
    assert.equal(await srv.metric("pegaflow_pinned_blocks"), 0);
    for (const st of states) {
      assert.equal(st.snapshot().state, 0, "no refusal touched a load state");
    }
  } finally {
    for (const st of states) st.close();
    for (const r of ranks) r.close();
    await srv.stop();
  }
});

Deno.test("a rank whose load is refused is named in the answer, every rank's state fails, and the lease goes back", async () => {
  const srv = await startServer();
  const st0 = LoadState.create();
  const { id, ranks, hashes } = await savedPair(srv, 44);
  try {
    // Rank 1's load state does not exist: the server cannot open it.
    const q = await srv.client.queryPrefetch({
      instanceId: id,
      blockHashes: hashes.slice(0, 4),
      requestId: "r-half",
      loadInto: {
        blockIds: [8, 9, 10, 11],
        ranks: [
          { tpRank: 0, ppRank: 0, loadStateShm: st0.name },
          { tpRank: 1, ppRank: 0, loadStateShm: "/pegaflow-no-such-load-state" },
        ],
      },
    });
    assert.ok(q.kind === "ready" && q.hits === 4);
    if (q.kind !== "ready") return;
    assert.equal(q.loads[0].error, "");
    assert.match(q.loads[1].error, /cannot open load state "\/pegaflow-no-such-load-state"/);
    assert.notEqual(
      await st0.waitAll(),
      STATE_OK,
      "all or nothing: the other rank's load was dropped",
    );
    await metricBecomes(srv, "pegaflow_pinned_blocks", 0);
    assert.equal(await srv.metric("pegaflow_leases"), 0, "rank 1's unspent share was given back");

    // Targets past the cache: every rank refused, each state marked failed.
    const st1 = LoadState.create();
    try {
      st0.rearm();
      const bad = await srv.client.queryPrefetch({
        instanceId: id,
        blockHashes: hashes.slice(0, 4),
        requestId: "r-past",
        loadInto: {
          blockIds: [8, 9, 10, 16],
          ranks: [{ tpRank: 0, ppRank: 0, loadStateShm: st0.name }, {
            tpRank: 1,
            ppRank: 0,
            loadStateShm: st1.name,
          }],
        },
      });
      assert.ok(bad.kind === "ready" && bad.hits === 4);
      if (bad.kind !== "ready") return;
      for (const l of bad.loads) assert.match(l.error, /target block id 16 >= num_blocks 16/);
      for (const st of [st0, st1]) assert.notEqual(await st.waitAll(), STATE_OK);
      await metricBecomes(srv, "pegaflow_pinned_blocks", 0);
      assert.equal(await srv.metric("pegaflow_leases"), 0);
    } finally {
      st1.close();
    }
  } finally {
    st0.close();
    for (const r of ranks) r.close();
    await srv.stop();
  }
});
