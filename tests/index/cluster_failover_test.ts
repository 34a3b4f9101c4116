/**
 * The block index on a real Redis Cluster with one replica per master
 * (tests/index/_redis_cluster.ts): the master of a namespace's slot is SIGKILLed and its replica
 * takes over. While the slot has no master, the index's calls fail within their deadline and the
 * index says it is down; once the replica is promoted, the heartbeat sees the recovery, the node
 * re-advertises what it holds (also what the promoted replica never received), lookups find it
 * again, and a withdraw reaches the new master. The same over TLS (clients, cluster bus and
 * replication): the promoted replica is reached over TLS and verified against the test CA.
 */

import assert from "node:assert/strict";
import type { SealedBlock } from "../../lib/index/block_index.ts";
import { clusterNode, hashes, settles as settled } from "./_cluster_nodes.ts";
import { nodeNamespacesKey, nodeSetKey, nodesKey } from "../../lib/index/keys.ts";
import { makeTestCertificates, waitFor } from "./_redis.ts";
import { type RedisCluster, startRedisCluster } from "./_redis_cluster.ts";

/** Each index call's deadline. */
const TIMEOUT_MS = 500;
/** A node is dead for lookups after this; heartbeats every third of it. */
const NODE_TTL_MS = 3_000;
/** From the replica's release (or the kill) until the blocks are found again: a few heartbeats. */
const RECOVERY_MS = 20_000;
/** A call that has not settled by then hangs (its deadline is TIMEOUT_MS). */
const HANG_MS = 5_000;

function index(c: RedisCluster, nodeId: string, held?: () => SealedBlock[], tlsCa?: string) {
  return clusterNode(c, nodeId, { held, tlsCa, nodeTtlMs: NODE_TTL_MS, timeoutMs: TIMEOUT_MS });
}

/** `p` settled (it never throws into the caller: a rejection fails the test too). */
function settles<T>(what: string, p: Promise<T>): Promise<T> {
  return settled(what, p, HANG_MS);
}

/** A namespace whose master does not hold `node`'s record: its failover leaves the record alone. */
async function namespaceApartFrom(c: RedisCluster, node: string): Promise<string> {
  const record = await c.masterOf(nodeNamespacesKey(node));
  for (let i = 0; i < 100; i++) {
    if (await c.masterOf(nodesKey(`model-${i}`)) !== record) return `model-${i}`;
  }
  throw new Error(`no namespace found off the master of ${node}'s record`);
}

async function withFailoverCluster(f: (c: RedisCluster) => Promise<void>) {
  const c = await startRedisCluster({ replicas: 1 });
  try {
    await f(c);
  } finally {
    await c.stop();
  }
}

Deno.test("on a Redis Cluster, a master killed and failed over: calls fail cleanly meanwhile, then the node re-advertises what the promoted replica lacks", async () => {
  await withFailoverCluster(async (c) => {
    const ns = await namespaceApartFrom(c, "a");
    const chain = hashes(12, 1);
    let held = chain.slice(0, 8);
    const a = index(c, "a", () => held.map((hash) => ({ namespace: ns, hash })));
    const b = index(c, "b");
    try {
      await waitFor("connected", () => a.up && b.up);
      assert.equal(await a.advertise(ns, held), true);
      assert.deepEqual((await b.lookup(ns, chain)).owners.map((o) => [o.nodeId, o.length]), [
        ["a", 8],
      ]);
      const m = await c.masterOf(nodesKey(ns));
      const r = await c.replicaOf(m);
      const inc = a.incarnation;
      // Connected before the pause (what it sends then waits in the socket), and caught up.
      const replica = c.admin(r);
      await replica.readonly();
      await waitFor(
        "the replica has a's 8 blocks",
        async () => await replica.scard(nodeSetKey(ns, "a", inc)) === 8,
      );
      // The replica, held back, misses the last advertise: asynchronous replication's loss.
      c.pause(r);
      await c.dropReplicas(m);
      held = chain;
      assert.equal(await a.advertise(ns, chain.slice(8)), true);
      assert.equal((await b.lookup(ns, chain)).length, 12);
      await c.kill(m);

      // No master for the slot (its replica cannot be elected while paused).
      assert.equal(await settles("advertise", a.advertise(ns, hashes(2, 2))), false);
      await settles("heartbeat", a.heartbeat());
      assert.equal(a.up, false, "a's index still says up with its namespace's master dead");
      const miss = await settles("lookup", b.lookup(ns, chain));
      assert.deepEqual(miss, { length: 0, owners: [], available: false });
      assert.equal(b.up, false);
      assert.ok(a.stats().errors >= 2 && b.stats().errors >= 1);

      // Queued while paused: read on resume, before the replica can be elected.
      const kept = replica.scard(nodeSetKey(ns, "a", inc));
      c.resume(r);
      assert.equal(await kept, 8, "the replica was to lack the last 4 blocks");
      await c.waitPromoted(r);
      await waitFor("b finds all 12 of a's blocks on the promoted replica", async () => {
        const found = await b.lookup(ns, chain);
        return found.length === 12 && found.owners[0]?.nodeId === "a";
      }, RECOVERY_MS);
      await waitFor("a's heartbeat proves the recovery", () => a.up, RECOVERY_MS);
      assert.equal(a.stats().outages, 1, "one outage, not one per call");
      assert.ok(a.stats().republishedBlocks >= 12, "a re-advertised what it holds");
      assert.notEqual(a.incarnation, inc, "a re-joined under a new incarnation");

      // An eviction after the failover reaches the new master.
      held = chain.slice(0, 5);
      assert.equal(await a.withdraw(ns, chain.slice(5)), true);
      assert.equal((await b.lookup(ns, chain)).length, 5);
      assert.equal(await replica.scard(nodeSetKey(ns, "a", a.incarnation)), 5);
    } finally {
      await Promise.all([a.close(), b.close()]);
    }
  });
});

