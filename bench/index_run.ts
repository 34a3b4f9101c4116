// Block index benchmark: the cost of the cross-node index calls for a
// 10K-token prefix (625 blocks of 16 tokens, 32-byte chained hashes) against
// a local redis-server, measured at the client (what the KV server pays per
// call, one round trip) and at Redis (`INFO commandstats`, time inside the
// script).
//
//   deno run -A bench/index_run.ts [--iterations 300] [--redis redis://host:port]
//
// Without --redis it starts its own redis-server (persistence off) on a free
// port. Prints a table and writes bench/results/index.json. Never asserts on time.
// A script, not `Deno.bench` cases: named *_run.ts so that `deno bench` (which
// picks up *_bench.ts under bench/) does not run it and rewrite the result.
import { Redis } from "ioredis";
import { RedisBlockIndex } from "../lib/index/block_index.ts";
import { startRedis } from "../tests/index/_redis.ts";
import { benchCli } from "./cli.ts";
import { ITERATIONS_FLAG, iterationsFlag, PREFIX_BLOCKS, prefixHashes } from "./micro.ts";
import { latencyRow } from "./stats.ts";

const args = benchCli({
  usage: "deno run -A bench/index_run.ts [--iterations N] [--redis URL]",
  about: "The block index's calls (advertise, withdraw, lookup of a 625-block prefix) against " +
    "Redis,\ntimed at the client and inside Redis (INFO commandstats).",
  flags: {
    [ITERATIONS_FLAG]: "timed calls per row, after 30 warm-up calls (default 300)",
    "--redis": "an external Redis to use (default: starts its own redis-server, persistence off)",
  },
  writes: "a table on stdout and bench/results/index.json",
});

const BLOCKS = PREFIX_BLOCKS;
const NS = "llama31_8b_bench";
const WARMUP = 30;
/** Saves the advertising node holds in steady state: 100K blocks, ~200 GB of Llama-3.1-8B KV. */
const HELD_SAVES = 160;

const ITER = iterationsFlag(args, 300);

const hashes = (seed: number) => prefixHashes(seed, true);

interface Row {
  name: string;
  p50_us: number;
  p99_us: number;
  mean_us: number;
  /** Mean time Redis spent in the script (EVALSHA usec_per_call; 0 for the PING row). */
  redis_us: number;
}

async function evalshaUsec(admin: Redis): Promise<{ calls: number; usec: number }> {
  const line = (await admin.info("commandstats")).split("\n").find((l) =>
    l.startsWith("cmdstat_evalsha:")
  );
  const m = line && /calls=(\d+),usec=(\d+)/.exec(line);
  return m ? { calls: Number(m[1]), usec: Number(m[2]) } : { calls: 0, usec: 0 };
}

/** Times `fn` (one call each); `after` runs untimed between iterations (keeps state steady). */
async function measure(
  admin: Redis,
  name: string,
  fn: (i: number) => Promise<unknown>,
  after?: (i: number) => Promise<unknown>,
): Promise<Row> {
  for (let i = 0; i < WARMUP; i++) {
    await fn(-1 - i);
    await after?.(-1 - i);
  }
  const t: number[] = [];
  let calls = 0;
  let usec = 0;
  for (let i = 0; i < ITER; i++) {
    const before = await evalshaUsec(admin);
    const t0 = performance.now();
    await fn(i);
    t.push((performance.now() - t0) * 1000);
    const done = await evalshaUsec(admin);
    calls += done.calls - before.calls;
    usec += done.usec - before.usec;
    await after?.(i);
  }
  return { ...latencyRow(name, t), redis_us: calls > 0 ? usec / calls : 0 };
}

const external = args.flags["--redis"];
const server = external ? undefined : await startRedis();
const url = external ?? server!.url;
const admin = new Redis(url);
const mk = (id: string) =>
  new RedisBlockIndex({ url, nodeId: id, advertiseAddr: `${id}:50055`, listSealed: () => [] });
const [a, b, c, asker] = [mk("node-a"), mk("node-b"), mk("node-c"), mk("asker")];
const nodes = [a, b, c, asker];
const rows: Row[] = [];
try {
  for (const n of nodes) n.start();
  while (!nodes.every((n) => n.up)) await new Promise((r) => setTimeout(r, 10));

  rows.push(await measure(admin, "PING (one round trip, for reference)", () => admin.ping()));
  // Steady state of a node whose pool holds HELD_SAVES saves: every save advertises 625
  // blocks the index has not seen, and eviction withdraws the oldest save (untimed here).
  const held = Array.from({ length: HELD_SAVES }, (_, i) => hashes(500_000 + i));
  for (const h of held) await a.advertise(NS, h);
  const saves = Array.from({ length: WARMUP + ITER }, (_, i) => hashes(1000 + i));
  const save = (i: number) => saves[i < 0 ? -1 - i : WARMUP + i];
  rows.push(
    await measure(
      admin,
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
      admin,
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
    await measure(admin, "lookup 625 hashes, one owner holds all", () => asker.lookup(NS, prefix)),
  );
  await b.advertise(NS, prefix.slice(0, 400));
  await c.advertise(NS, prefix.slice(0, 100));
  rows.push(
    await measure(
      admin,
      "lookup 625 hashes, 3 owners (625/400/100)",
      () => asker.lookup(NS, prefix),
    ),
  );
  const miss = hashes(99);
  rows.push(await measure(admin, "lookup 625 hashes, all miss", () => asker.lookup(NS, miss)));
} finally {
  for (const n of nodes) await n.close();
  admin.disconnect();
  await server?.stop();
}

const fmt = (n: number) => n.toFixed(0).padStart(8);
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
const out = new URL("./results/index.json", import.meta.url).pathname;
await Deno.writeTextFile(
  out,
  JSON.stringify(
    {
      date: new Date().toISOString(),
      iterations: ITER,
      blocks: BLOCKS,
      redis: external ? "external" : "local redis-server, persistence off",
      cpus: navigator.hardwareConcurrency,
      rows,
    },
    null,
    2,
  ) + "\n",
);
console.log(`wrote ${out}`);
