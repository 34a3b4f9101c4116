/**
 * SIGTERM/SIGINT while the pinned pool is built (docs/server.md, start-up):
 * the HTTP address is bound before the pool (the others are only probed,
 * their socket files removed), so the signal must close it at once and exit
 * 0, saying so in a log line, with no `--uds` socket file (`PATH`,
 * `PATH.rpc`) left behind for the next start and the engines to trip on. Real server
 * processes; the signal is sent once the first `pool creation progress` line
 * is logged (a 1 GiB pool takes a second or more to pre-touch here), and the
 * server never printing its listening line shows it landed during the start.
 */
import assert from "node:assert/strict";
import { spawnServer } from "./harness.ts";

/** A TCP port on 127.0.0.1 that nothing holds right now. */
function freePort(): number {
  const l = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const port = l.addr.port;
  l.close();
  return port;
}

/** Whether the port can be bound now (nothing holds it). */
function free(port: number): boolean {
  try {
    Deno.listen({ hostname: "127.0.0.1", port }).close();
    return true;
  } catch {
    return false;
  }
}

async function signalDuringPool(signal: "SIGTERM" | "SIGINT", flags: string[]): Promise<void> {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-sig-" });
  const path = `${dir}/grpc.sock`;
  const http = freePort();
  try {
    const srv = spawnServer([
      "--pool-size",
      "1gb",
      "--pool-progress-ms",
      "10",
      "--uds",
      path,
      "--http-addr",
      `127.0.0.1:${http}`,
      ...flags,
    ]);
    await srv.logged("pool creation progress");
    // Meanwhile the HTTP address says the server is starting.
    const health = await fetch(`http://127.0.0.1:${http}/health`);
    assert.equal(health.status, 503);
    assert.equal(health.headers.get("retry-after"), "1");
    assert.equal((await health.json()).status, "starting");
    // The --uds sockets were probed and released: nothing to connect to meanwhile; the
    // path's lock file alone is held (it claims the path for this start, lib/server/uds.ts).
    assert.deepEqual(
      [...Deno.readDirSync(dir)].map((e) => e.name),
      ["grpc.sock.lock"],
      "a socket file is bound",
    );

    srv.kill(signal);
    const { status, stdout, stderr } = await srv.ended();
    assert.equal(stdout, "", `the signal landed after the start; stderr:\n${stderr}`);
    assert.deepEqual(
      { code: status.code, signal: status.signal },
      { code: 0, signal: null },
      `exit status; stderr:\n${stderr}`,
    );
    const left = [...Deno.readDirSync(dir)].map((e) => e.name);
    assert.deepEqual(left, [], "socket files left behind");
    assert.ok(free(http), "the HTTP port is still held");
    const stopped = stderr.split("\n").filter((l) => l.includes('"start-up stopped'));
    assert.equal(stopped.length, 1, stderr);
    assert.match(stopped[0], new RegExp(`${signal} received during start-up`));
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
}

Deno.test("SIGTERM while the pool is built leaves no --uds socket and exits 0", async () => {
  await signalDuringPool("SIGTERM", []);
});

Deno.test("SIGINT while the pool is built, --goaway-guard false: no PATH.rpc left, exit 0", async () => {
  await signalDuringPool("SIGINT", ["--goaway-guard", "false"]);
});
