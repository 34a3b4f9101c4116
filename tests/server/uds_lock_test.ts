/**
 * Two servers started at once on one `--uds` path (docs/server.md, the
 * Unix-socket section): probing the path then removing a stale socket is not
 * atomic, so both could find it stale, both remove it and both bind, the
 * second silently taking the path from the first (which then served on an
 * unlinked socket nobody could reach). The path's lock (`PATH.lock`, held
 * from the first probe to the stop) makes the claim exclusive: the second
 * start is refused at once, before its pool, naming the flag, the path and
 * the holder's pid. A lock whose holder died blocks nobody.
 * In-process (two early binds at once) and real server processes.
 */
import assert from "node:assert/strict";
import { bindEarly } from "../../lib/server/early_bind.ts";
import { parseServeArgs, type ServeConfig } from "../../lib/server/config.ts";
import { Logger } from "../../lib/log.ts";
import { PegaflowClient } from "../../lib/client/client.ts";
import { spawnServer, type StartingServer } from "./harness.ts";

const log = new Logger("error", {}, () => {});

function config(flags: string[]): ServeConfig {
  const r = parseServeArgs(["--addr", "127.0.0.1:0", ...flags]);
  if (r.kind !== "config") throw new Error(r.output);
  return r.config;
}

/**
 * The refusal of a start whose `--uds` path another server (process `pid`)
 * holds. `racing`: that server took the lock an instant before, and may not
 * have written its pid into the file yet ("another process" then).
 */
function heldBy(path: string, pid: number, racing = false): RegExp {
  const p = path.replaceAll(".", "\\.");
  const holder = racing ? `(pid ${pid}|another process)` : `pid ${pid}`;
  return new RegExp(
    `^--uds ${p}: cannot listen: ${p} is in use: another server is starting or serving on it ` +
      `\\(${holder} holds ${p}\\.lock\\)$`,
  );
}

/**
 * A socket file nobody accepts on, as a crashed server leaves it: bound by a
 * process that is then SIGKILLed (a listener closed in-process removes it).
 */
async function staleSocket(path: string): Promise<void> {
  const code = `Deno.listen({ transport: "unix", path: ${JSON.stringify(path)} });` +
    `Deno.kill(Deno.pid, "SIGKILL");`;
  await new Deno.Command(Deno.execPath(), { args: ["eval", code] }).output();
  assert.ok(Deno.lstatSync(path).isSocket, "the stale socket file is there");
}

function names(dir: string): string[] {
  return [...Deno.readDirSync(dir)].map((e) => e.name).sort();
}

Deno.test("two early binds at once on one stale --uds path: one claims it, the other is refused naming it", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-udslock-" });
  const path = `${dir}/grpc.sock`;
  try {
    await staleSocket(path);
    const cfg = config(["--uds", path]);
    const both = await Promise.allSettled([bindEarly(cfg, log), bindEarly(cfg, log)]);
    const won = both.flatMap((r) => r.status === "fulfilled" ? [r.value] : []);
    const lost = both.flatMap((r) => r.status === "rejected" ? [r.reason as Error] : []);
    try {
      assert.equal(won.length, 1, `both claimed the path: ${lost.map((e) => e.message)}`);
      assert.equal(lost.length, 1);
      assert.match(lost[0].message, heldBy(path, Deno.pid, true));
      // The claim outlives the probes: held while the pool is built.
      assert.deepEqual(names(dir), ["grpc.sock.lock"]);
      await assert.rejects(
        bindEarly(cfg, log),
        (e: Error) => heldBy(path, Deno.pid).test(e.message),
      );
    } finally {
      for (const w of won) await w.close();
    }
    assert.deepEqual(names(dir), [], "the lock file is removed when the claim is released");
    await (await bindEarly(cfg, log)).close();
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

/** `srv`'s end, its exit status and whether it printed its listening line. */
async function outcome(srv: StartingServer) {
  const { status, stdout, stderr } = await srv.ended();
  return { pid: srv.pid, code: status.code, served: stdout.includes('"listening"'), stderr };
}

Deno.test("two servers started at once on one stale --uds path: exactly one serves on it, the other is refused before its pool", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-udslock-" });
  const path = `${dir}/grpc.sock`;
  const servers: StartingServer[] = [];
  try {
    await staleSocket(path);
    for (let i = 0; i < 2; i++) servers.push(spawnServer(["--uds", path]));
    // The first to serve is stopped once the other has ended and the path has been called.
    const first = await Promise.any(servers.map((s) => s.logged("serving").then(() => s)));
    const other = servers.find((s) => s !== first)!;
    const refused = await outcome(other);
    const c = new PegaflowClient(`unix:${path}`, { localRpc: false });
    try {
      assert.equal((await c.health()).status, "ok", "the path does not reach the server");
    } finally {
      c.close();
    }
    first.kill("SIGTERM");
    const served = await outcome(first);
    assert.equal(served.code, 0, served.stderr);
    assert.ok(served.served, served.stderr);
    assert.equal(refused.code, 1, refused.stderr);
    assert.ok(!refused.served, `both served on ${path}:\n${refused.stderr}`);
    const failed = refused.stderr.split("\n").filter((l) => l.includes('"start-up failed"'));
    assert.equal(failed.length, 1, refused.stderr);
    assert.match(String(JSON.parse(failed[0]).error), heldBy(path, first.pid, true));
    assert.ok(!refused.stderr.includes('"pinned pool ready"'), "refused only after its pool");
    assert.deepEqual(names(dir), [], "files left behind");
  } finally {
    for (const s of servers) {
      try {
        s.kill("SIGKILL");
      } catch (_e) { /* ended */ }
      await s.ended();
    }
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("a lock file that cannot be locked and written (a FIFO at PATH.lock) is refused naming it and left alone", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-udslock-" });
  const path = `${dir}/grpc.sock`;
  try {
    const made = await new Deno.Command("mkfifo", { args: [`${path}.lock`] }).output();
    assert.ok(made.success, "mkfifo failed");
    const p = path.replaceAll(".", "\\.");
    // Before, the OS's reason alone followed the flag (`cannot listen: Invalid argument`).
    await assert.rejects(
      bindEarly(config(["--uds", path]), log),
      (e: Error) =>
        new RegExp(`^--uds ${p}: cannot listen: cannot lock ${p}\\.lock: .+`).test(e.message),
    );
    assert.ok(Deno.lstatSync(`${path}.lock`).isFifo, "the FIFO was replaced");
    assert.deepEqual(names(dir), ["grpc.sock.lock"]);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
