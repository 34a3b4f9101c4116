/**
 * Refusals carry structured fields: the server's "rpc refused" log line
 * names the instance, ranks, layer, block id and request id of a bad
 * request as fields, not only inside the message text.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import type { PegaflowError } from "../../lib/client/client.ts";
import { hostSim, startServer, uid } from "./harness.ts";

Deno.test("a refused Save logs the instance, rank, layer, block id and request id as fields", async () => {
  const srv = await startServer();
  const instanceId = uid("fields");
  const sim = hostSim(srv, {
    instanceId,
    namespace: uid("ns"),
    model: { ...LLAMA_3_1_8B, numLayers: 2 },
    numBlocks: 8,
  });
  try {
    await sim.register();
    const hashes = chainedBlockHashes(syntheticTokens(3, 16 * 2), 16);
    await assert.rejects(
      srv.client.save({
        instanceId,
        tpRank: 0,
        ppRank: 0,
        blockIds: [1, 8],
        blockHashes: hashes,
        requestId: "req-bad-id",
      }),
      (e: unknown) => (e as PegaflowError).codeName === "INVALID_ARGUMENT",
    );
    const line = srv.logs().map((l) => JSON.parse(l)).find((l) =>
      l.msg === "rpc refused" && l.method === "Save"
    );
    assert.ok(line, `no "rpc refused" line for the Save:\n${srv.logs().join("\n")}`);
    assert.equal(line.code, "INVALID_ARGUMENT");
    assert.equal(line.instance, instanceId);
    assert.equal(line.tp_rank, 0);
    assert.equal(line.pp_rank, 0);
    assert.equal(line.layer, sim.layerNames[0]);
    assert.equal(line.block_id, 8);
    assert.equal(line.request, "req-bad-id");
  } finally {
    sim.close();
    await srv.stop();
  }
});
