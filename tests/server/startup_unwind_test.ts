/**
 * A start that fails after its listeners are bound closes everything it
 * opened before the error goes up (docs/server.md, start-up): the block
 * index opens last (it needs the bound gRPC address). A `--index-redis` URL
 * whose password does not percent-decode (`redis://:%zz@host`) once passed
 * the flag's check and failed the start there with every socket, the
 * transfer endpoint and the store's collector timer left open (`URI
 * malformed`, naming no flag; the `--uds` socket files left behind for the
 * next start to trip on). The flags refuse that URL now (exit 2, tests/index/
 * flags_test.ts), so the start is given a configuration past them that the
 * index refuses when it opens: any failure there must unwind the same. In
 * process, where Deno's leak sanitizer fails the test on a timer or a
 * resource left open.
 */
import assert from "node:assert/strict";
import { startServer } from "../../lib/server/server.ts";
import { parseServeArgs, type ServeConfig } from "../../lib/server/config.ts";
import { Logger } from "../../lib/log.ts";

/** A URL the block index refuses when it opens (the flags refuse it too: set past them). */
const BAD_REDIS = "redis://:%zz@127.0.0.1:1";
/** The refusal: the flag, where it points (no credentials), and why. */
const REFUSED = new RegExp(
  "^--index-redis redis://127\\.0\\.0\\.1:1: cannot open the block index: .*percent-encoded",
);

/** A TCP port on `hostname` that nothing holds right now. */
function freePort(hostname = "127.0.0.1"): number {
  const l = Deno.listen({ hostname, port: 0 });
  const port = l.addr.port;
  l.close();
  return port;
}

/** Whether a TCP port on `hostname` can be bound now (nothing holds it). */
function free(port: number, hostname = "127.0.0.1"): boolean {
  try {
    Deno.listen({ hostname, port }).close();
    return true;
  } catch {
    return false;
  }
}

/** Flags of a start that binds every listener (the index's URL is swapped in after parsing). */
function listenerFlags(path: string, ports: { addr: number; peer: number; xfer: number }) {
  return [
    ...["--addr", `127.0.0.1:${ports.addr}`, "--uds", path],
    ...["--index-redis", "redis://127.0.0.1:1", "--transport", "tcp"],
    ...["--peer-rpc-port", `${ports.peer}`, "--xfer-port", `${ports.xfer}`],
  ];
}

/** The server's configuration (host backend, a 64 MiB pool), its index given {@link BAD_REDIS}. */
function config(flags: string[]): ServeConfig {
  const r = parseServeArgs([
    ...["--backend", "host", "--pool-size", "64mb", "--http-addr", "127.0.0.1:0"],
    ...flags,
  ]);
  if (r.kind !== "config") throw new Error(r.output);
  return { ...r.config, index: { ...r.config.index, redisUrl: BAD_REDIS } };
}

// The sanitizers stay on: a timer (the store's collector) or a resource left open fails it.
Deno.test("in-process: the failed start leaves no timer, port, socket file or lock behind", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-unwind-" });
  const path = `${dir}/grpc.sock`;
  const log = new Logger("error", {}, () => {});
  try {
    const ports = { addr: freePort(), peer: freePort("0.0.0.0"), xfer: freePort("0.0.0.0") };
    const error = await startServer(config(listenerFlags(path, ports)), log).then(
      (s) => s.close().then(() => assert.fail("the start did not fail")),
      (e: Error) => e,
    );
    assert.ok(free(ports.addr), "--addr is still held");
    assert.ok(free(ports.peer, "0.0.0.0"), "--peer-rpc-port is still held");
    assert.ok(free(ports.xfer, "0.0.0.0"), "--xfer-port is still held");
    assert.deepEqual([...Deno.readDirSync(dir)].map((e) => e.name), [], "files left behind");
    assert.match(error.message, REFUSED);
    assert.ok(!error.message.includes("%zz"), "the password is in the error");
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
