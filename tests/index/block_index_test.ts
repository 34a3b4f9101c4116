/**
 * The block index against a real redis-server: prefixes and owners, node
 * expiry, withdraw, one round trip per call (counted with MONITOR), Redis
 * killed / hung / restarted, and bad input.
 */

import assert from "node:assert/strict";
import { Registry } from "prom-client";
import {
  type LookupResult,
  RedisBlockIndex,
  type SealedBlock,
} from "../../lib/index/block_index.ts";
import { IndexInputError } from "../../lib/index/errors.ts";
import { IndexAdvertiser } from "../../lib/index/advertiser.ts";
import { Logger } from "../../lib/log.ts";
import { registerIndexMetrics } from "../../lib/index/metrics.ts";
import { startRedis, waitFor } from "./_redis.ts";
import { Buffer } from "node:buffer";

const NS = "0123456789abcdef";

/** Distinct 32-byte hashes; `chain` picks a separate family. */
function hashes(n: number, chain = 0): Uint8Array[] {
  return Array.from({ length: n }, (_, i) => {
    const h = new Uint8Array(32);
    const v = new DataView(h.buffer);
    v.setUint32(0, chain);
    v.setUint32(4, i);
    h.fill(0xa5, 8);
    return h;
  });
}

interface Node {
  index: RedisBlockIndex;
  held: Map<string, SealedBlock>;
  logs: string[];
  registry: Registry;
  /** Sum of a counter's values over all its labels. */
  count(metric: string): Promise<number>;
}

function node(
  url: string,
  id: string,
  opts: Partial<ConstructorParameters<typeof RedisBlockIndex>[0]> = {},
): Node {
  const held = new Map<string, SealedBlock>();
  const logs: string[] = [];
  const registry = new Registry();
  const index = new RedisBlockIndex({
    url,
    nodeId: id,
    advertiseAddr: `${id}.local:50055`,
    listSealed: () => held.values(),
    nodeTtlMs: 60_000,
    log: new Logger("debug", {}, (line) => logs.push(line)),
    metrics: registerIndexMetrics(registry),
    ...opts,
  });
  index.start();
  return {
    index,
    held,
    logs,
    registry,
    async count(metric) {
      const m = registry.getSingleMetric(metric);
      if (!m) throw new Error(`no metric ${metric}`);
      return (await m.get()).values.reduce((s, v) => s + v.value, 0);
    },
  };
}

/** Records the blocks as held (for re-advertise) and advertises them. */
async function save(n: Node, hs: Uint8Array[]): Promise<boolean> {
  for (const h of hs) n.held.set(Buffer.from(h).toString("hex"), { namespace: NS, hash: h });
  return await n.index.advertise(NS, hs);
}

function owners(r: LookupResult): string[] {
  return r.owners.map((o) => `${o.nodeId}@${o.addr}=${o.length}`);
}

async function withNodes(
  f: (redis: Awaited<ReturnType<typeof startRedis>>, nodes: Node[]) => Promise<void>,
  ids: string[] = ["a", "b", "c"],
  opts: Partial<ConstructorParameters<typeof RedisBlockIndex>[0]> = {},
) {
  const redis = await startRedis();
  const nodes: Node[] = [];
  try {
    for (const id of ids) nodes.push(node(redis.url, id, opts));
    await waitFor("every node connected", () => nodes.every((n) => n.index.up));
    await f(redis, nodes);
  } finally {
    for (const n of nodes) await n.index.close();
    await redis.stop();
  }
}

Deno.test("an advertised save is found by another node: longest prefix and its owner", async () => {
  await withNodes(async (_r, [a, b]) => {
    const hs = hashes(625);
    assert.equal(await save(a, hs), true);
    const r = await b.index.lookup(NS, hs);
    assert.equal(r.available, true);
    assert.equal(r.length, 625);
    assert.deepEqual(owners(r), ["a@a.local:50055=625"]);
    // A longer query than what is held stops where the chain leaves the index.
    const longer = [...hs, ...hashes(10, 9)];
    assert.equal((await b.index.lookup(NS, longer)).length, 625);
    // Another namespace, or a chain nobody saved, is a miss.
    assert.equal((await b.index.lookup("other-ns", hs)).length, 0);
    assert.deepEqual(await b.index.lookup(NS, hashes(5, 7)), {
      length: 0,
      owners: [],
      available: true,
    });
  }, ["a", "b"]);
});

