/**
 * The block index on a real 3-master Redis Cluster (tests/index/_redis_cluster.ts), through
 * `RedisBlockIndex` with `cluster: true`: namespaces whose `{ns}` tags sit on different masters,
 * advertise / lookup / withdraw, the heartbeat and the start's voids split per slot, expiry, and
 * a master killed and restarted empty.
 */

import assert from "node:assert/strict";
import { RedisBlockIndex } from "../../lib/index/block_index.ts";
import { indexRedisClient } from "../../lib/index/connection.ts";
import { nodeNamespacesKey, nodesKey } from "../../lib/index/keys.ts";
import { waitFor } from "./_redis.ts";
import { type RedisCluster, startRedisCluster } from "./_redis_cluster.ts";
import { hashes } from "./_cluster_nodes.ts";

/** One namespace per master: names whose registry keys hash to slots on three different masters. */
async function namespacesOnEachMaster(c: RedisCluster): Promise<string[]> {
  const byMaster = new Map<number, string>();
  for (let i = 0; byMaster.size < c.ports.length && i < 100; i++) {
    const ns = `model-${i}`;
    const m = await c.masterOf(nodesKey(ns));
    if (!byMaster.has(m)) byMaster.set(m, ns);
  }
  assert.equal(byMaster.size, c.ports.length, "no namespace found on some master");
  return [...byMaster.keys()].sort().map((m) => byMaster.get(m)!);
}

function index(c: RedisCluster, nodeId: string, opts: { nodeTtlMs?: number } = {}) {
  const idx = new RedisBlockIndex({
    url: c.url,
    cluster: true,
    nodeId,
    advertiseAddr: `${nodeId}.local:50055`,
    listSealed: () => [],
    nodeTtlMs: opts.nodeTtlMs ?? 15_000,
    timeoutMs: 1_000,
  });
  idx.start();
  return idx;
}

async function withCluster(f: (c: RedisCluster, ns: string[]) => Promise<void>) {
  const c = await startRedisCluster();
  try {
    await f(c, await namespacesOnEachMaster(c));
  } finally {
    await c.stop();
  }
}

Deno.test("on a Redis Cluster, namespaces on three masters are advertised, looked up and withdrawn", async () => {
  await withCluster(async (c, ns) => {
    const [a, b, reader] = [index(c, "a"), index(c, "b"), index(c, "reader")];
    try {
      await waitFor("connected", () => a.up && b.up && reader.up);
      for (const [i, n] of ns.entries()) assert.equal(await a.advertise(n, hashes(8, i)), true);
      assert.equal(await b.advertise(ns[0], hashes(4, 0)), true);
      // Two owners, the longer run first.
      const two = await reader.lookup(ns[0], hashes(10, 0));
      assert.equal(two.length, 8);
      assert.deepEqual(two.owners.map((o) => [o.nodeId, o.addr, o.length]), [
        ["a", "a.local:50055", 8],
        ["b", "b.local:50055", 4],
      ]);
      // One owner in each of the other masters' namespaces; a namespace's own hashes only.
      for (const i of [1, 2]) {
        const one = await reader.lookup(ns[i], hashes(8, i));
        assert.deepEqual([one.length, one.owners.map((o) => o.nodeId)], [8, ["a"]]);
        assert.equal((await reader.lookup(ns[i], hashes(8, 0))).length, 0);
      }
      assert.equal(await a.withdraw(ns[2], hashes(8, 2).slice(3)), true);
      assert.equal((await reader.lookup(ns[2], hashes(8, 2))).length, 3);
      assert.equal(a.stats().errors, 0);
    } finally {
      await Promise.all([a.close(), b.close(), reader.close()]);
    }
  });
});

Deno.test("on a Redis Cluster, the heartbeat renews namespaces on every master; a stopped node expires", async () => {
  await withCluster(async (c, ns) => {
    const ttl = 1_000;
    const [a, reader] = [index(c, "a", { nodeTtlMs: ttl }), index(c, "reader")];
    try {
      await waitFor("connected", () => a.up && reader.up);
      for (const [i, n] of ns.entries()) assert.equal(await a.advertise(n, hashes(4, i)), true);
      const found = async () =>
        (await Promise.all(ns.map((n, i) => reader.lookup(n, hashes(4, i))))).map((r) => r.length);
      // Three node TTLs: only heartbeats that reached every master keep all three listed.
      const until = Date.now() + 3 * ttl;
      while (Date.now() < until) {
        assert.deepEqual(await found(), [4, 4, 4]);
        await new Promise((r) => setTimeout(r, 100));
      }
      assert.equal(a.stats().errors, 0);
      assert.equal(a.stats().rejoins, 1, "the registration was never lost");
      await a.close();
      await waitFor(
        "a's entries expire everywhere",
        async () => (await found()).join() === "0,0,0",
      );
    } finally {
      await Promise.all([a.close(), reader.close()]);
    }
  });
});

