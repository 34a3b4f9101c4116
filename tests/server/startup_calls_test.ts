/**
 * A call made while the pinned pool is built fails at once (docs/server.md,
 * start-up; docs/python.md "Server restart": in between, queries answer 0
 * hits at once and saves are dropped, never a stall). The addresses are
 * checked before the pool but nothing listens on them until the server
 * serves: a gRPC Health over TCP and over `unix:PATH`, a frame on the local
 * RPC socket `PATH.rpc` and a connection to the peer RPC port are refused
 * (or closed) within a second, not left in a listen backlog for the caller's
 * whole deadline. Once the listening line is printed they are answered. An
 * address another process takes in between still refuses the start (after
 * the pool), naming the flag.
 * Real server process; the calls go out once the first `pool creation
 * progress` line is logged (a 2 GiB pool takes seconds to pre-touch here).
 */
import assert from "node:assert/strict";
import { spawnServer } from "./harness.ts";
import { PegaflowClient } from "../../lib/client/client.ts";

/** Longer than a fast failure may take; shorter than the pool build. */
const FAST_MS = 1_000;
/** The callers' deadline: a call stuck in a backlog ends here. */
const DEADLINE_MS = 4_000;

/** A TCP port on `hostname` that nothing holds right now. */
function freePort(hostname = "127.0.0.1"): number {
  const l = Deno.listen({ hostname, port: 0 });
  const port = l.addr.port;
  l.close();
  return port;
}

/** How a call ended, and after how long. */
interface Outcome {
  ok: boolean;
  ms: number;
  error?: string;
}

async function timed(call: () => Promise<unknown>): Promise<Outcome> {
  const t0 = performance.now();
  try {
    await call();
    return { ok: true, ms: performance.now() - t0 };
  } catch (e) {
    return { ok: false, ms: performance.now() - t0, error: String((e as Error).message ?? e) };
  }
}

/** A gRPC Health call (no local RPC), with the callers' deadline. */
async function grpcHealth(address: string): Promise<void> {
  const c = new PegaflowClient(address, { localRpc: false, deadlineMs: DEADLINE_MS });
  try {
    assert.equal((await c.health()).status, "ok");
  } finally {
    c.close();
  }
}

/**
 * One framed call (local RPC / peer RPC wire: u32 length, u32 call id, u8
 * method, payload) on a raw connection; resolves with the answer's status
 * byte, rejects when the connection is refused, closed or past the deadline.
 */
async function rawFrame(target: Deno.ConnectOptions | Deno.UnixConnectOptions, method: number) {
  const conn = await Deno.connect(target as Deno.ConnectOptions);
  const timer = setTimeout(() => conn.close(), DEADLINE_MS);
  try {
    const frame = new Uint8Array(9);
    const dv = new DataView(frame.buffer);
    dv.setUint32(0, 5, true);
    dv.setUint32(4, 1, true);
    frame[8] = method;
    await conn.write(frame);
    const buf = new Uint8Array(9);
    let got = 0;
    while (got < 9) {
      const n = await conn.read(buf.subarray(got));
      if (n === null) throw new Error("connection closed without an answer");
      got += n;
    }
    return buf[8];
  } finally {
    clearTimeout(timer);
    try {
      conn.close();
    } catch (_e) { /* closed by the timer */ }
  }
}

/** Local RPC method id of Health (lib/local_rpc/wire.ts). */
const HEALTH = 5;

Deno.test("calls during the pool build fail at once on gRPC TCP, gRPC unix, PATH.rpc and the peer RPC port; answered once listening", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-startcall-" });
  const path = `${dir}/grpc.sock`;
  const addr = `127.0.0.1:${freePort()}`;
  const peerPort = freePort("0.0.0.0");
  const srv = spawnServer([
    "--pool-size",
    "2gb",
    "--pool-progress-ms",
    "10",
    "--addr",
    addr,
    "--uds",
    path,
    "--index-redis",
    "redis://127.0.0.1:1",
    "--transport",
    "tcp",
    "--peer-rpc-port",
    String(peerPort),
  ]);
  let ready = false;
  srv.logged("pinned pool ready").then(() => ready = true, () => {});
  try {
    await srv.logged("pool creation progress");
    const [grpcTcp, grpcUnix, localRpc, peerRpc] = await Promise.all([
      timed(() => grpcHealth(addr)),
      timed(() => grpcHealth(`unix:${path}`)),
      timed(() => rawFrame({ transport: "unix", path: `${path}.rpc` }, HEALTH)),
      timed(() => rawFrame({ transport: "tcp", hostname: "127.0.0.1", port: peerPort }, 0)),
    ]);
    const during = { grpcTcp, grpcUnix, localRpc, peerRpc };
    for (const [name, o] of Object.entries(during)) {
      assert.ok(
        !o.ok && o.ms < FAST_MS,
        `${name} ${o.ok ? "was answered" : "failed"} after ${Math.round(o.ms)} ms ` +
          `(pool built by then: ${ready}): ${o.error}`,
      );
    }
    assert.ok(!ready, `the pool was built before the calls ended: ${JSON.stringify(during)}`);

    await srv.logged("serving");
    await grpcHealth(addr);
    await grpcHealth(`unix:${path}`);
    assert.equal(await rawFrame({ transport: "unix", path: `${path}.rpc` }, HEALTH), 0);
    // The peer RPC socket accepts (its calls are peers' business: peer tests).
    (await Deno.connect({ hostname: "127.0.0.1", port: peerPort })).close();
  } finally {
    try {
      srv.kill("SIGTERM");
    } catch (_e) { /* already gone */ }
    await srv.ended();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("an --addr or --uds taken by another process during the pool build refuses the start after it, naming the flag", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-startcall-" });
  const path = `${dir}/grpc.sock`;
  for (const flag of ["--addr", "--uds"] as const) {
    const port = freePort();
    const value = flag === "--addr" ? `127.0.0.1:${port}` : path;
    const srv = spawnServer(["--pool-size", "1gb", "--pool-progress-ms", "10", flag, value]);
    await srv.logged("pool creation progress");
    const other = flag === "--addr"
      ? Deno.listen({ hostname: "127.0.0.1", port })
      : Deno.listen({ transport: "unix", path });
    try {
      const { status, stdout, stderr } = await srv.ended();
      assert.equal(status.code, 1, stderr);
      assert.equal(stdout, "", "no listening line");
      const failed = stderr.split("\n").filter((l) => l.includes('"start-up failed"'));
      assert.equal(failed.length, 1, stderr);
      const error = String(JSON.parse(failed[0]).error);
      assert.ok(error.startsWith(`${flag} ${value}: cannot listen: `), error);
      assert.ok(stderr.includes('"pinned pool ready"'), "refused before the pool was built");
    } finally {
      other.close();
    }
  }
  await Deno.remove(dir, { recursive: true });
});