Deno.test("two nodes holding different prefix lengths are both reported, the longer first", async () => {
  await withNodes(async (_r, [a, b, c]) => {
    const hs = hashes(100);
    await save(a, hs.slice(0, 40));
    await save(b, hs.slice(0, 90));
    const r = await c.index.lookup(NS, hs);
    assert.equal(r.length, 90);
    assert.deepEqual(owners(r), ["b@b.local:50055=90", "a@a.local:50055=40"]);
    // The asking node is never named as a peer, even though it holds the blocks.
    const own = await b.index.lookup(NS, hs);
    assert.equal(own.length, 40);
    assert.deepEqual(owners(own), ["a@a.local:50055=40"]);
  });
});

Deno.test("the prefix ends at the first block no live node holds, even with later blocks held", async () => {
  await withNodes(async (_r, [a, b, c]) => {
    const hs = hashes(64);
    await save(a, [...hs.slice(0, 20), ...hs.slice(31, 64)]); // 20..30 evicted on a
    await save(b, hs.slice(10, 30)); // b holds 10..29: no prefix of its own
    const r = await c.index.lookup(NS, hs);
    // The union covers 0..29 (a: 0..19, b: 10..29); nobody holds block 30.
    assert.equal(r.length, 30);
    assert.deepEqual(owners(r), ["a@a.local:50055=20"]);
    // b filling a's gap at block 30 makes the whole chain reachable.
    await save(b, [hs[30]]);
    assert.equal((await c.index.lookup(NS, hs)).length, 64);
  });
});

Deno.test("a withdrawn (evicted) block ends the prefix at that block", async () => {
  await withNodes(async (_r, [a, b]) => {
    const hs = hashes(50);
    await save(a, hs);
    assert.equal(await a.index.withdraw(NS, [hs[30], hs[31]]), true);
    const r = await b.index.lookup(NS, hs);
    assert.equal(r.length, 30);
    assert.deepEqual(owners(r), ["a@a.local:50055=30"]);
    await a.index.withdraw(NS, hs);
    assert.equal((await b.index.lookup(NS, hs)).length, 0);
    assert.ok(await a.count("pegaflow_index_blocks_total") >= 50 + 2 + 50);
  }, ["a", "b"]);
});

Deno.test("a node that stops heartbeating expires from lookups; a live one stays", async () => {
  await withNodes(
    async (_r, [a, b, c]) => {
      const hs = hashes(20);
      await save(a, hs);
      await save(b, hs.slice(0, 10));
      await a.index.close(); // no more heartbeats from a, no goodbye either (as a crash)
      await waitFor(
        "a's entries expired",
        async () => (await c.index.lookup(NS, hs)).length === 10,
      );
      const r = await c.index.lookup(NS, hs);
      assert.deepEqual(owners(r), ["b@b.local:50055=10"]);
      // b kept heartbeating through several TTLs, so it is still there.
      assert.equal(b.index.stats().rejoins, 1); // only the first connect
    },
    ["a", "b", "c"],
    { nodeTtlMs: 1000, heartbeatMs: 200 },
  );
});

Deno.test("a node restarted under the same id voids its previous entries at once", async () => {
  await withNodes(async (redis, [a, b]) => {
    const hs = hashes(30);
    await save(a, hs);
    assert.equal((await b.index.lookup(NS, hs)).length, 30);
    await a.index.close();
    // The new process joins with a new incarnation: the old set no longer counts.
    const a2 = node(redis.url, "a");
    try {
      await waitFor("a2 connected", () => a2.index.up);
      await save(a2, hs.slice(0, 5));
      const r = await b.index.lookup(NS, hs);
      assert.equal(r.length, 5);
      assert.deepEqual(owners(r), ["a@a.local:50055=5"]);
    } finally {
      await a2.index.close();
    }
  }, ["a", "b"]);
});

