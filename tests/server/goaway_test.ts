/**
 * Regression test for denoland/deno#36788: a client that makes ~100 or more
 * RPCs on one HTTP/2 connection and then closes its channel gracefully
 * (GOAWAY) used to abort the server inside nghttp2 (exit 134 / 139) in
 * 7–8 of 10 tries on Deno 2.9.6 (tests/server/fixtures/goaway_repro.ts).
 * Here several clients, on Deno and on Node, do exactly that against ONE
 * server while another engine's registration and saved blocks sit in it;
 * the server must survive every close and still serve that engine's cache.
 * Without the GOAWAY guard (`PEGAFLOW_GOAWAY_GUARD=false` in the environment
 * of this test) it fails: the server dies after one of the first closes.
 */
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import { EngineClient } from "../../proto/pegaflow.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { hostSim, type ServerProc, startServer, uid } from "./harness.ts";
import { stageNodeClient } from "./fixtures/node_stage.ts";

/** RPCs per connection before the graceful close: well past the ~100 that trigger the bug. */
const RPCS_PER_CONNECTION = 200;
/** Fresh servers, each closed on by one Deno and one Node client. */
const ROUNDS = 3;
/** Time for a crash inside the server to surface after a close (the repro waits as long). */
const SETTLE_MS = 500;

/** Fails the test if the server process has exited within SETTLE_MS. */
async function assertAlive(srv: ServerProc, after: string): Promise<void> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const st = await Promise.race([
    srv.status,
    new Promise<null>((r) => timer = setTimeout(() => r(null), SETTLE_MS)),
  ]);
  clearTimeout(timer);
  assert.equal(
    st,
    null,
    st ? `the server died after ${after} (code ${st.code}, signal ${st.signal})` : "",
  );
}

function nodeClientDir(): Promise<string> {
  return stageNodeClient("node_goaway_client.mjs", "pegaflow-goaway-");
}

/** Closes one Deno channel gracefully after RPCS_PER_CONNECTION Health calls on its own connection. */
async function denoClientRound(addr: string): Promise<void> {
  // A channel with its own subchannel pool owns its connection: closing it
  // ends that connection (grpc-js would otherwise share one connection among
  // all channels to the same address, the bystander's included).
  const c = new EngineClient(addr, grpc.credentials.createInsecure(), {
    "grpc.use_local_subchannel_pool": 1,
  });
  for (let i = 0; i < RPCS_PER_CONNECTION; i++) {
    await new Promise((res, rej) => c.health({}, (e, r) => e ? rej(e) : res(r)));
  }
  c.close(); // graceful: GOAWAY
}

/** Runs the Node fixture: RPCS_PER_CONNECTION Health calls, then a graceful close. */
async function nodeClientRound(dir: string, addr: string): Promise<void> {
  const out = await new Deno.Command("node", {
    args: ["--preserve-symlinks", `${dir}/client.mjs`, addr, String(RPCS_PER_CONNECTION)],
    cwd: dir,
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
  assert.deepEqual(JSON.parse(new TextDecoder().decode(out.stdout)), { ok: RPCS_PER_CONNECTION });
}

Deno.test("clients that close gracefully after many RPCs leave the server and its cache alive", async () => {
  const dir = await nodeClientDir();
  const dropped: number[] = [];
  try {
    // One fresh server per round: an unguarded server died at its first such
    // close ~70 % of the time (later closes on a survivor crashed less).
    for (let round = 0; round < ROUNDS; round++) {
      const srv = await startServer();
      const sim = hostSim(srv, {
        instanceId: uid("bystander"),
        namespace: uid("ns"),
        model: { ...LLAMA_3_1_8B, numLayers: 2 },
        numBlocks: 8,
      });
      try {
        await sim.register();
        const hashes = chainedBlockHashes(syntheticTokens(5 + round, 16 * 3), 16);
        sim.fill([0, 1, 2], hashes);
        await sim.save([0, 1, 2], hashes);

        await denoClientRound(srv.grpc);
        await assertAlive(
          srv,
          `round ${round}: a Deno client closed after ${RPCS_PER_CONNECTION} RPCs`,
        );
        await nodeClientRound(dir, srv.grpc);
        await assertAlive(
          srv,
          `round ${round}: a Node client closed after ${RPCS_PER_CONNECTION} RPCs`,
        );

        // Same process, same state: the bystander's instance and blocks are still there.
        const q = await sim.query(hashes, uid("after-closes"));
        assert.deepEqual(q.kind === "ready" && q.hits, 3);
        dropped.push(await srv.metric("pegaflow_grpc_goaway_dropped_total"));
      } finally {
        sim.close();
        await srv.stop();
      }
    }
    // Every close really was graceful: the guard saw (and dropped) each client's GOAWAY.
    assert.ok(dropped.every((n) => n >= 2), `GOAWAY frames dropped per round: ${dropped}`);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
