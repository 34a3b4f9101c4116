/**
 * lib/server/early_bind.ts in-process: what the server checks before it
 * builds the pool. Every address engines and peers call is probed and
 * released (nothing listens on it, no socket file is left, while the pool is
 * built); the HTTP address is bound and answers 503 `starting` until the
 * server hands it its handler; `close()` (a start that failed) frees it; a
 * taken address refuses the bind naming the flag and releases what was
 * bound before it.
 */
import assert from "node:assert/strict";
import { bindEarly } from "../../lib/server/early_bind.ts";
import { parseServeArgs, type ServeConfig } from "../../lib/server/config.ts";
import { Logger } from "../../lib/log.ts";

const log = new Logger("error");

function config(flags: string[]): ServeConfig {
  const r = parseServeArgs(["--addr", "127.0.0.1:0", ...flags]);
  if (r.kind !== "config") throw new Error(r.output);
  return r.config;
}

/** Whether a TCP port on 127.0.0.1 can be bound now (nothing holds it). */
function free(port: number): boolean {
  return freeOn(port, "127.0.0.1");
}

/** Whether a TCP port on `hostname` can be bound now. */
function freeOn(port: number, hostname: string): boolean {
  try {
    Deno.listen({ hostname, port }).close();
    return true;
  } catch {
    return false;
  }
}

function exists(path: string): boolean {
  try {
    Deno.lstatSync(path);
    return true;
  } catch {
    return false;
  }
}

Deno.test("HTTP answers 503 starting until the server is ready, then the real handler", async () => {
  const early = await bindEarly(config(["--http-addr", "127.0.0.1:0"]), log);
  try {
    assert.ok(early.http, "no HTTP server");
    const before = await fetch(`http://${early.http.addr}/health`);
    assert.equal(before.status, 503);
    assert.equal(before.headers.get("retry-after"), "1");
    assert.equal((await before.json()).status, "starting");
    early.http.serve(() => new Response("ready"));
    const after = await fetch(`http://${early.http.addr}/health`);
    assert.equal(after.status, 200);
    assert.equal(await after.text(), "ready");
  } finally {
    await early.close();
  }
});

Deno.test("only HTTP stays bound: the probed ports are free and no socket file is left; close() frees HTTP", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-early-" });
  const path = `${dir}/grpc.sock`;
  const addr = freePort();
  const peer = freePort();
  try {
    const early = await bindEarly(
      config([
        ...["--addr", `127.0.0.1:${addr}`, "--uds", path, "--http-addr", "127.0.0.1:0"],
        ...["--index-redis", "redis://h:1", "--peer-rpc-port", `${peer}`],
      ]),
      log,
    );
    const http = Number(early.http!.addr.split(":")[1]);
    // Nothing listens on what engines and peers call while the pool is built:
    // a call is refused at once instead of waiting in a listen backlog.
    assert.ok(free(addr) && freeOn(peer, "0.0.0.0"), "a probed port is still held");
    assert.ok(!exists(path) && !exists(`${path}.rpc`), "a probed socket file is left");
    assert.ok(!free(http), "the HTTP port is held (it answers 503 starting)");
    await early.close();
    assert.ok(free(http), "close() freed the HTTP port");
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("a taken --http-addr is refused naming it, and what was bound before is closed", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-early-" });
  const path = `${dir}/grpc.sock`;
  const taken = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const addr = `127.0.0.1:${taken.addr.port}`;
  try {
    await assert.rejects(
      bindEarly(config(["--uds", path, "--http-addr", addr]), log),
      new RegExp(`^Error: --http-addr ${addr}: cannot listen: .*in use`),
    );
    assert.ok(!exists(path) && !exists(`${path}.rpc`), "socket files left behind");
    // The path is free for the next start: nothing accepts on it, nothing is there.
    const again = await bindEarly(config(["--uds", path]), log);
    await again.close();
  } finally {
    taken.close();
    await Deno.remove(dir, { recursive: true });
  }
});

/** A port nothing holds right now, on every address. */
function freePort(): number {
  const l = Deno.listen({ hostname: "0.0.0.0", port: 0 });
  const port = l.addr.port;
  l.close();
  return port;
}

Deno.test("--goaway-guard false: --http-addr on --addr's port is refused naming --http-addr", async () => {
  const port = freePort();
  const addr = `127.0.0.1:${port}`;
  // The probe of --addr used to be released at once: the HTTP server took the
  // port, and the start failed after the pool blaming --addr (grpc-js).
  await assert.rejects(
    bindEarly(config(["--goaway-guard", "false", "--addr", addr, "--http-addr", addr]), log),
    new RegExp(`^Error: --http-addr ${addr}: cannot listen: .*in use`),
  );
  assert.ok(free(port), "the probe is released after a refused bind");
  // Without the clash the probe is released once everything is bound: grpc-js binds it later.
  const early = await bindEarly(
    config(["--goaway-guard", "false", "--addr", addr, "--http-addr", "127.0.0.1:0"]),
    log,
  );
  try {
    assert.ok(free(port), "--addr's port is held after bindEarly: grpc-js could not bind it");
  } finally {
    await early.close();
  }
});

Deno.test("--transport tcp: --peer-rpc-port on --xfer-port's port is refused naming it", async () => {
  const port = freePort();
  const indexed = ["--index-redis", "redis://h:1", "--transport", "tcp", "--xfer-port", `${port}`];
  await assert.rejects(
    bindEarly(config([...indexed, "--peer-rpc-port", `${port}`]), log),
    new RegExp(
      `^Error: cannot listen for peer RPC on port ${port} \\(--peer-rpc-port\\): .*in use`,
    ),
  );
  assert.ok(freeOn(port, "0.0.0.0"), "the probe is released after a refused bind");
  const early = await bindEarly(config([...indexed, "--peer-rpc-port", "0"]), log);
  try {
    assert.ok(freeOn(port, "0.0.0.0"), "--xfer-port is held after bindEarly");
  } finally {
    await early.close();
  }
});

Deno.test("--http-addr on --addr's port (GOAWAY guard on) is refused naming --http-addr", async () => {
  const port = freePort();
  const addr = `127.0.0.1:${port}`;
  await assert.rejects(
    bindEarly(config(["--addr", addr, "--http-addr", addr]), log),
    new RegExp(`^Error: --http-addr ${addr}: cannot listen: .*in use`),
  );
  assert.ok(free(port), "the probe is released after a refused bind");
});

Deno.test("a --uds path whose directory is missing is refused naming --uds", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-early-" });
  await Deno.remove(dir);
  const path = `${dir}/grpc.sock`;
  await assert.rejects(
    bindEarly(config(["--uds", path]), log),
    new RegExp(`^Error: --uds ${path}: cannot listen: directory ${dir} does not exist`),
  );
});