Deno.test("a node restarted after a crash is no longer named in a namespace it has not advertised into yet", async () => {
  await withNodes(async (redis, [a, b]) => {
    const NS2 = "fedcba9876543210";
    const xs = hashes(20), ys = hashes(10, 9);
    await save(a, xs);
    assert.equal(await a.index.advertise(NS2, ys), true);
    assert.deepEqual(owners(await b.index.lookup(NS2, ys)), ["a@a.local:50055=10"]);
    // A crash: the connection drops, nothing is withdrawn, and a's registrations (60 s TTL)
    // still stand when the new process under the same id starts.
    await a.index.close();
    const a2 = node(redis.url, "a");
    try {
      await waitFor("a2 connected", () => a2.index.up);
      await save(a2, xs.slice(0, 5));
      await a2.index.republish(); // the start's re-join pass is done
      assert.deepEqual(owners(await b.index.lookup(NS, xs)), ["a@a.local:50055=5"]);
      assert.deepEqual(
        await b.index.lookup(NS2, ys),
        { length: 0, owners: [], available: true },
        "the previous process's blocks are still listed under a",
      );
      // The node's record now lists only what this process joined, and expires unless renewed.
      const admin = redis.admin();
      assert.deepEqual(await admin.smembers("pf:{@a}:namespaces"), [NS]);
      assert.ok(await admin.pttl("pf:{@a}:namespaces") > 0);
    } finally {
      await a2.index.close();
    }
  }, ["a", "b"]);
});

Deno.test("a 625-block advertise and a 625-hash lookup are one round trip each", async () => {
  await withNodes(async (redis, [a, b]) => {
    const hs = hashes(625);
    await save(a, hashes(3, 5)); // scripts loaded, namespace joined
    await b.index.lookup(NS, hashes(3, 5));
    // The marker client is connected (its ready check's INFO done) before MONITOR starts: a
    // command another client runs while the monitor connection is switching into monitor
    // mode reaches ioredis as a reply it has no command for ("Command queue state error").
    const echo = redis.admin();
    await echo.ping();
    const admin = redis.admin();
    await admin.ping();
    const monitor = await admin.monitor();
    const seen: { args: string[]; source: string }[] = [];
    monitor.on("monitor", (_t: string, args: string[], source: string) => {
      seen.push({ args, source });
    });
    const marker = async (tag: string) => {
      await echo.echo(tag);
      await waitFor(`monitor saw ${tag}`, () => seen.some((s) => s.args[1] === tag));
    };
    const roundTrips = () => seen.filter((s) => s.source !== "lua" && s.args[0] !== "echo");
    try {
      await marker("start");
      seen.length = 0;
      assert.equal(await a.index.advertise(NS, hs), true);
      await marker("after-advertise");
      // EVAL, not EVALSHA: a call that changes the index can never be re-sent out of order.
      assert.deepEqual(roundTrips().map((s) => s.args[0].toLowerCase()), ["eval"]);
      // The whole save went in with one SADD inside the script.
      const sadds = seen.filter((s) => s.source === "lua" && s.args[0].toLowerCase() === "sadd");
      assert.equal(sadds.length, 1);
      assert.equal(sadds[0].args.length, 2 + 625);
      seen.length = 0;
      const r = await b.index.lookup(NS, hs);
      await marker("after-lookup");
      assert.equal(r.length, 625);
      assert.deepEqual(roundTrips().map((s) => s.args[0].toLowerCase()), ["evalsha"]);
    } finally {
      monitor.disconnect();
    }
  }, ["a", "b"]);
});

Deno.test("Redis killed: calls answer a miss without throwing, errors are counted, one log line", async () => {
  await withNodes(async (redis, [a, b]) => {
    const hs = hashes(40);
    await save(a, hs);
    await redis.kill();
    for (let i = 0; i < 10; i++) {
      assert.deepEqual(await b.index.lookup(NS, hs), { length: 0, owners: [], available: false });
      assert.equal(await a.index.advertise(NS, hashes(2, 100 + i)), false);
      assert.equal(await a.index.withdraw(NS, [hs[0]]), false);
    }
    assert.equal(a.index.up, false);
    assert.ok(await b.count("pegaflow_index_errors_total") >= 10);
    assert.ok(await a.count("pegaflow_index_errors_total") >= 20);
    assert.equal(await a.count("pegaflow_index_redis_up"), 0);
    assert.equal(a.logs.filter((l) => l.includes("unreachable")).length, 1);
    assert.equal(b.logs.filter((l) => l.includes("unreachable")).length, 1);
  }, ["a", "b"]);
});

