/**
 * Test scaffolding: a real `redis-server` on a free port in a temp dir, with
 * persistence off, killed (and its dir removed) by `stop()` — call it in a
 * `finally`. `restart()` starts a fresh, empty server on the same port, as
 * a Redis restart without persistence (or a failover to an empty replica)
 * looks to the nodes. `{ tls }` serves TLS only (`rediss://`), with
 * certificates from {@link makeTestCertificates} (made by the `openssl` CLI).
 */

import { Redis } from "ioredis";

/** Where the Debian package puts it; `make redis` installs it. */
const REDIS_BIN = Deno.env.get("PEGAFLOW_REDIS_SERVER") ?? "redis-server";
/** Start-up budget: redis-server binds in a few ms; 2 shared cores can be slow. */
const READY_TIMEOUT_MS = 10_000;

/** A throwaway CA, a server certificate it signed for 127.0.0.1, and a CA that signed nothing. */
export interface TestCertificates {
  /** The CA that signed `cert` (PEM file). */
  caFile: string;
  /** Another CA (PEM file): a client trusting only it must refuse the server. */
  otherCaFile: string;
  /** The server's certificate (subjectAltName IP:127.0.0.1) and key (PEM files). */
  certFile: string;
  keyFile: string;
  /** Removes the files. */
  remove(): Promise<void>;
}

async function openssl(dir: string, ...args: string[]): Promise<void> {
  let out: Deno.CommandOutput;
  try {
    out = await new Deno.Command("openssl", { args, cwd: dir, stdout: "null", stderr: "piped" })
      .output();
  } catch (e) {
    if (!(e instanceof Deno.errors.NotFound)) throw e;
    throw new Error("openssl not found: install it with `make redis` (Debian openssl)");
  }
  if (!out.success) {
    throw new Error(`openssl ${args.join(" ")} failed: ${new TextDecoder().decode(out.stderr)}`);
  }
}

/**
 * Makes {@link TestCertificates} in a temp dir (RSA 2048, valid one day); call `remove()` in a
 * `finally`. `host` is the address the certificate is for.
 */
export async function makeTestCertificates(host = "127.0.0.1"): Promise<TestCertificates> {
  const dir = await Deno.makeTempDir({ prefix: "pf-redis-tls-" });
  const ca = (name: string) =>
    openssl(
      dir,
      "req",
      "-x509",
      "-newkey",
      "rsa:2048",
      "-nodes",
      "-days",
      "1",
      "-subj",
      `/CN=${name}`,
      "-keyout",
      `${name}.key`,
      "-out",
      `${name}.pem`,
    );
  try {
    await ca("pf-test-ca");
    await ca("pf-other-ca");
    await openssl(
      dir,
      "req",
      "-newkey",
      "rsa:2048",
      "-nodes",
      "-subj",
      `/CN=${host}`,
      "-keyout",
      "server.key",
      "-out",
      "server.csr",
    );
    await Deno.writeTextFile(`${dir}/server.ext`, `subjectAltName=IP:${host}\n`);
    await openssl(
      dir,
      "x509",
      "-req",
      "-days",
      "1",
      "-in",
      "server.csr",
      "-CA",
      "pf-test-ca.pem",
      "-CAkey",
      "pf-test-ca.key",
      "-CAcreateserial",
      "-extfile",
      "server.ext",
      "-out",
      "server.pem",
    );
  } catch (e) {
    await Deno.remove(dir, { recursive: true });
    throw e;
  }
  return {
    caFile: `${dir}/pf-test-ca.pem`,
    otherCaFile: `${dir}/pf-other-ca.pem`,
    certFile: `${dir}/server.pem`,
    keyFile: `${dir}/server.key`,
    remove: () => Deno.remove(dir, { recursive: true }),
  };
}

/** Options of {@link startRedis}. */
export interface RedisOptions {
  /** Serve TLS only, with these certificates (clients are not asked for one). */
  tls?: TestCertificates;
}

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

/** True once a PING on `port` answers PONG (over TLS trusting `caCert`, when given). */
async function pings(hostname: string, port: number, caCert?: string): Promise<boolean> {
  try {
    const c = caCert
      ? await Deno.connectTls({ hostname, port, caCerts: [caCert] })
      : await Deno.connect({ hostname, port });
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
export async function startRedis(
  host = "127.0.0.1",
  opts: RedisOptions = {},
): Promise<RedisProcess> {
  const dir = await Deno.makeTempDir({ prefix: "pf-redis-test-" });
  const port = freePort(host);
  const tls = opts.tls;
  const caCert = tls ? await Deno.readTextFile(tls.caFile) : undefined;
  const listen = tls
    ? ["--port", "0", "--tls-port", String(port), "--tls-cert-file", tls.certFile]
      .concat(["--tls-key-file", tls.keyFile, "--tls-ca-cert-file", tls.caFile])
      .concat(["--tls-auth-clients", "no"])
    : ["--port", String(port)];
  let child: Deno.ChildProcess | undefined;
  const admins: Redis[] = [];
  const spawnChild = () => {
    try {
      return new Deno.Command(REDIS_BIN, {
        args: [
          ...listen,
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
    while (!await pings(host, port, caCert)) {
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
    url: `${tls ? "rediss" : "redis"}://${host}:${port}`,
    admin() {
      const r = new Redis({
        port,
        host,
        lazyConnect: false,
        maxRetriesPerRequest: 1,
        ...(caCert ? { tls: { ca: caCert } } : {}),
      });
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
