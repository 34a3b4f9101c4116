// Block index benchmark: the cost of the cross-node index calls for a
// 10K-token prefix (625 blocks of 16 tokens, 32-byte chained hashes) against
// a local redis-server, measured at the client (what the KV server pays per
// call, one round trip) and at Redis (`INFO commandstats`, time inside the
// index's scripts), plus one node's heartbeat over several namespaces.
//
//   deno run -A bench/index_run.ts [--iterations 300] [--redis redis://host:port]
//   deno run -A bench/index_run.ts --cluster [--iterations 300] [--redis SEED,SEED,...]
//
// Without --redis it starts its own redis-server (persistence off) on a free
// port, or with --cluster a 3-master Redis Cluster (tests/index/_redis_cluster.ts);
// --redis with --cluster takes the cluster's seeds, comma-separated. On a
// cluster the index runs in cluster mode (`--index-redis-cluster`), the Redis
// column is read from the master serving the bench namespace's slot, and the
// heartbeat's namespaces sit on every master (one pipeline per hash tag, sent
// at once). Prints a table and writes bench/results/index.json (with --cluster,
// bench/results/index-cluster.json). Never asserts on time.
// A script, not `Deno.bench` cases: named *_run.ts so that `deno bench` (which
// picks up *_bench.ts under bench/) does not run it and rewrite the result.
import { Redis } from "ioredis";
import { RedisBlockIndex } from "../lib/index/block_index.ts";
import { nodesKey } from "../lib/index/keys.ts";
import { startRedis } from "../tests/index/_redis.ts";
import { startRedisCluster } from "../tests/index/_redis_cluster.ts";
import { benchCli } from "./cli.ts";
import {
  ITERATIONS_FLAG,
  iterationsFlag,
  type MicroRow,
  PREFIX_BLOCKS,
  prefixHashes,
} from "./micro.ts";
import { latencyRow } from "./stats.ts";

/** A switch, not a value flag: taken out of the arguments before bench/cli.ts parses them. */
const CLUSTER_FLAG = "--cluster";
const args = benchCli({
  usage: "deno run -A bench/index_run.ts [--cluster] [--iterations N] [--redis URL[,URL...]]",
  about:
    "The block index's calls (advertise, withdraw, lookup of a 625-block prefix, a heartbeat " +
    "over 6 namespaces)\nagainst Redis or a Redis Cluster, timed at the client and inside Redis " +
    "(INFO commandstats).",
  flags: {
    [ITERATIONS_FLAG]: "timed calls per row, after 30 warm-up calls (default 300)",
    "--redis":
      "an external Redis to use (default: starts its own redis-server, persistence off); " +
      "with --cluster, the cluster's seed URLs, comma-separated",
    [CLUSTER_FLAG]: "takes no value: run the index in Redis Cluster mode (default: starts its " +
      "own 3-master cluster, persistence off)",
  },
  writes: "a table on stdout and bench/results/index.json (--cluster: index-cluster.json)",
}, Deno.args.filter((a) => a !== CLUSTER_FLAG));
if (args.flags[CLUSTER_FLAG] !== undefined) {
  console.error(`${CLUSTER_FLAG} takes no value (got ${CLUSTER_FLAG}=${args.flags[CLUSTER_FLAG]})`);
  Deno.exit(2);
}
const CLUSTER = Deno.args.includes(CLUSTER_FLAG);
const EXTERNAL = args.flags["--redis"];

const BLOCKS = PREFIX_BLOCKS;
const NS = "llama31_8b_bench";
const WARMUP = 30;
/** Saves the advertising node holds in steady state: 100K blocks, ~200 GB of Llama-3.1-8B KV. */
const HELD_SAVES = 160;
/** Namespaces the heartbeat row's node has joined (models/layouts it serves): 2 per master of 3. */
const HEARTBEAT_NAMESPACES = 6;
/**
 * Node TTL of the bench's nodes: long, so that their timer heartbeats (every TTL / 3) never land
 * inside a timed call or its commandstats window. The scripts cost the same whatever the TTL.
 */
const BENCH_NODE_TTL_MS = 3_600_000;

const ITER = iterationsFlag(args, 300);

const hashes = (seed: number) => prefixHashes(seed, true);

interface Row extends MicroRow {
  /**
   * Time Redis spent in the index's scripts per timed call, in µs (EVAL + EVALSHA `usec` of
   * INFO commandstats, summed over the masters the row reaches; 0 for the PING row).
   */
  redis_us: number;
}

/** Where the bench runs: one Redis, or a cluster's masters (each reached with a plain client). */
interface Target {
  /** What `RedisBlockIndex` takes as `url` (with `cluster`, the seeds). */
  url: string;
  cluster: boolean;
  /** A plain client per master, `host:port` each (one entry on one Redis). */
  masters: { addr: string; admin: Redis }[];
  /** Index into `masters` of the one serving `key` (its slot, on a cluster). */
  ownerOf(key: string): Promise<number>;
  /** What the JSON says the target was. */
  describe: string;
  stop(): Promise<void>;
}

