/**
 * A request id past MAX_REQUEST_ID_CHARS is refused INVALID_ARGUMENT, naming
 * the field, its length and the limit, by every RPC that carries one (Save,
 * QueryPrefetch, Load), over gRPC and over the local RPC socket alike; the
 * server keeps serving and no log line carries the id whole. An id at the
 * limit is served.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { PegaflowClient } from "../../lib/client/client.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { MAX_REQUEST_ID_CHARS } from "../../lib/limits.ts";
import { hostSim, refusedWith, startServer, uid } from "./harness.ts";

Deno.test("a request_id past MAX_REQUEST_ID_CHARS is INVALID_ARGUMENT on Save, QueryPrefetch and Load, over gRPC and the local RPC socket", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-rid-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path]);
  const local = new PegaflowClient(`unix:${path}`);
  const sim = hostSim(srv, {
    instanceId: uid("rid"),
    namespace: uid("ns"),
    model: { ...LLAMA_3_1_8B, numLayers: 2 },
    numBlocks: 8,
  });
  const st = LoadState.create();
  try {
    await sim.register();
    assert.ok(Deno.lstatSync(`${path}.rpc`).isSocket);
    const hashes = chainedBlockHashes(syntheticTokens(3, 16 * 2), 16);
    sim.fill([0, 1], hashes);
    const rank = { instanceId: sim.instanceId, tpRank: 0, ppRank: 0 };
    const atLimit = "a".repeat(MAX_REQUEST_ID_CHARS);
    const saved = await local.save({
      ...rank,
      blockIds: [0, 1],
      blockHashes: hashes,
      requestId: atLimit,
    });
    assert.equal(saved.blocksSaved, 2);
    const long = "r".repeat(300_000);
    const refused = refusedWith(
      "INVALID_ARGUMENT",
      new RegExp(
        `request_id "r+\\.\\.\\." is ${long.length} characters; at most ${MAX_REQUEST_ID_CHARS}`,
      ),
    );
    for (const c of [local, srv.client]) {
      await assert.rejects(
        c.save({ ...rank, blockIds: [0, 1], blockHashes: hashes, requestId: long }),
        refused,
      );
      await assert.rejects(
        c.queryPrefetch({ instanceId: sim.instanceId, blockHashes: hashes, requestId: long }),
        refused,
      );
      await assert.rejects(
        c.load({
          ...rank,
          leaseId: new Uint8Array(16),
          blockIds: [4, 5],
          loadStateShm: st.name,
          requestId: long,
        }),
        refused,
      );
    }
    assert.equal(await srv.metric("pegaflow_leases"), 0, "a refused query took a lease");
    const q = await local.queryPrefetch({
      instanceId: sim.instanceId,
      blockHashes: hashes,
      requestId: atLimit,
    });
    assert.ok(q.kind === "ready" && q.hits === 2);
    if (q.kind === "ready") await local.release(q.leaseId);
    const whole = srv.logs().filter((l) => l.includes(long.slice(0, 2048)));
    assert.deepEqual(whole.map((l) => l.slice(0, 200)), [], "a log line carries the id whole");
  } finally {
    st.close();
    sim.close();
    local.close();
    await srv.stop();
  }
  await Deno.remove(dir, { recursive: true });
});
