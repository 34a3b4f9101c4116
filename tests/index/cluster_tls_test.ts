/**
 * The block index on a real 3-master Redis Cluster serving TLS only (tests/index/_redis_cluster.ts
 * with `tls`: clients, cluster bus and replication over TLS, one certificate for 127.0.0.1 made by
 * the openssl CLI): through `rediss://` seeds and the test CA, namespaces on a seed and on a master
 * the client only learnt of from the slot map are advertised and found (the discovered nodes get
 * TLS and verify); a CA that did not sign the nodes' certificates leaves the index down, every call
 * answering a miss, the TLS reason logged; a server process started with `--index-redis-cluster`
 * and `--index-redis-tls-ca` advertises what it saves.
 */

import assert from "node:assert/strict";
import { nodesKey } from "../../lib/index/keys.ts";
import { withinOrThrow } from "../../lib/timer_limit.ts";
import { serverSaveFoundOverTls, tlsNode } from "./_tls.ts";
import { makeTestCertificates, type TestCertificates, waitFor } from "./_redis.ts";
import { type RedisCluster, startRedisCluster } from "./_redis_cluster.ts";
import { hashes } from "./_cluster_nodes.ts";

/** The index's per-call deadline in these tests. */
const TIMEOUT_MS = 500;
/** A call that has not answered after this many deadlines hangs (a guard, not a timing claim). */
const HANG_GUARD_MS = 20 * TIMEOUT_MS;
/** Node's reason for a certificate chain that ends in a CA it was not told to trust. */
const REFUSED = "self-signed certificate in certificate chain";

/** A name whose registry key's slot is served by master `i`. */
async function namespaceOn(c: RedisCluster, i: number): Promise<string> {
  for (let n = 0; n < 100; n++) {
    if (await c.masterOf(nodesKey(`model-${n}`)) === i) return `model-${n}`;
  }
  throw new Error(`no namespace model-0..99 lands on master ${c.ports[i]}`);
}

/** An index node on the cluster at `url` trusting the PEM `tlsCa` (_tls.ts). */
function node(url: string, id: string, tlsCa: string) {
  return tlsNode(url, id, tlsCa, true, TIMEOUT_MS);
}

/** `p`, or an error naming `what` if it has not settled after {@link HANG_GUARD_MS}. */
function answers<T>(what: string, p: Promise<T>): Promise<T> {
  return withinOrThrow(p, HANG_GUARD_MS, () => new Error(`${what}: no answer, the call hangs`));
}

/** A TLS-only cluster with fresh certificates; `ca` / `otherCa`: the CAs' PEM text. */
async function withTlsCluster(
  f: (
    c: RedisCluster,
    pem: { ca: string; otherCa: string },
    certs: TestCertificates,
  ) => Promise<void>,
) {
  const certs = await makeTestCertificates();
  try {
    const c = await startRedisCluster({ tls: certs });
    try {
      const ca = await Deno.readTextFile(certs.caFile);
      await f(c, { ca, otherCa: await Deno.readTextFile(certs.otherCaFile) }, certs);
    } finally {
      await c.stop();
    }
  } finally {
    await certs.remove();
  }
}

Deno.test("on a Redis Cluster over TLS, namespaces on a seed and on a master found through the slot map are advertised and looked up", async () => {
  await withTlsCluster(async (c, { ca }) => {
    // Seeds: masters 0 and 1 only. Master 2 is reached at the address CLUSTER SLOTS gives.
    const seeds = `rediss://127.0.0.1:${c.ports[0]},rediss://127.0.0.1:${c.ports[1]}`;
    const [onSeed, onDiscovered] = [await namespaceOn(c, 0), await namespaceOn(c, 2)];
    const a = node(seeds, "a", ca);
    const b = node(seeds, "b", ca);
    try {
      await waitFor("both nodes connected over TLS", () => a.index.up && b.index.up);
      assert.equal(await a.index.advertise(onSeed, hashes(6, 0)), true);
      assert.equal(await a.index.advertise(onDiscovered, hashes(8, 2)), true);
      for (const [ns, n, seed] of [[onSeed, 6, 0], [onDiscovered, 8, 2]] as const) {
        const r = await b.index.lookup(ns, hashes(n + 2, seed));
        assert.equal(r.available, true, ns);
        assert.equal(r.length, n, ns);
        assert.deepEqual(r.owners, [{ nodeId: "a", addr: "a.local:50055", length: n }]);
      }
      // The discovered master holds its namespace's registry (the client wrote it there).
      assert.deepEqual(Object.keys(await c.admin(2).hgetall(nodesKey(onDiscovered))), ["a"]);
      assert.equal(a.index.stats().errors + b.index.stats().errors, 0);
      const down = [...a.logs, ...b.logs].filter((l) => l.includes("unreachable"));
      assert.deepEqual(down, [], "the index went down during the run");
    } finally {
      await a.index.close();
      await b.index.close();
    }
  });
});

Deno.test("on a Redis Cluster over TLS, a CA that did not sign the nodes' certificates leaves the index down, the TLS reason logged", async () => {
  await withTlsCluster(async (c, { otherCa }) => {
    const ns = await namespaceOn(c, 2);
    const a = node(c.url, "a", otherCa);
    try {
      // Called at once, while the first handshakes are under way, and again once refused.
      for (let round = 0; round < 2; round++) {
        assert.equal(await answers("advertise", a.index.advertise(ns, hashes(3, 0))), false);
        assert.deepEqual(await answers("lookup", a.index.lookup(ns, hashes(3, 0))), {
          length: 0,
          owners: [],
          available: false,
        });
        await waitFor(
          "the cluster is refused again",
          () => a.index.stats().errors >= 4 * (round + 1),
        );
      }
      assert.equal(a.index.up, false);
      // One outage, logged once; and once, on that line or on the connection's own (when a call
      // failed first, before the handshake did), why: the refresh of the slots with the node's
      // TLS reason.
      const lines = a.logs.map((l) => JSON.parse(l));
      const down = lines.filter((l) => l.msg.startsWith("block index unreachable"));
      assert.equal(down.length, 1, a.logs.join("\n"));
      const why = lines.filter((l) => l.error === `Failed to refresh slots cache. (${REFUSED})`);
      assert.equal(why.length, 1, a.logs.join("\n"));
      assert.match(why[0].msg, /^block index (unreachable|connection failed)/);
      assert.equal(why[0].redis, c.url);
      // Nothing reached the cluster.
      for (let i = 0; i < c.ports.length; i++) assert.equal(await c.admin(i).dbsize(), 0);
    } finally {
      await a.index.close();
    }
  });
});

Deno.test("a server with rediss:// cluster seeds and --index-redis-tls-ca advertises what it saves", async () => {
  await withTlsCluster(async (c, { ca }, certs) => {
    const pem = { file: certs.caFile, pem: ca };
    await serverSaveFoundOverTls(c.url, true, pem, TIMEOUT_MS, (srv) => {
      const down = srv.logs().filter((l) => l.includes("block index unreachable"));
      assert.deepEqual(down, [], "the index went down during the run");
    });
  });
});