async function singleTarget(): Promise<Target> {
  const server = EXTERNAL ? undefined : await startRedis();
  const url = EXTERNAL ?? server!.url;
  const admin = new Redis(url);
  const u = new URL(url);
  return {
    url,
    cluster: false,
    masters: [{ addr: `${u.hostname}:${u.port || 6379}`, admin }],
    ownerOf: () => Promise.resolve(0),
    describe: EXTERNAL ? "external Redis" : "local redis-server, persistence off",
    async stop() {
      admin.disconnect();
      await server?.stop();
    },
  };
}

/** The cluster's masters from CLUSTER SLOTS on the first seed; a key's owner by CLUSTER KEYSLOT. */
async function clusterTarget(): Promise<Target> {
  const local = EXTERNAL ? undefined : await startRedisCluster();
  const url = EXTERNAL ?? local!.url;
  const seed = url.split(",")[0];
  const probe = new Redis(seed);
  try {
    const slots = await probe.call("CLUSTER", "SLOTS") as [number, number, [string, number]][];
    const addrs = [...new Set(slots.map(([, , [host, port]]) => `${host}:${port}`))].sort();
    const masters = addrs.map((addr) => {
      const u = new URL(seed); // the seed's credentials and db, another master's address
      [u.hostname, u.port] = addr.split(":");
      return { addr, admin: new Redis(u.href) };
    });
    return {
      url,
      cluster: true,
      masters,
      async ownerOf(key) {
        const slot = Number(await probe.call("CLUSTER", "KEYSLOT", key));
        const r = slots.find(([lo, hi]) => slot >= lo && slot <= hi);
        if (!r) throw new Error(`slot ${slot} of ${key} is served by no master (seed ${seed})`);
        return addrs.indexOf(`${r[2][0]}:${r[2][1]}`);
      },
      describe: EXTERNAL
        ? `external Redis Cluster, ${masters.length} masters`
        : `local Redis Cluster, ${masters.length} masters, no replicas, persistence off`,
      async stop() {
        probe.disconnect();
        for (const m of masters) m.admin.disconnect();
        await local?.stop();
      },
    };
  } catch (e) {
    probe.disconnect();
    await local?.stop();
    throw e;
  }
}

/**
 * µs spent in EVAL and EVALSHA so far, summed over `admins` (INFO commandstats): advertise,
 * withdraw and heartbeat go as EVAL, lookup as EVALSHA (lib/index/connection.ts).
 */
async function scriptUsec(admins: readonly Redis[]): Promise<number> {
  let usec = 0;
  for (const admin of admins) {
    for (const line of (await admin.info("commandstats")).split("\n")) {
      const m = /^cmdstat_eval(?:sha)?:calls=\d+,usec=(\d+)/.exec(line);
      if (m) usec += Number(m[1]);
    }
  }
  return usec;
}

/**
 * Times `fn` (one call each) and reads the script time it cost on `admins`; `after` runs untimed
 * between iterations (keeps state steady).
 */
async function measure(
  admins: readonly Redis[],
  name: string,
  fn: (i: number) => Promise<unknown>,
  after?: (i: number) => Promise<unknown>,
): Promise<Row> {
  for (let i = 0; i < WARMUP; i++) {
    await fn(-1 - i);
    await after?.(-1 - i);
  }
  const t: number[] = [];
  let usec = 0;
  for (let i = 0; i < ITER; i++) {
    const before = await scriptUsec(admins);
    const t0 = performance.now();
    await fn(i);
    t.push((performance.now() - t0) * 1000);
    usec += await scriptUsec(admins) - before;
    await after?.(i);
  }
  return { ...latencyRow(name, t), redis_us: usec / ITER };
}

/** `n` namespaces spread evenly over the target's masters (by their registry key's slot). */
async function spreadNamespaces(target: Target, n: number): Promise<string[]> {
  const perMaster = Math.ceil(n / target.masters.length);
  const taken = target.masters.map(() => 0);
  const out: string[] = [];
  for (let i = 0; out.length < n && i < 1000; i++) {
    const ns = `${NS}_hb${i}`;
    const m = await target.ownerOf(nodesKey(ns));
    if (taken[m] < perMaster) {
      taken[m]++;
      out.push(ns);
    }
  }
  if (out.length < n) throw new Error(`found ${out.length} of ${n} namespaces spread over masters`);
  return out;
}

