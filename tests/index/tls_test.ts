/**
 * The block index over TLS (`rediss://`) against a real redis-server serving TLS only, with a
 * throwaway CA made by the openssl CLI: trusted through `--index-redis-tls-ca` / `tlsCa` it works
 * as over plain TCP (one round trip per call); a CA that did not sign the server's certificate
 * leaves the index down like an unreachable Redis, logged once with the TLS reason.
 */

import assert from "node:assert/strict";
import { serverSaveFoundOverTls, tlsNode } from "./_tls.ts";
import {
  makeTestCertificates,
  type RedisProcess,
  startRedis,
  type TestCertificates,
  waitFor,
} from "./_redis.ts";

const NS = "0123456789abcdef";

function hashes(n: number, chain = 0): Uint8Array[] {
  return Array.from({ length: n }, (_, i) => {
    const h = new Uint8Array(32);
    new DataView(h.buffer).setUint32(0, chain);
    new DataView(h.buffer).setUint32(4, i);
    return h;
  });
}

/** An index node on one Redis trusting `tlsCa` (_tls.ts). */
function node(url: string, id: string, tlsCa: string) {
  return tlsNode(url, id, tlsCa, false, 500);
}

/** Calls of `cmd` (top-level, as sent by clients) the server has run so far. */
async function calls(redis: RedisProcess, cmd: string): Promise<number> {
  const stats = await redis.admin().info("commandstats");
  return Number(new RegExp(`cmdstat_${cmd}:calls=(\\d+)`).exec(stats)?.[1] ?? 0);
}

/** A TLS-only redis-server with fresh certificates; `ca` / `otherCa`: the CAs' PEM text. */
async function withTlsRedis(
  f: (
    redis: RedisProcess,
    pem: { ca: string; otherCa: string },
    certs: TestCertificates,
  ) => Promise<void>,
) {
  const certs = await makeTestCertificates();
  try {
    const redis = await startRedis("127.0.0.1", { tls: certs });
    try {
      const ca = await Deno.readTextFile(certs.caFile);
      await f(redis, { ca, otherCa: await Deno.readTextFile(certs.otherCaFile) }, certs);
    } finally {
      await redis.stop();
    }
  } finally {
    await certs.remove();
  }
}

Deno.test("over rediss:// with a private CA, an advertise is found by another node's lookup, one round trip each", async () => {
  await withTlsRedis(async (redis, { ca }) => {
    assert.match(redis.url, /^rediss:\/\/127\.0\.0\.1:\d+$/);
    const a = node(redis.url, "a", ca);
    const b = node(redis.url, "b", ca);
    try {
      await waitFor("both nodes connected over TLS", () => a.index.up && b.index.up);
      await a.index.advertise(NS, hashes(2, 9)); // scripts loaded, namespace joined
      await b.index.lookup(NS, hashes(2, 9));
      const hs = hashes(625);
      const [eval0, evalsha0] = [await calls(redis, "eval"), await calls(redis, "evalsha")];
      assert.equal(await a.index.advertise(NS, hs), true);
      const r = await b.index.lookup(NS, hs);
      assert.equal(await calls(redis, "eval") - eval0, 1, "the advertise is one EVAL");
      assert.equal(await calls(redis, "evalsha") - evalsha0, 1, "the lookup is one EVALSHA");
      assert.equal(r.available, true);
      assert.equal(r.length, 625);
      assert.deepEqual(r.owners, [{ nodeId: "a", addr: "a.local:50055", length: 625 }]);
    } finally {
      await a.index.close();
      await b.index.close();
    }
  });
});

Deno.test("a CA that did not sign the server's certificate leaves the index down, logged once with the TLS reason and the address", async () => {
  await withTlsRedis(async (redis, { otherCa }) => {
    // Credentials in the URL stay out of the log (the server takes no password: TLS fails first).
    const url = redis.url.replace("rediss://", "rediss://user:s3cret@");
    const a = node(url, "a", otherCa);
    try {
      // Called at once, while the first TLS handshake is under way: the calls still answer
      // within their deadline, and the one log line says why the connection failed.
      assert.equal(await a.index.advertise(NS, hashes(3)), false);
      assert.deepEqual(await a.index.lookup(NS, hashes(3)), {
        length: 0,
        owners: [],
        available: false,
      });
      await waitFor("the connection is refused again", () => a.index.stats().errors >= 4);
      assert.equal(await a.index.advertise(NS, hashes(3)), false);
      assert.equal(a.index.up, false);
      // One outage: its line, and — the calls having failed before the handshake did — the
      // connection's reason once (not once per reconnect attempt).
      const down = a.logs.filter((l) => l.includes("unreachable"));
      assert.equal(down.length, 1, down.join("\n"));
      assert.equal(JSON.parse(down[0]).redis, redis.url);
      const why = a.logs.filter((l) => l.includes("block index connection failed"));
      assert.equal(why.length, 1, a.logs.join("\n"));
      const line = JSON.parse(why[0]);
      assert.equal(line.redis, redis.url);
      assert.match(line.error, /self-signed certificate in certificate chain/);
      assert.ok(!a.logs.some((l) => l.includes("s3cret")), a.logs.join("\n"));
      // Nothing reached Redis: its keyspace is empty.
      assert.equal(await redis.admin().dbsize(), 0);
    } finally {
      await a.index.close();
    }
  });
});

Deno.test("a server with --index-redis rediss:// and --index-redis-tls-ca advertises what it saves", async () => {
  await withTlsRedis(async (redis, { ca }, certs) => {
    await serverSaveFoundOverTls(redis.url, false, { file: certs.caFile, pem: ca }, 500, (srv) => {
      assert.ok(srv.logs().some((l) => l.includes("block index connected")), srv.logs().join("\n"));
    });
  });
});