/** A master killed with its replica running: the blocks are found again once it is promoted. */
async function killedMasterFoundAgain(c: RedisCluster, tlsCa?: string) {
  const ns = await namespaceApartFrom(c, "a");
  const chain = hashes(8, 3);
  const a = index(c, "a", () => chain.map((hash) => ({ namespace: ns, hash })), tlsCa);
  const b = index(c, "b", undefined, tlsCa);
  try {
    await waitFor("connected", () => a.up && b.up);
    assert.equal(await a.advertise(ns, chain), true);
    assert.equal((await b.lookup(ns, chain)).length, 8);
    const m = await c.masterOf(nodesKey(ns));
    const r = await c.replicaOf(m);
    await c.kill(m);
    await c.waitPromoted(r);
    await waitFor("b finds a's blocks on the promoted replica", async () => {
      const found = await b.lookup(ns, chain);
      return found.length === 8 && found.owners[0]?.nodeId === "a";
    }, RECOVERY_MS);
    await waitFor("a and b up", () => a.up && b.up, RECOVERY_MS);
    assert.equal(await a.withdraw(ns, chain.slice(4)), true);
    assert.equal((await b.lookup(ns, chain)).length, 4);
  } finally {
    await Promise.all([a.close(), b.close()]);
  }
}

Deno.test("on a Redis Cluster, a master killed with its replica running: lookups find the blocks again once it is promoted", async () => {
  await withFailoverCluster((c) => killedMasterFoundAgain(c));
});

Deno.test("on a Redis Cluster over TLS, a master killed with its replica running: the promoted replica is found and served over TLS", async () => {
  const certs = await makeTestCertificates();
  try {
    const ca = await Deno.readTextFile(certs.caFile);
    const c = await startRedisCluster({ replicas: 1, tls: certs });
    try {
      assert.ok(c.url.split(",").every((u) => u.startsWith("rediss://")), c.url);
      await killedMasterFoundAgain(c, ca);
    } finally {
      await c.stop();
    }
  } finally {
    await certs.remove();
  }
});

Deno.test("on a Redis Cluster, a replica that missed a node's join takes over: the node re-joins once its heartbeat finds the registration gone", async () => {
  await withFailoverCluster(async (c) => {
    const ns = await namespaceApartFrom(c, "a");
    const chain = hashes(8, 4);
    let held: Uint8Array[] = []; // nothing yet: a's start joins no namespace
    const a = index(c, "a", () => held.map((hash) => ({ namespace: ns, hash })));
    const b = index(c, "b");
    try {
      await waitFor("connected", () => a.up && b.up);
      const m = await c.masterOf(nodesKey(ns));
      const r = await c.replicaOf(m);
      const replica = c.admin(r);
      await replica.ping(); // connected before the pause: what it sends then waits in the socket
      c.pause(r);
      await c.dropReplicas(m);
      held = chain;
      assert.equal(await a.advertise(ns, chain), true); // a joins ns: the replica never sees it
      assert.equal((await b.lookup(ns, chain)).length, 8);
      const rejoins = a.stats().rejoins;
      // Queued while paused, run in this order on resume, before the replica can resync.
      const takeover = replica.pipeline().readonly().hexists(nodesKey(ns), "a")
        .cluster("FAILOVER", "TAKEOVER").exec();
      c.resume(r);
      const [, [, registered], [, took]] = (await takeover)!;
      assert.deepEqual([registered, took], [0, "OK"], "the replica was to lack a's registration");
      await c.waitPromoted(r);
      await waitFor("b finds a's blocks on the new master", async () => {
        const found = await b.lookup(ns, chain);
        return found.length === 8 && found.owners[0]?.nodeId === "a";
      }, RECOVERY_MS);
      assert.ok(a.stats().rejoins > rejoins, "a re-joined");
      assert.equal(await a.withdraw(ns, chain.slice(6)), true);
      assert.equal((await b.lookup(ns, chain)).length, 6);
    } finally {
      await Promise.all([a.close(), b.close()]);
    }
  });
});