/** The rows of `bench` (`a` advertises, `b`, `c` hold shorter prefixes, `asker` looks up). */
async function indexRows(bench: Redis, nodes: RedisBlockIndex[]): Promise<Row[]> {
  const [a, b, c, asker] = nodes;
  const rows: Row[] = [];
  const on = [bench];
  rows.push(await measure(on, "PING (one round trip, for reference)", () => bench.ping()));
  // Steady state of a node whose pool holds HELD_SAVES saves: every save advertises 625
  // blocks the index has not seen, and eviction withdraws the oldest save (untimed here).
  const held = Array.from({ length: HELD_SAVES }, (_, i) => hashes(500_000 + i));
  for (const h of held) await a.advertise(NS, h);
  const saves = Array.from({ length: WARMUP + ITER }, (_, i) => hashes(1000 + i));
  const save = (i: number) => saves[i < 0 ? -1 - i : WARMUP + i];
  rows.push(
    await measure(
      on,
      `advertise 625 new blocks (node holds ${HELD_SAVES * BLOCKS / 1000}K)`,
      (i) => a.advertise(NS, save(i)),
      async (i) => {
        await a.withdraw(NS, held.shift()!);
        held.push(save(i));
      },
    ),
  );
  rows.push(
    await measure(
      on,
      "withdraw 625 blocks (an eviction)",
      () => a.withdraw(NS, held[0]),
      () => {
        // Put the withdrawn save back (untimed) at the end of the rotation.
        const h = held.shift()!;
        held.push(h);
        return a.advertise(NS, h);
      },
    ),
  );
  const prefix = hashes(7);
  await a.advertise(NS, prefix);
  rows.push(
    await measure(on, "lookup 625 hashes, one owner holds all", () => asker.lookup(NS, prefix)),
  );
  await b.advertise(NS, prefix.slice(0, 400));
  await c.advertise(NS, prefix.slice(0, 100));
  rows.push(
    await measure(on, "lookup 625 hashes, 3 owners (625/400/100)", () => asker.lookup(NS, prefix)),
  );
  const miss = hashes(99);
  rows.push(await measure(on, "lookup 625 hashes, all miss", () => asker.lookup(NS, miss)));
  return rows;
}

/** The heartbeat of a node that joined `namespaces` (each holding one save), on every master. */
async function heartbeatRow(
  target: Target,
  node: RedisBlockIndex,
  namespaces: readonly string[],
): Promise<Row> {
  for (const [i, ns] of namespaces.entries()) await node.advertise(ns, hashes(900_000 + i));
  const on = CLUSTER ? ` on ${target.masters.length} masters` : "";
  return await measure(
    target.masters.map((m) => m.admin),
    `heartbeat, ${namespaces.length} namespaces${on}`,
    () => node.heartbeat(),
  );
}

const target = await (CLUSTER ? clusterTarget() : singleTarget());
const mk = (id: string) =>
  new RedisBlockIndex({
    url: target.url,
    cluster: target.cluster,
    nodeId: id,
    advertiseAddr: `${id}:50055`,
    listSealed: () => [],
    nodeTtlMs: BENCH_NODE_TTL_MS,
  });
const nodes = ["node-a", "node-b", "node-c", "asker", "node-hb"].map(mk);
let rows: Row[] = [];
let benchMaster = "";
const hbNamespaces: Record<string, string> = {};
try {
  const bench = target.masters[await target.ownerOf(nodesKey(NS))];
  benchMaster = bench.addr;
  const spread = await spreadNamespaces(target, HEARTBEAT_NAMESPACES);
  for (const ns of spread) {
    hbNamespaces[ns] = target.masters[await target.ownerOf(nodesKey(ns))].addr;
  }
  for (const n of nodes) n.start();
  while (!nodes.every((n) => n.up)) await new Promise((r) => setTimeout(r, 10));
  rows = await indexRows(bench.admin, nodes);
  rows.push(await heartbeatRow(target, nodes[4], spread));
} finally {
  for (const n of nodes) await n.close();
  await target.stop();
}

// A failed call (deadline, outage) is timed like a success: the table says so if one happened.
const errors = Object.fromEntries(nodes.map((n) => [n.nodeId, n.stats().errors]));
const failed = Object.entries(errors).filter(([, n]) => n > 0);
if (failed.length > 0) {
  console.error(
    `index calls failed during the run (timed anyway): ${
      failed.map(([id, n]) => `${id}: ${n}`).join(", ")
    }`,
  );
}

const fmt = (n: number) => n.toFixed(0).padStart(8);
console.log(`${target.describe}; bench namespace ${NS} on ${benchMaster}`);
console.log(
  `${"operation".padEnd(44)} ${"p50 µs".padStart(8)} ${"p99 µs".padStart(8)} ${
    "mean µs".padStart(8)
  } ${"redis µs".padStart(8)}`,
);
for (const r of rows) {
  console.log(
    `${r.name.padEnd(44)} ${fmt(r.p50_us)} ${fmt(r.p99_us)} ${fmt(r.mean_us)} ${fmt(r.redis_us)}`,
  );
}
const file = CLUSTER ? "index-cluster.json" : "index.json";
await Deno.mkdir(new URL("./results/", import.meta.url), { recursive: true });
const out = new URL(`./results/${file}`, import.meta.url).pathname;
await Deno.writeTextFile(
  out,
  JSON.stringify(
    {
      date: new Date().toISOString(),
      iterations: ITER,
      blocks: BLOCKS,
      redis: target.describe,
      cluster: target.cluster,
      bench_master: benchMaster,
      heartbeat_namespaces: hbNamespaces,
      index_errors: errors,
      cpus: navigator.hardwareConcurrency,
      rows,
    },
    null,
    2,
  ) + "\n",
);
console.log(`wrote ${out}`);