Deno.test("a hung Redis (SIGSTOP) costs a call its deadline, then answers a miss", async () => {
  await withNodes(
    async (redis, [a, b]) => {
      const hs = hashes(10);
      await save(a, hs);
      redis.pause();
      try {
        assert.deepEqual(await b.index.lookup(NS, hs), { length: 0, owners: [], available: false });
        assert.equal(await a.index.advertise(NS, hashes(1, 3)), false);
        assert.equal(b.logs.filter((l) => l.includes("unreachable")).length, 1);
        assert.match(b.logs.find((l) => l.includes("unreachable"))!, /unreachable/);
      } finally {
        redis.resume();
      }
      await waitFor("b sees Redis again", async () => (await b.index.lookup(NS, hs)).available);
    },
    ["a", "b"],
    { timeoutMs: 100 },
  );
});

Deno.test("Redis restarted empty: the node re-joins and re-advertises what it holds", async () => {
  await withNodes(
    async (redis, [a, b]) => {
      const hs = hashes(1500); // more than one re-advertise batch
      await save(a, hs);
      await save(a, hashes(7, 2));
      const incBefore = a.index.incarnation;
      await redis.restart();
      assert.equal((await b.index.lookup(NS, hs)).length, 0);
      await waitFor("lookups find a's blocks again", async () => {
        return (await b.index.lookup(NS, hs)).length === 1500 &&
          (await b.index.lookup(NS, hashes(7, 2))).length === 7;
      });
      assert.notEqual(a.index.incarnation, incBefore);
      assert.ok(await a.count("pegaflow_index_readvertised_blocks_total") >= 1507);
      assert.equal(await a.count("pegaflow_index_redis_up"), 1);
      assert.ok(a.logs.some((l) => l.includes("reachable again")));
    },
    ["a", "b"],
    { nodeTtlMs: 1000, heartbeatMs: 100 },
  );
});

Deno.test("any namespace the store accepts works, and namespaces never see each other's blocks", async () => {
  await withNodes(async (redis, [a, b]) => {
    const odd = "meta-llama/Llama-3.1-8B {tp=2} bf16";
    const hs = hashes(8);
    assert.equal(await a.index.advertise(odd, hs), true);
    assert.equal((await b.index.lookup(odd, hs)).length, 8);
    assert.equal((await b.index.lookup(NS, hs)).length, 0);
    assert.equal((await b.index.lookup("meta-llama/Llama-3.1-8B {tp=4} bf16", hs)).length, 0);
    // Its keys sit under one digest tag, so they still share one Cluster slot.
    const keys = (await redis.admin().keys("pf:*")).filter((k) => k.includes("~"));
    assert.equal(keys.length, 2);
    assert.equal(new Set(keys.map((k) => /\{(~[0-9a-f]{32})\}/.exec(k)?.[1])).size, 1);
  }, ["a", "b"]);
});

