/**
 * Test scaffolding: a real `redis-server` on a free port in a temp dir, with
 * persistence off, killed (and its dir removed) by `stop()` — call it in a
 * `finally`. `restart()` starts a fresh, empty server on the same port, as
 * a Redis restart without persistence (or a failover to an empty replica)
 * looks to the nodes.
 */

import { Redis } from "ioredis";

/** Where the Debian package puts it; `make redis` installs it. */
const REDIS_BIN = Deno.env.get("PEGAFLOW_REDIS_SERVER") ?? "redis-server";
/** Start-up budget: redis-server binds in a few ms; 2 shared cores can be slow. */
const READY_TIMEOUT_MS = 10_000;

export interface RedisProcess {
  port: number;
  url: string;
  /** A plain client for assertions (INFO, MONITOR, KEYS...); closed by stop(). */
  admin(): Redis;
  /** SIGKILL the server (no clean shutdown, like a crash). */
  kill(): Promise<void>;
  /** SIGSTOP / SIGCONT: the server holds connections but answers nothing (a hung Redis). */
  pause(): void;
  resume(): void;
  /** Start an empty server on the same port again. */
  restart(): Promise<void>;
  stop(): Promise<void>;
}

function freePort(hostname: string): number {
  const l = Deno.listen({ hostname, port: 0 });
  const port = (l.addr as Deno.NetAddr).port;
  l.close();
  return port;
}

/** True once a PING on `port` answers PONG. */
async function pings(hostname: string, port: number): Promise<boolean> {
  try {
    const c = await Deno.connect({ hostname, port });
    try {
      await c.write(new TextEncoder().encode("PING\r\n"));
      const buf = new Uint8Array(16);
      const n = await c.read(buf);
      return n !== null && new TextDecoder().decode(buf.subarray(0, n)).startsWith("+PONG");
    } finally {
      c.close();
    }
  } catch (_e) {
    return false; // not listening yet
  }
}

/** Starts redis-server; `host` is the address it binds and is reached at (default 127.0.0.1). */
export async function startRedis(host = "127.0.0.1"): Promise<RedisProcess> {
  const dir = await Deno.makeTempDir({ prefix: "pf-redis-test-" });
  const port = freePort(host);
  let child: Deno.ChildProcess | undefined;
  const admins: Redis[] = [];
  const spawnChild = () => {
    try {
      return new Deno.Command(REDIS_BIN, {
        args: [
          "--port",
          String(port),
          "--bind",
          host,
          // Reached over a test bridge (tests/peer/_cluster.ts), not only loopback; no
          // password on a throwaway server bound to a private test address.
          "--protected-mode",
          "no",
          "--save",
          "",
          "--appendonly",
          "no",
          "--dir",
          dir,
        ],
        stdout: "null",
        stderr: "piped",
      }).spawn();
    } catch (e) {
      if (!(e instanceof Deno.errors.NotFound)) throw e;
      throw new Error(
        `${REDIS_BIN} not found: install it with \`make redis\` (Debian redis-server) or set PEGAFLOW_REDIS_SERVER`,
      );
    }
  };
  const spawn = async () => {
    child = spawnChild();
    const deadline = Date.now() + READY_TIMEOUT_MS;
    while (!await pings(host, port)) {
      if (Date.now() > deadline) {
        const p = child;
        child = undefined;
        p.kill("SIGKILL");
        const err = new TextDecoder().decode((await p.output()).stderr);
        throw new Error(`redis-server on port ${port} did not answer: ${err}`);
      }
      await new Promise((r) => setTimeout(r, 20));
    }
  };
  const kill = async () => {
    if (!child) return;
    const p = child;
    child = undefined;
    p.kill("SIGCONT");
    p.kill("SIGKILL");
    await p.stderr.cancel();
    await p.status;
  };
  try {
    await spawn();
  } catch (e) {
    await Deno.remove(dir, { recursive: true });
    throw e;
  }
  return {
    port,
    url: `redis://${host}:${port}`,
    admin() {
      const r = new Redis({ port, host, lazyConnect: false, maxRetriesPerRequest: 1 });
      r.on("error", () => {}); // the test kills the server under it on purpose
      admins.push(r);
      return r;
    },
    kill,
    pause: () => child?.kill("SIGSTOP"),
    resume: () => child?.kill("SIGCONT"),
    async restart() {
      await kill();
      await spawn();
    },
    async stop() {
      for (const a of admins) a.disconnect(false);
      await kill();
      await Deno.remove(dir, { recursive: true });
    },
  };
}

/** Polls `cond` every 20 ms until true; fails with `what` after `ms` (never asserts on time itself). */
export async function waitFor(what: string, cond: () => boolean | Promise<boolean>, ms = 8_000) {
  const deadline = Date.now() + ms;
  while (!await cond()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}