Deno.test("on a Redis Cluster, a restarted node voids its previous life's namespaces on other masters", async () => {
  await withCluster(async (c, ns) => {
    const [old, reader] = [index(c, "a"), index(c, "reader")];
    try {
      await waitFor("connected", () => old.up && reader.up);
      for (const [i, n] of ns.entries()) assert.equal(await old.advertise(n, hashes(4, i)), true);
      await old.close(); // a crash: its entries would live for the 15 s node TTL
      const again = index(c, "a");
      try {
        await waitFor("the new process joined", () => again.up && again.stats().rejoins >= 1);
        await again.republish(); // reads the record, then voids per slot
        for (const [i, n] of ns.entries()) {
          assert.equal((await reader.lookup(n, hashes(4, i))).length, 0, `${n} still lists a`);
        }
        assert.equal(again.stats().errors, 0);
      } finally {
        await again.close();
      }
    } finally {
      await reader.close();
    }
  });
});

Deno.test("on a Redis Cluster, a master killed and restarted empty: the others keep serving, then it is re-advertised", async () => {
  await withCluster(async (c, ns) => {
    const held = ns.flatMap((n, i) => hashes(4, i).map((hash) => ({ namespace: n, hash })));
    const a = new RedisBlockIndex({
      url: c.url,
      cluster: true,
      nodeId: "a",
      advertiseAddr: "a.local:50055",
      listSealed: () => held,
      nodeTtlMs: 1_500,
      timeoutMs: 300,
    });
    a.start();
    const reader = index(c, "reader");
    try {
      await waitFor("connected", () => a.up && reader.up);
      await a.republish();
      const lost = await c.masterOf(nodesKey(ns[2]));
      await c.kill(lost);
      await waitFor("the outage is seen", () => !a.up);
      // The other masters' namespaces still answer.
      assert.equal((await reader.lookup(ns[0], hashes(4, 0))).length, 4);
      assert.equal((await reader.lookup(ns[2], hashes(4, 2))).available, false);
      await c.restart(lost); // empty: a's registration there is gone
      await waitFor(
        "a re-advertised on the restarted master",
        async () => (await reader.lookup(ns[2], hashes(4, 2))).length === 4,
        15_000,
      );
      assert.equal(a.up, true);
      assert.equal(a.stats().outages, 1, "one outage, not one per call");
      for (const i of [0, 1]) assert.equal((await reader.lookup(ns[i], hashes(4, i))).length, 4);
    } finally {
      await Promise.all([a.close(), reader.close()]);
    }
  });
});

Deno.test("on a Redis Cluster, a lookup that failed on a dead master stays an outage until a heartbeat reaches that master", async () => {
  await withCluster(async (c, ns) => {
    const reader = index(c, "reader"); // advertises nothing: its heartbeat would be a PING
    try {
      await waitFor("connected", () => reader.up);
      const lost = await c.masterOf(nodesKey(ns[2]));
      await c.kill(lost);
      assert.equal((await reader.lookup(ns[2], hashes(4, 2))).available, false);
      assert.equal(reader.stats().outages, 1);
      const rejoins = reader.stats().rejoins;
      // A heartbeat that the live masters answer proves nothing about ns[2]'s master.
      await reader.heartbeat();
      assert.equal(
        reader.up,
        false,
        "a heartbeat that never reached the dead master ended the outage",
      );
      assert.equal(
        reader.stats().rejoins,
        rejoins,
        "a new incarnation (and a full re-advertise) per heartbeat",
      );
      assert.equal((await reader.lookup(ns[2], hashes(4, 2))).available, false);
      assert.equal(reader.stats().outages, 1, "one outage, not one per heartbeat");
      await c.restart(lost);
      await waitFor("the heartbeat reaches the restarted master", async () => {
        await reader.heartbeat();
        return reader.up;
      }, 15_000);
      assert.equal((await reader.lookup(ns[2], hashes(4, 2))).available, true);
    } finally {
      await reader.close();
    }
  });
});

Deno.test("on a Redis Cluster, a withdraw sent while the namespace's join waits for the node's record goes after the join", async () => {
  await withCluster(async (c, ns) => {
    const [a, reader] = [index(c, "a"), index(c, "reader")];
    try {
      await waitFor("connected", () => a.up && reader.up);
      // A namespace whose master is not the one of a's record: the join waits a round trip.
      const record = await c.masterOf(nodeNamespacesKey("a"));
      let n = "";
      for (const x of ns) if (await c.masterOf(nodesKey(x)) !== record) n = x;
      // The advertiser sends without awaiting: a block sealed then evicted in the next tick.
      const sent = a.advertise(n, hashes(4, 0));
      const gone = a.withdraw(n, hashes(4, 0).slice(1));
      assert.deepEqual(await Promise.all([sent, gone]), [true, true]);
      const found = await reader.lookup(n, hashes(4, 0));
      assert.equal(found.length, 1, "withdrawn blocks are still listed for the node's life");
    } finally {
      await Promise.all([a.close(), reader.close()]);
    }
  });
});

Deno.test("on a Redis Cluster, calls sent together to masters whose connections are still opening all answer", async () => {
  await withCluster(async (c, ns) => {
    const redis = indexRedisClient(c.url, 1_000, true);
    redis.on("error", () => {});
    try {
      await redis.connect();
      // Two calls per master at once: the cluster opens its connections to masters lazily.
      const keys = ns.flatMap((n) => [nodesKey(n), nodesKey(n)]);
      const answers = await Promise.allSettled(keys.map((k) => redis.pttl(k)));
      assert.deepEqual(
        answers.map((a) => a.status === "fulfilled" ? a.value : String(a.reason)),
        keys.map(() => -2),
      );
    } finally {
      redis.disconnect(false);
    }
  });
});
