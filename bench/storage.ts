// Storage policy microbenchmark: the JS cost the KV server pays per request
// for a 10K-token Llama-3.1-8B prefix (625 blocks × 32 layers × K/V of 32 KiB).
// No bytes are copied: this is the bookkeeping around the native copy.
//
//   deno run -A bench/storage.ts [--iterations 200]
//
// Prints a table and writes bench/results/storage.json. Never asserts on time.
import { KvStore } from "../lib/storage/store.ts";
import { benchCli } from "./cli.ts";
import { ITERATIONS_FLAG, iterationsFlag, measure, PREFIX_BLOCKS, prefixHashes } from "./micro.ts";

const BLOCKS = PREFIX_BLOCKS;
const LAYOUT = { layers: 32, tpSize: 1, collapseTp: false, segments: 2, segmentBytes: 32 * 1024 };
const BLOCK_BYTES = 32 * 2 * 32 * 1024;
const NS = "llama31_8b_bench";

const args = benchCli({
  usage: "deno run -A bench/storage.ts [--iterations N]",
  about: "The storage policy's JS cost per request for a 10K-token Llama-3.1-8B prefix " +
    "(query, lease,\nsave, eviction; no bytes copied).",
  flags: { [ITERATIONS_FLAG]: "timed calls per row, after 20 warm-up calls (default 200)" },
  writes: "a table on stdout and bench/results/storage.json",
});
const ITER = iterationsFlag(args, 200);

const hashes = (seed: number) => prefixHashes(seed, true);

const time = (name: string, fn: (i: number) => void) => measure(name, ITER, 20, fn);

// A 30 GiB pool, as the server's default (past ~24 saves it evicts too).
const store = new KvStore({ capacityBytes: 30 * 2 ** 30 });
store.defineNamespace(NS, LAYOUT);
const warm = hashes(0);
const b0 = store.beginSave({ namespace: NS, instance: "bench", rank: 0, hashes: warm });
if (!b0.ok) throw b0.error;
store.completeSave(b0.plan, true);

// Hashes are made before timing: the engine sends bytes, their hex conversion is timed.
const misses = Array.from({ length: ITER + 20 }, (_, i) => hashes(1_000_000 + i));
const fresh = Array.from({ length: ITER + 20 }, (_, i) => hashes(2_000_000 + i));
const fresh2 = Array.from({ length: ITER + 20 }, (_, i) => hashes(3_000_000 + i));
const slot = (i: number) => i + 20; // warm-up calls get i = -1 … -20

const results = [
  time("query 625 hashes, all hit (+ release lease)", () => {
    const q = store.query(NS, warm, "bench");
    store.releaseLease(q.lease!.idBytes);
  }),
  time("query 625 hashes, all miss", (i) => {
    store.query(NS, misses[slot(i)], "bench");
  }),
  time("query + consumeLease + loadDone (625 blocks × 32 layers)", () => {
    const q = store.query(NS, warm, "bench");
    store.loadDone(store.consumeLease(q.lease!.id, "bench", 0));
  }),
  time("beginSave + completeSave, 625 new blocks (40,000 slots)", (i) => {
    const r = store.beginSave({
      namespace: NS,
      instance: "bench",
      rank: 0,
      hashes: fresh[slot(i)],
    });
    if (!r.ok) throw r.error;
    store.completeSave(r.plan, true);
  }),
  time("beginSave of 625 blocks already held (dedup)", () => {
    const r = store.beginSave({ namespace: NS, instance: "bench", rank: 0, hashes: warm });
    if (!r.ok) throw r.error;
    store.completeSave(r.plan, true);
  }),
];

// Under pressure: a pool that holds exactly 2 prefixes, so every save evicts 625 blocks.
const tight = new KvStore({ capacityBytes: 2 * BLOCKS * BLOCK_BYTES });
tight.defineNamespace(NS, LAYOUT);
results.push(time("beginSave + completeSave evicting 625 LRU blocks", (i) => {
  const r = tight.beginSave({ namespace: NS, instance: "bench", rank: 0, hashes: fresh2[slot(i)] });
  if (!r.ok) throw r.error;
  tight.completeSave(r.plan, true);
}));
const st = tight.stats();
tight.verify();

console.log(
  `storage policy, ${BLOCKS} blocks × ${LAYOUT.layers} layers × 2 segments of 32 KiB, ${ITER} iterations`,
);
console.log(`| operation | p50 µs | p99 µs | mean µs |\n|---|---|---|---|`);
for (const r of results) {
  console.log(
    `| ${r.name} | ${r.p50_us.toFixed(0)} | ${r.p99_us.toFixed(0)} | ${r.mean_us.toFixed(0)} |`,
  );
}
console.log(
  `tight pool: ${st.evictions} evictions, ${st.freeExtents} free extents, largest free ${st.largestFreeBytes} B`,
);

await Deno.mkdir(new URL("./results/", import.meta.url), { recursive: true });
await Deno.writeTextFile(
  new URL("./results/storage.json", import.meta.url),
  JSON.stringify(
    {
      bench: "storage-policy",
      command: `deno run -A bench/storage.ts --iterations ${ITER}`,
      deno: Deno.version.deno,
      cpu: Deno.build.target,
      date: new Date().toISOString(),
      blocks: BLOCKS,
      layout: LAYOUT,
      results,
      tight_pool: { evictions: st.evictions, free_extents: st.freeExtents },
    },
    null,
    2,
  ) + "\n",
);
