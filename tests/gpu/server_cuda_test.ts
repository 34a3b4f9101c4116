/**
 * GPU suite, KV server part (`deno task test:gpu`): the host round trip on
 * the cuda backend — the engine's KV in GPU memory exported by CUDA IPC, the
 * server a separate process importing it — for every copy path the server
 * can be forced to. Needs an NVIDIA GPU.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B, SimEngine } from "../../lib/client/sim_engine.ts";
import { startServer, uid } from "../server/harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 8 };

for (const path of ["auto", "kernel", "dma"]) {
  Deno.test(`cuda: a prefix saved from GPU memory loads byte-exact into other blocks (--transfer-path ${path})`, async () => {
    const srv = await startServer([
      "--backend",
      "cuda",
      "--pool-size",
      "1gb",
      "--transfer-path",
      path,
    ]);
    const sim = SimEngine.create({
      client: srv.client,
      instanceId: uid("gpu"),
      namespace: uid("ns"),
      model: MODEL,
      numBlocks: 256,
      backend: "cuda",
    });
    try {
      assert.equal((await srv.client.health()).backend, "cuda");
      await sim.register();
      const hashes = chainedBlockHashes(syntheticTokens(77, 16 * 100), 16);
      const src = Array.from({ length: 100 }, (_, i) => i * 2);
      const dst = Array.from({ length: 100 }, (_, i) => 255 - i);
      sim.fill(src, hashes);
      const s = await sim.save(src, hashes);
      assert.equal(s.blocksSaved, 100);
      const q = await sim.query(hashes, "gpu-1");
      assert.ok(q.kind === "ready" && q.hits === 100);
      if (q.kind !== "ready") return;
      sim.clear(dst);
      const l = await sim.load(q.leaseId, dst);
      assert.equal(l.state, 1);
      const v = sim.verify(dst, hashes);
      assert.equal(v.badSegments, 0, v.first ?? "");
      await srv.client.unregisterContext(sim.instanceId);
    } finally {
      sim.close();
      await srv.stop();
    }
  });
}
