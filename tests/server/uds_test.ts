/**
 * `--uds PATH`: gRPC on a Unix-domain socket beside the TCP address. A real
 * server child; the TS client dials `unix:PATH`. The socket file is the
 * server's: named on the readiness line, removed at shutdown, taken over from
 * a crashed server (nobody accepts on it), refused while another server
 * accepts on it, never replaced when it is not a socket. The GOAWAY guard
 * covers the socket too (denoland/deno#36788 crashes a server over a Unix
 * socket as over TCP: 6 of 10 runs of the repro with the guard off).
 */
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import { EngineClient } from "../../proto/pegaflow.ts";
import { PegaflowClient } from "../../lib/client/client.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B, SimEngine } from "../../lib/client/sim_engine.ts";
import { runServerToEnd, startServer, uid } from "./harness.ts";
import { MAX_UDS_PATH_BYTES } from "../../lib/server/uds.ts";

function exists(path: string): boolean {
  try {
    Deno.lstatSync(path);
    return true;
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return false;
    throw e;
  }
}

/** A full register → save → query → load → verify round trip through `client`. */
async function roundTrip(client: PegaflowClient, seed: number): Promise<void> {
  const sim = SimEngine.create({
    client,
    instanceId: uid("uds"),
    namespace: uid("ns"),
    model: { ...LLAMA_3_1_8B, numLayers: 2 },
    numBlocks: 32,
    backend: "host",
  });
  try {
    assert.equal((await sim.register()).topologySealed, true);
    const hashes = chainedBlockHashes(syntheticTokens(seed, 16 * 8), 16);
    const src = [0, 2, 4, 6, 8, 10, 12, 14];
    const dst = [31, 30, 29, 28, 27, 26, 25, 24];
    sim.fill(src, hashes);
    assert.equal((await sim.save(src, hashes)).blocksSaved, 8);
    const q = await sim.query(hashes, uid("q"));
    assert.ok(q.kind === "ready" && q.hits === 8, JSON.stringify(q));
    sim.clear(dst);
    assert.equal((await sim.load(q.leaseId, dst)).state, 1);
    const v = sim.verify(dst, hashes);
    assert.equal(v.badSegments, 0, v.first ?? "");
    await client.unregisterContext(sim.instanceId);
  } finally {
    sim.close();
  }
}

