/**
 * Interop: a grpc-js client running on Node (not Deno) talks to the server.
 * Node resolves @grpc/grpc-js from a temporary node_modules whose entries
 * link into Deno's npm cache (no extra download); --preserve-symlinks keeps
 * grpc-js's own dependency lookups inside that folder.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { hostSim, startServer, uid } from "./harness.ts";
import { PROTOCOL_VERSION } from "../../lib/client/client.ts";
import { stageNodeClient } from "./fixtures/node_stage.ts";

function hex(b: Uint8Array): string {
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

Deno.test("a grpc-js client on Node queries the server and gets real statuses", async () => {
  const dir = await stageNodeClient("node_client.mjs", "pegaflow-node-");
  const srv = await startServer();
  const sim = hostSim(srv, {
    instanceId: uid("node"),
    namespace: uid("ns"),
    model: { ...LLAMA_3_1_8B, numLayers: 2 },
    numBlocks: 8,
  });
  try {
    await sim.register();
    const hashes = chainedBlockHashes(syntheticTokens(11, 16 * 3), 16);
    sim.fill([0, 1, 2], hashes);
    await sim.save([0, 1, 2], hashes);

    const out = await new Deno.Command("node", {
      args: [
        "--preserve-symlinks",
        `${dir}/client.mjs`,
        srv.grpc,
        sim.instanceId,
        hashes.map(hex).join(","),
      ],
      cwd: dir,
      stdout: "piped",
      stderr: "piped",
    }).output();
    const stderr = new TextDecoder().decode(out.stderr);
    assert.equal(out.code, 0, stderr);
    const r = JSON.parse(new TextDecoder().decode(out.stdout));
    assert.match(r.node, /^v\d+/);
    assert.deepEqual(r.health, { status: "ok", version: PROTOCOL_VERSION, backend: "host" });
    assert.deepEqual(r.query, { hits: 3, leaseBytes: 16 });
    assert.equal(r.badRegister.code, 9 /* FAILED_PRECONDITION */);
    assert.match(r.badRegister.details, /client version "old-version"/);
  } finally {
    sim.close();
    await srv.stop();
    await Deno.remove(dir, { recursive: true });
  }
});
