// The JS cost of the RAM side of the Tier port for a 10K-token Llama-3.1-8B
// prefix (625 blocks × 32 layers × K/V of 32 KiB, TP=2): pinning a sealed
// batch for write-behind and planning + committing a prefetch into RAM,
// through the TierHost (one transfer lock per batch; one beginFill per block)
// beside what the SSD bridge did before it (one transfer lock per block; one
// beginSave per block and rank slot), on the same store. No bytes are copied.
//
//   deno run -A bench/tier_host.ts [--iterations 100]
//
// Prints a table and writes bench/results/tier_host.json. Never asserts on time.
import { KvStore, type SavePlan } from "../lib/storage/store.ts";
import { benchCli } from "./cli.ts";
import {
  ITERATIONS_FLAG,
  iterationsFlag,
  measure,
  type MicroRow,
  PREFIX_BLOCKS,
  prefixHashes,
} from "./micro.ts";
import { storeTierHost } from "../lib/storage/tier_host.ts";
import { mergeExtents } from "../lib/transfer/ranges.ts";

const BLOCKS = PREFIX_BLOCKS;
const LAYOUT = { layers: 32, tpSize: 2, collapseTp: false, segments: 2, segmentBytes: 32 * 1024 };
const NS = "llama31_8b_tp2_bench";

const args = benchCli({
  usage: "deno run -A bench/tier_host.ts [--iterations N]",
  about: "The JS cost of the RAM side of the Tier port for a 10K-token prefix (TP=2): pinning " +
    "a sealed batch,\nplanning and committing a prefetch; TierHost beside the per-block path.",
  flags: { [ITERATIONS_FLAG]: "timed calls per row, after 10 warm-up calls (default 100)" },
  writes: "a table on stdout and bench/results/tier_host.json",
});
const ITER = iterationsFlag(args, 100);

const hashes = (seed: number) => prefixHashes(seed, false);

const time = (name: string, fn: (i: number) => void) => measure(name, ITER, 10, fn);

// Room for the sealed prefix plus one prefix being filled (the filled one is evicted each round).
const blockBytes = LAYOUT.layers * LAYOUT.tpSize * LAYOUT.segments * LAYOUT.segmentBytes;
const store = new KvStore({ capacityBytes: 3 * BLOCKS * blockBytes });
store.defineNamespace(NS, LAYOUT);
const host = storeTierHost(store);
const sealed = hashes(0);
for (let rank = 0; rank < LAYOUT.tpSize; rank++) {
  const b = store.beginSave({ namespace: NS, instance: "bench", rank, hashes: sealed });
  if (!b.ok) throw b.error;
  store.completeSave(b.plan, true);
}

const rows: MicroRow[] = [];
rows.push(time("write pin: one transfer lock for 625 blocks (TierHost.pin) + release", () => {
  const pin = host.pin(NS, sealed, "ssd");
  if (!pin || pin.blocks.some((b) => !b)) throw new Error("pin lost a block");
  pin.release();
}));
rows.push(time("write pin before: 625 transfer locks (one per block) + releases", () => {
  for (const h of sealed) {
    const lock = store.lockForTransfer(NS, [h], "ssd-write-behind");
    if (!lock) throw new Error("lock lost a block");
    // The bridge merged each block's offsets into extents, as TierHost.pin does
    // (a one-block lock's table is that block's offsets in payload order).
    mergeExtents(lock.offsets, lock.segmentBytes);
    store.releaseTransferLock(lock.id);
  }
}));

// Fills: a fresh prefix each round, evicted afterwards so the pool never fills up.
let round = 1;
const drop = () => store.evictAll();
rows.push(time("prefetch fill: 625 × beginFill (whole block) + commit", () => {
  const hs = hashes(round++);
  for (const h of hs) {
    const f = host.fill(NS, h, "ssd", "retained");
    if (!f) throw new Error("fill refused");
    f.commit();
  }
  drop();
}));
rows.push(time("prefetch fill before: 625 × 2 ranks × beginSave + completeSave", () => {
  const hs = hashes(round++);
  for (const h of hs) {
    const plans: SavePlan[] = [];
    for (let rank = 0; rank < LAYOUT.tpSize; rank++) {
      const b = store.beginSave({ namespace: NS, instance: "ssd", rank, hashes: [h] });
      if (!b.ok) throw b.error;
      plans.push(b.plan);
    }
    for (const p of plans) store.completeSave(p, true);
  }
  drop();
}));
store.verify();

console.log(`| operation (625 blocks, 32 layers × TP 2 × K/V) | p50 µs | p99 µs | mean µs |`);
console.log(`|---|---|---|---|`);
for (const r of rows) {
  console.log(
    `| ${r.name} | ${r.p50_us.toFixed(0)} | ${r.p99_us.toFixed(0)} | ${r.mean_us.toFixed(0)} |`,
  );
}
await Deno.mkdir("bench/results", { recursive: true });
await Deno.writeTextFile(
  new URL("./results/tier_host.json", import.meta.url),
  JSON.stringify({ date: new Date().toISOString(), iterations: ITER, rows }, null, 2) + "\n",
);