Deno.test("over --uds the TS client does a full round trip; the socket is announced and removed at shutdown", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-uds-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path]);
  let stopped = false;
  try {
    assert.equal(srv.uds, path, "the readiness line names the socket");
    assert.ok(Deno.lstatSync(path).isSocket);
    // grpc-js's own socket behind the GOAWAY guard: beside it, for the server's user alone.
    const up = Deno.lstatSync(`${path}.up`);
    assert.ok(up.isSocket);
    assert.equal(up.mode! & 0o777, 0o600);
    const viaUds = new PegaflowClient(`unix:${path}`);
    try {
      assert.equal((await viaUds.health()).status, "ok");
      await roundTrip(viaUds, 11);
    } finally {
      viaUds.close();
    }
    // The TCP address still serves beside it.
    await roundTrip(srv.client, 12);
    assert.ok(
      await srv.metric("pegaflow_rpc_requests_total", '{method="Load",status="OK"}') >= 2,
    );
    await srv.stop();
    stopped = true;
    assert.equal((await srv.status).code, 0);
    assert.ok(!exists(path), "the socket file is removed at shutdown");
    assert.ok(!exists(`${path}.up`), "and so is the guard's upstream socket");
  } finally {
    if (!stopped) await srv.stop();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("a crashed server's socket and lock files are taken over; a live server's path is refused, naming it", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-uds-" });
  const path = `${dir}/grpc.sock`;
  try {
    const crashed = await startServer(["--uds", path]);
    crashed.client.close();
    Deno.kill(crashed.pid, "SIGKILL");
    await crashed.status;
    assert.ok(Deno.lstatSync(path).isSocket, "SIGKILL leaves the socket file behind");
    assert.ok(Deno.lstatSync(`${path}.up`).isSocket, "and the guard's upstream socket");
    // Its lock file stays too (the kernel dropped the lock itself): it blocks nobody.
    assert.equal(Deno.readTextFileSync(`${path}.lock`), `${crashed.pid}\n`, "the lock file stays");

    const srv = await startServer(["--uds", path]);
    try {
      assert.ok(
        srv.logs().some((l) => l.includes("removed a stale gRPC socket file") && l.includes(path)),
      );
      assert.equal(Deno.readTextFileSync(`${path}.lock`), `${srv.pid}\n`, "it names its holder");
      const c = new PegaflowClient(`unix:${path}`);
      try {
        await roundTrip(c, 21);
      } finally {
        c.close();
      }

      // While it serves, a second server on the same path is refused and leaves it alone.
      const second = await runServerToEnd(["--uds", path]);
      assert.notEqual(second.code, 0);
      assert.match(second.stderr, new RegExp(`--uds ${path}: .*${path} is in use`));
      const again = new PegaflowClient(`unix:${path}`);
      try {
        assert.equal((await again.health()).status, "ok", "the first server still owns the path");
      } finally {
        again.close();
      }
    } finally {
      await srv.stop();
    }
    assert.deepEqual([...Deno.readDirSync(dir)].map((e) => e.name), [], "files left behind");
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("a --uds path that is not a socket is refused and left untouched; a path too long is a usage error", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-uds-" });
  const path = `${dir}/not-a-socket`;
  try {
    await Deno.writeTextFile(path, "keep me");
    const r = await runServerToEnd(["--uds", path]);
    assert.notEqual(r.code, 0);
    assert.match(r.stderr, new RegExp(`${path} exists and is not a socket`));
    assert.equal(await Deno.readTextFile(path), "keep me");

    // A directory that does not exist is named (not the relay socket beside the path).
    const lost = await runServerToEnd(["--uds", `${dir}/no-such-dir/x.sock`]);
    assert.notEqual(lost.code, 0);
    assert.match(
      lost.stderr,
      new RegExp(`--uds ${dir}/no-such-dir/x.sock.*directory ${dir}/no-such-dir does not exist`),
    );
    assert.doesNotMatch(lost.stderr, /\.up\b/);

    const long = await runServerToEnd(["--uds", `${dir}/${"x".repeat(120)}.sock`]);
    assert.equal(long.code, 2, long.stderr);
    assert.match(long.stderr, /--uds/);
    assert.match(long.stderr, new RegExp(`at most ${MAX_UDS_PATH_BYTES}\\b`));
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("a client that closes gracefully after many RPCs over the socket leaves the server alive", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-uds-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path]);
  try {
    for (let round = 0; round < 2; round++) {
      // Its own subchannel pool: closing the channel closes its connection (GOAWAY).
      const c = new EngineClient(`unix:${path}`, grpc.credentials.createInsecure(), {
        "grpc.use_local_subchannel_pool": 1,
      });
      for (let i = 0; i < 200; i++) {
        await new Promise((res, rej) => c.health({}, (e, r) => e ? rej(e) : res(r)));
      }
      c.close();
      let timer: ReturnType<typeof setTimeout> | undefined;
      const st = await Promise.race([
        srv.status,
        new Promise<null>((r) => timer = setTimeout(() => r(null), 500)),
      ]);
      clearTimeout(timer);
      assert.equal(st, null, `the server died after round ${round}: ${JSON.stringify(st)}`);
    }
    assert.equal((await srv.client.health()).status, "ok");
    assert.ok(await srv.metric("pegaflow_grpc_goaway_dropped_total") >= 2);
  } finally {
    await srv.stop();
    await Deno.remove(dir, { recursive: true });
  }
});
