/**
 * The server's CPU per decode-shaped Save, by thread, in windows of Saves:
 * what a decode step's save costs the server (one block of 16 tokens, every
 * layer's K and V of Llama-3.1-8B, one Save after another) on the real host
 * backend, the real store and the KvEngine's Save handler, in-process (no
 * gRPC). The pool is small by default, so once it is full every Save evicts
 * one block (the steady state of a long-running server). The windows show a
 * fresh server's first Saves, which pay V8's compilation (the server's eager
 * tiering flags: lib/server/v8_flags.ts), apart from the steady state.
 *
 * Runs itself again under the serve task's V8 flags, as the server runs.
 * Prints a table and writes bench/results/save-decode.json. Never asserts.
 *
 *   deno run -A bench/save_decode.ts [--saves 6000] [--window 1000] [--pool-mib 64]
 */
import { serverRunArgs } from "../lib/server/v8_flags.ts";
import { Logger } from "../lib/log.ts";
import { chainedBlockHashes, syntheticTokens } from "../lib/client/hashes.ts";
import { benchCli, positiveInt } from "./cli.ts";
import { KV, openBenchEngine, prefixShape, writeBenchResult } from "./in_process.ts";
import { cpuDeltaMs, sampleCpu } from "./thread_cpu.ts";

const CHILD_ENV = "PEGAFLOW_SAVE_DECODE_CHILD";
const args = benchCli({
  usage: "deno run -A bench/save_decode.ts [--saves N] [--window N] [--pool-mib N]",
  about:
    "The server's CPU per decode-shaped Save (one block, every layer's K and V), by thread,\n" +
    "in windows of Saves, on the host backend.",
  flags: {
    "--saves": "Saves in all (default 6000)",
    "--window": "Saves per row of the table (default 1000)",
    "--pool-mib": "pool size; small, so that every Save evicts once it is full (default 64)",
  },
  writes: "a table on stdout and bench/results/save-decode.json",
});
if (!Deno.env.get(CHILD_ENV)) {
  const child = new Deno.Command(Deno.execPath(), {
    args: [...serverRunArgs(), new URL(import.meta.url).pathname, ...Deno.args],
    env: { [CHILD_ENV]: "1" },
  }).spawn();
  Deno.exit((await child.status).code);
}
const SAVES = positiveInt("--saves", args.flags["--saves"], 6000);
const WINDOW = positiveInt("--window", args.flags["--window"], 1000);
const POOL_MIB = positiveInt("--pool-mib", args.flags["--pool-mib"], 64);

/** The model's shape; one block's tokens (the prefix itself is not used). */
const { model, segBytes } = prefixShape(16);
const bench = await openBenchEngine({
  namespace: "bench-save-decode",
  poolBytes: POOL_MIB << 20,
  simBlocks: 2,
  log: new Logger("error", {}, () => {}),
});
const hashes = chainedBlockHashes(
  syntheticTokens(11, model.blockTokens * (SAVES + 1)),
  model.blockTokens,
);
bench.sim.fill([0, 1], [hashes[0], hashes[1]]);

interface Row {
  saves: string;
  wall_us: number;
  cpu_us: number;
  threads_us: Record<string, number>;
}
const rows: Row[] = [];
const roles = { server: [Deno.pid] };
for (let from = 0; from < SAVES; from += WINDOW) {
  const to = Math.min(SAVES, from + WINDOW);
  const before = sampleCpu(roles);
  const t0 = performance.now();
  for (let i = from; i < to; i++) {
    await bench.engine.save({
      instanceId: "bench",
      tpRank: 0,
      ppRank: 0,
      layers: [],
      blockIds: [i & 1],
      blockHashes: [hashes[i]],
    });
  }
  const n = to - from;
  const wall = performance.now() - t0;
  const d = cpuDeltaMs(before, sampleCpu(roles));
  const threads_us: Record<string, number> = {};
  for (const [k, ms] of Object.entries(d)) {
    if (k !== "server total") threads_us[k.slice("server ".length)] = round(ms * 1000 / n);
  }
  rows.push({
    saves: `${from + 1}-${to}`,
    wall_us: round(wall * 1000 / n),
    cpu_us: round(d["server total"] * 1000 / n),
    threads_us,
  });
}
await bench.close();

function round(x: number): number {
  return Math.round(x * 10) / 10;
}

const names = [...new Set(rows.flatMap((r) => Object.keys(r.threads_us)))].sort();
console.log(
  `decode-shaped Saves: 1 block × ${model.numLayers} layers × ${KV} (${segBytes} B each), ` +
    `pool ${POOL_MIB} MiB, µs per Save (CPU: the process's total, then by thread)`,
);
console.table(rows.map((r) => ({
  saves: r.saves,
  wall: r.wall_us,
  cpu: r.cpu_us,
  ...Object.fromEntries(names.map((k) => [k, r.threads_us[k] ?? 0])),
})));
await writeBenchResult("bench/results", "save-decode.json", "bench/save_decode.ts", {
  layers: model.numLayers,
  segment_bytes: segBytes,
  pool_mib: POOL_MIB,
  saves: SAVES,
  window: WINDOW,
  v8_flags: serverRunArgs().find((a) => a.startsWith("--v8-flags=")),
  rows,
});
console.log("wrote bench/results/save-decode.json");
