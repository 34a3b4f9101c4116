/**
 * A start that fails after its listeners are bound closes everything it
 * opened before the error goes up (docs/server.md, start-up): the block
 * index opens last (it needs the bound gRPC address), and a `--index-redis`
 * URL that passes the flag's check but that the Redis client cannot parse
 * (`redis://:%zz@host`: ioredis percent-decodes the password and throws
 * URIError) failed the start with every socket, the transfer endpoint and
 * the store's collector timer left open: `URI malformed`, naming no flag,
 * and the `--uds` socket files left behind for the next start to trip on.
 * A real server process, and the same start in-process, where Deno's leak
 * sanitizer fails the test on a timer or a resource left open.
 */
import assert from "node:assert/strict";
import { runServerToEnd } from "./harness.ts";
import { startServer } from "../../lib/server/server.ts";
import { parseServeArgs, type ServeConfig } from "../../lib/server/config.ts";
import { Logger } from "../../lib/log.ts";

/** Passes `--index-redis`'s check (a redis:// URL naming a host); ioredis cannot parse it. */
const BAD_REDIS = "redis://:%zz@127.0.0.1:1";
/** The refusal: the flag, where it points (no credentials), why, and what to do. */
const REFUSED = new RegExp(
  "^--index-redis redis://127\\.0\\.0\\.1:1: cannot open the block index: URI malformed " +
    "\\(a % in the user or password .* write it as %25\\)$",
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

/** Flags of a start that binds every listener and then fails at the block index. */
function failingFlags(path: string, ports: { addr: number; peer: number; xfer: number }) {
  return [
    ...["--addr", `127.0.0.1:${ports.addr}`, "--uds", path],
    ...["--index-redis", BAD_REDIS, "--transport", "tcp"],
    ...["--peer-rpc-port", `${ports.peer}`, "--xfer-port", `${ports.xfer}`],
  ];
}

Deno.test("a block index that cannot open fails the start naming --index-redis, leaving no socket file", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-unwind-" });
  const path = `${dir}/grpc.sock`;
  try {
    const ports = { addr: freePort(), peer: freePort("0.0.0.0"), xfer: freePort("0.0.0.0") };
    const r = await runServerToEnd(failingFlags(path, ports));
    assert.equal(r.code, 1, r.stderr);
    assert.equal(r.stdout, "", "no listening line");
    // PATH, PATH.up, PATH.rpc and the path's lock file were all removed before the exit.
    assert.deepEqual([...Deno.readDirSync(dir)].map((e) => e.name), [], "files left behind");
    const failed = r.stderr.split("\n").filter((l) => l.includes('"start-up failed"'));
    assert.equal(failed.length, 1, r.stderr);
    assert.match(String(JSON.parse(failed[0]).error), REFUSED);
    assert.ok(!r.stderr.includes("%zz"), "the password reached the log");
    assert.ok(r.stderr.includes('"pinned pool ready"'), "it failed before the listeners");
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

/** The in-process server's configuration (host backend, a 64 MiB pool). */
function config(flags: string[]): ServeConfig {
  const r = parseServeArgs([
    ...["--backend", "host", "--pool-size", "64mb", "--http-addr", "127.0.0.1:0"],
    ...flags,
  ]);
  if (r.kind !== "config") throw new Error(r.output);
  return r.config;
}

// The sanitizers stay on: a timer (the store's collector) or a resource left open fails it.
Deno.test("in-process: the failed start leaves no timer, port, socket file or lock behind", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-unwind-" });
  const path = `${dir}/grpc.sock`;
  const log = new Logger("error", {}, () => {});
  try {
    const ports = { addr: freePort(), peer: freePort("0.0.0.0"), xfer: freePort("0.0.0.0") };
    const error = await startServer(config(failingFlags(path, ports)), log).then(
      (s) => s.close().then(() => assert.fail("the start did not fail")),
      (e: Error) => e,
    );
    assert.ok(free(ports.addr), "--addr is still held");
    assert.ok(free(ports.peer, "0.0.0.0"), "--peer-rpc-port is still held");
    assert.ok(free(ports.xfer, "0.0.0.0"), "--xfer-port is still held");
    assert.deepEqual([...Deno.readDirSync(dir)].map((e) => e.name), [], "files left behind");
    assert.match(error.message, REFUSED);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