Deno.test("bad input gets a clear error naming what was wrong", async () => {
  await withNodes(async (_r, [a]) => {
    await assert.rejects(() => a.index.advertise("", hashes(1)), (e: Error) => {
      assert.ok(e instanceof IndexInputError);
      assert.match(e.message, /namespace must be a non-empty string/);
      return true;
    });
    const big = [...hashes(2), new Uint8Array(65)];
    await assert.rejects(() => a.index.advertise(NS, big), (e: Error) => {
      assert.ok(e instanceof IndexInputError);
      assert.match(e.message, /hash 2 has 65 bytes; a block hash has 1\.\.64/);
      assert.equal(e.fields.index, 2);
      return true;
    });
    await assert.rejects(() => a.index.withdraw(NS, [new Uint8Array(0)]), /hash 0 has 0 bytes/);
    await assert.rejects(
      () => a.index.lookup(NS, [new Uint8Array(32), new Uint8Array(16)]),
      /hash 1 has 16 bytes but hash 0 has 32/,
    );
    // Nothing was written by the refused calls.
    assert.equal(a.index.stats().namespaces, 0);
  }, ["a"]);
  const base = { nodeId: "n", advertiseAddr: "h:1", listSealed: () => [] };
  assert.throws(
    () => new RedisBlockIndex({ ...base, url: "127.0.0.1:6379" }),
    /"127.0.0.1:6379" is not a redis:\/\/ URL/,
  );
  assert.throws(() => new RedisBlockIndex({ ...base, url: "http://h:1" }), /expected redis:\/\//);
  assert.throws(
    () => new RedisBlockIndex({ ...base, url: "redis://h:1", nodeId: "a b" }),
    /node id must be .* without spaces/,
  );
  assert.throws(
    () => new RedisBlockIndex({ ...base, url: "redis://h:1", nodeTtlMs: 100, heartbeatMs: 100 }),
    /heartbeatMs must be shorter than nodeTtlMs/,
  );
});

Deno.test("a block evicted while a re-advertise is under way is not advertised again", async () => {
  const redis = await startRedis();
  const adv = new IndexAdvertiser();
  const hex = (h: Uint8Array) => Buffer.from(h).toString("hex");
  const [a1] = hashes(1, 1);
  const b = hashes(2, 2);
  adv.onSealed("a", [`a:${hex(a1)}`]);
  adv.onSealed("b", b.map((h) => `b:${hex(h)}`));
  let evicted = false;
  // Wired as lib/index/attach.ts wires it, except that a:1 is evicted (and its withdraw sent)
  // after the re-advertise collected it, while b's batch is on the wire.
  const index = new RedisBlockIndex({
    url: redis.url,
    nodeId: "n1",
    advertiseAddr: "n1.local:1",
    republishBatch: 2,
    nodeTtlMs: 60_000,
    listSealed: function* () {
      for (const s of adv.listSealed()) {
        yield s;
        if (s.namespace === "b" && !evicted) {
          evicted = true;
          queueMicrotask(() => adv.onEvicted("a", hex(a1)));
        }
      }
    },
    isHeld: (ns, h) => adv.holds(ns, h),
  });
  const other = node(redis.url, "n2");
  try {
    index.start();
    adv.connect(index);
    await waitFor("connected", () => index.up && other.index.up);
    await index.republish();
    assert.ok(evicted);
    await waitFor(
      "b's blocks are found",
      async () => (await other.index.lookup("b", b)).length === 2,
    );
    assert.equal(
      (await other.index.lookup("a", [a1])).length,
      0,
      "the evicted block is still listed",
    );
  } finally {
    await index.close();
    await other.index.close();
    await redis.stop();
  }
});

Deno.test("a node with a shorter TTL never shortens the namespace registry under a longer-lived node", async () => {
  // a: node TTL 60 s (registry kept ≥ 120 s); s: a node run with a 300 ms TTL (a rolling
  // config change), which then dies. Its writes used to set the registry's expiry to 600 ms,
  // so it vanished with every live node's registration 600 ms after s's last heartbeat.
  await withNodes(async (redis, [a, c]) => {
    const hs = hashes(8);
    await save(a, hs);
    const s = node(redis.url, "s", { nodeTtlMs: 300, heartbeatMs: 100 });
    try {
      await waitFor("s connected", () => s.index.up);
      await save(s, hashes(4, 1));
      await s.index.heartbeat();
      const pttl = await redis.admin().pttl(`pf:{${NS}}:nodes`);
      assert.ok(pttl > 60_000, `the registry expires in ${pttl} ms: a's TTL keeps it`);
    } finally {
      await s.index.close(); // dies: no more heartbeats
    }
    await waitFor(
      "s's entries expired",
      async () => (await c.index.lookup(NS, hashes(4, 1))).length === 0,
    );
    // Well past the 600 ms s's registry TTL was; a heartbeats only every 20 s.
    await new Promise((r) => setTimeout(r, 800));
    const r = await c.index.lookup(NS, hs);
    assert.deepEqual(owners(r), ["a@a.local:50055=8"], "a is still found");
    assert.equal(a.index.stats().rejoins, 1, "a never lost its registration");
  }, ["a", "c"]);
});

/** Parsed log lines of `n` at `level` whose message matches `msg`. */
function logged(n: Node, level: string, msg: RegExp): Record<string, string>[] {
  return n.logs.map((l) => JSON.parse(l)).filter((o) => o.level === level && msg.test(o.msg));
}

const KEPT_OUT = /another live process holds this node id/;
const REGISTRY = `pf:{${NS}}:nodes`;

/** Resolves once `n` has made `ticks` more calls to Redis (heartbeats, or the join it retries). */
async function ticks(n: Node, ticks: number): Promise<void> {
  const start = await n.count("pegaflow_index_calls_total");
  await waitFor(
    `${ticks} calls of ${n.index.advertiseAddr}`,
    async () => await n.count("pegaflow_index_calls_total") >= start + ticks,
  );
}

/**
 * Two processes under node id "dup" (a copied --node-id): x at host-x joins and advertises xs
 * first; y at host-y starts after it and holds ys. Both have a 1 s TTL, heartbeats every 100 ms.
 */
async function withDuplicate(
  redis: Awaited<ReturnType<typeof startRedis>>,
  f: (x: Node, y: Node, xs: Uint8Array[], ys: Uint8Array[]) => Promise<void>,
) {
  const opts = { nodeTtlMs: 1000, heartbeatMs: 100 };
  const xs = hashes(4), ys = hashes(4, 1);
  const x = node(redis.url, "dup", { ...opts, advertiseAddr: "host-x:50055" });
  let y: Node | undefined;
  try {
    await waitFor("x connected", () => x.index.up);
    assert.equal(await save(x, xs), true);
    y = node(redis.url, "dup", { ...opts, advertiseAddr: "host-y:50055" });
    await waitFor("y connected", () => y!.index.up);
    assert.equal(await save(y, ys), false, "y's join took the node id from x");
    await f(x, y, xs, ys);
  } finally {
    await x.index.close();
    await y?.index.close();
  }
}

Deno.test("a second live process under one node id is kept out of the index: the first keeps it, nothing flaps", async () => {
  // Each join and each heartbeat of the process that had lost the field used to take it back
  // and re-advertise all it held, every TTL/3, and lookups alternated between the two.
  await withNodes(async (redis, [c]) => {
    await withDuplicate(redis, async (x, y, xs, ys) => {
      const incX = x.index.incarnation;
      await waitFor("y kept out", () => y.index.stats().conflictWith === "host-x:50055");
      await Promise.all([ticks(x, 5), ticks(y, 5)]); // several heartbeat ticks of both
      const admin = redis.admin();
      const [inc, , addr] = (await admin.hget(REGISTRY, "dup"))!.split(" ");
      assert.deepEqual([inc, addr], [incX, "host-x:50055"], "the registration moved to y");
      assert.equal(x.index.incarnation, incX);
      assert.equal(x.index.stats().rejoins, 1, "x re-joined: it lost the node id");
      assert.deepEqual(owners(await c.index.lookup(NS, xs)), ["dup@host-x:50055=4"]);
      assert.equal((await c.index.lookup(NS, ys)).length, 0, "y's blocks were advertised");
      assert.equal(await y.index.withdraw(NS, ys), false);
      // Nothing y holds reached Redis: the only block set under "dup" is x's.
      assert.deepEqual(await admin.keys(`pf:{${NS}}:n:dup:*`), [`pf:{${NS}}:n:dup:${incX}`]);
      // One error naming both addresses and the fix; the metric and stats() say so.
      const errors = logged(y, "error", KEPT_OUT);
      assert.equal(errors.length, 1, y.logs.join("\n"));
      assert.equal(errors[0].node, "dup");
      assert.equal(errors[0].advertise_addr, "host-y:50055");
      assert.equal(errors[0].other_addr, "host-x:50055");
      assert.match(errors[0].fix, /--node-id/);
      assert.equal(logged(x, "error", /another live process/).length, 0);
      assert.equal(await y.count("pegaflow_index_node_id_conflict"), 1);
      assert.equal(await x.count("pegaflow_index_node_id_conflict"), 0);
      assert.equal(x.index.stats().conflictWith, null);
      // y still serves lookups.
      const cs = hashes(3, 2);
      await save(c, cs);
      assert.deepEqual(owners(await y.index.lookup(NS, cs)), ["c@c.local:50055=3"]);
    });
  }, ["c"]);
});

Deno.test("once the holder of a node id is gone, the process kept out joins by itself and re-advertises what it holds", async () => {
  await withNodes(async (redis, [c]) => {
    await withDuplicate(redis, async (x, y, xs, ys) => {
      await waitFor("y kept out", () => y.index.stats().conflictWith === "host-x:50055");
      await x.index.close(); // stops heartbeating: its registration expires after its TTL
      await waitFor(
        "lookups find y's blocks",
        async () => owners(await c.index.lookup(NS, ys)).join() === "dup@host-y:50055=4",
      );
      assert.equal((await c.index.lookup(NS, xs)).length, 0, "x's blocks are still listed");
      const [inc, , addr] = (await redis.admin().hget(REGISTRY, "dup"))!.split(" ");
      assert.deepEqual([inc, addr], [y.index.incarnation, "host-y:50055"]);
      assert.equal(y.index.stats().conflictWith, null);
      assert.equal(await y.count("pegaflow_index_node_id_conflict"), 0);
      assert.ok(await y.count("pegaflow_index_readvertised_blocks_total") >= 4);
      assert.equal(logged(y, "info", /joined the block index/).length, 1);
      assert.equal(logged(y, "error", KEPT_OUT).length, 1);
      // y now heartbeats its registration like any holder.
      await ticks(y, 5);
      assert.deepEqual(owners(await c.index.lookup(NS, ys)), ["dup@host-y:50055=4"]);
      assert.equal(await y.index.advertise(NS, hashes(2, 3)), true);
    });
  }, ["c"]);
});

Deno.test("a node whose heartbeat finds another process holding its id is kept out, not re-joined, until that one is gone", async () => {
  // E.g. Redis restarted and the other process under this id re-joined first. Re-joining here
  // took the id back and started the flapping from the other side.
  await withNodes(
    async (redis, [a, c]) => {
      const hs = hashes(6);
      await save(a, hs);
      const admin = redis.admin();
      const [sec, usec] = await admin.time();
      const deadline = Number(sec) * 1000 + Math.floor(Number(usec) / 1000) + 3000;
      const other = `feedface00000000 ${deadline} host-z:50055`;
      await admin.hset(REGISTRY, "a", other);
      await admin.pexpire(REGISTRY, 10_000); // as the other's own TTL (5 s) keeps it
      await waitFor("a kept out", () => a.index.stats().conflictWith === "host-z:50055");
      await ticks(a, 5);
      assert.equal(await admin.hget(REGISTRY, "a"), other, "a took the node id back");
      assert.equal((await c.index.lookup(NS, hs)).length, 0);
      assert.equal(logged(a, "error", KEPT_OUT).length, 1);
      // The other's registration expires (it died): a joins again and re-advertises.
      await waitFor(
        "lookups find a's blocks again",
        async () => owners(await c.index.lookup(NS, hs)).join() === "a@a.local:50055=6",
      );
      assert.equal(a.index.stats().conflictWith, null);
      assert.equal(logged(a, "info", /joined the block index/).length, 1);
    },
    ["a", "c"],
    { nodeTtlMs: 1000, heartbeatMs: 100 },
  );
});

Deno.test("withdrawals lost in a connection drop leave no stale entry, even in a namespace the node no longer holds anything of", async () => {
  await withNodes(async (redis, [a, b]) => {
    const NS2 = "fedcba9876543210";
    const xs = hashes(20), ys = hashes(10, 9);
    await save(a, xs);
    for (const h of ys) {
      a.held.set(`y${Buffer.from(h).toString("hex")}`, { namespace: NS2, hash: h });
    }
    assert.equal(await a.index.advertise(NS2, ys), true);
    assert.equal((await b.index.lookup(NS2, ys)).length, 10);
    const rejoins = a.index.stats().rejoins;
    // The connections drop; meanwhile every NS2 block is evicted: its withdraw never reaches Redis.
    const admin = redis.admin();
    await admin.client("KILL", "TYPE", "normal", "SKIPME", "yes");
    for (const k of [...a.held.keys()]) if (k.startsWith("y")) a.held.delete(k);
    assert.equal(await a.index.withdraw(NS2, ys), false);
    await waitFor("a re-joined", () => a.index.up && a.index.stats().rejoins > rejoins);
    await waitFor("a's held blocks are found again", async () => {
      return (await b.index.lookup(NS, xs)).length === 20;
    });
    await a.index.republish();
    assert.deepEqual(
      await b.index.lookup(NS2, ys),
      { length: 0, owners: [], available: true },
      "blocks a no longer holds are still listed under a",
    );
  }, ["a", "b"]);
});
