/**
 * The JS work of a Save, in-process (no gRPC): the KvEngine's Save handler
 * for a 10K-token Llama-3.1-8B prefix (625 blocks × 32 layers × K/V), on the
 * real host backend and the real store: validation, the store's save plan
 * (dedup, room, allocation), the gather batch, and sealing. The native copy
 * runs but is reported apart (the engine's debug log splits the phases).
 * Each iteration saves a fresh prefix into a pool that holds two, so from the
 * third on every save evicts the prefix before last (the steady state of a
 * full pool).
 *
 * Prints a table and writes bench/results/save-prepare.json. Never asserts.
 *
 *   deno run -A bench/save_prepare.ts --tokens 10000 --iters 30
 */
import { Command } from "commander";
import { KvEngine, PROTOCOL_VERSION } from "../lib/engine/engine.ts";
import { openNative } from "../lib/engine/native_adapter.ts";
import { KvStore } from "../lib/storage/store.ts";
import { Logger } from "../lib/log.ts";
import { PegaflowClient } from "../lib/client/client.ts";
import { chainedBlockHashes, syntheticTokens } from "../lib/client/hashes.ts";
import { LLAMA_3_1_8B, SimEngine } from "../lib/client/sim_engine.ts";

const o = new Command("bench-save-prepare")
  .option("--tokens <n>", "prefix length in tokens", "10000")
  .option("--iters <n>", "timed iterations", "30")
  .option("--out <dir>", "where to write the JSON", "bench/results")
  .parse(["deno", "run", ...Deno.args])
  .opts<{ tokens: string; iters: string; out: string }>();

const model = LLAMA_3_1_8B;
const KV = 2;
const blocks = Math.floor(Number(o.tokens) / model.blockTokens);
const iters = Number(o.iters);
const segBytes = model.blockTokens * model.kvHeads * model.headDim * model.dtypeBytes;
const prefixBytes = blocks * model.numLayers * KV * segBytes;
/** Iterations left out of the table: the first ones fault the mappings in and warm the JIT. */
const WARMUP = 2;

function pct(xs: number[], p: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
}

/** The engine logs each save's phases at debug level; collect them. */
const phases: { plan_ms: number; build_ms: number; seal_ms: number; validate_ms: number }[] = [];
const log = new Logger("debug", {}, (line) => {
  if (line.includes('"save done"')) phases.push(JSON.parse(line));
});
const native = await openNative({
  backend: "host",
  devices: [0],
  poolBytes: Math.ceil((2 * prefixBytes * 1.05) / (1 << 20)) * (1 << 20),
  useHugepages: false,
  transferPath: "auto",
}, log);
const store = new KvStore({ capacityBytes: native.poolBytes });
const engine = new KvEngine({ native, store, log, leaseTtlMs: 60_000 });
const client = new PegaflowClient("127.0.0.1:1");
const sim = SimEngine.create({
  client,
  instanceId: "bench",
  namespace: "bench-save",
  model,
  numBlocks: blocks,
  backend: "host",
});
const planeBytes = sim.numBlocks * segBytes;
const handlerMs: number[] = [];
try {
  engine.register({
    instanceId: "bench",
    namespace: "bench-save",
    tpRank: 0,
    tpSize: 1,
    ppRank: 0,
    ppSize: 1,
    worldSize: 1,
    deviceId: 0,
    layerNames: sim.layerNames,
    regionHandles: sim.regions.map((r) => r.handle),
    geometry: sim.regions.map(() => ({
      numBlocks: sim.numBlocks,
      blockStride: segBytes,
      segStride: planeBytes,
      segBytes,
      numSegments: KV,
      baseOffset: 0,
      regionBytes: KV * planeBytes,
    })),
    clientVersion: PROTOCOL_VERSION,
  });
  const ids = Array.from({ length: blocks }, (_, i) => i);
  for (let i = 0; i < iters + WARMUP; i++) {
    const hashes = chainedBlockHashes(syntheticTokens(100 + i, blocks * model.blockTokens), 16);
    const t0 = performance.now();
    const r = await engine.save({
      instanceId: "bench",
      tpRank: 0,
      ppRank: 0,
      layers: [],
      blockIds: ids,
      blockHashes: hashes,
    });
    if (i >= WARMUP) handlerMs.push(performance.now() - t0);
    if (r.blocksSaved !== blocks) throw new Error(`saved ${r.blocksSaved}/${blocks}`);
  }
  const timed = phases.slice(WARMUP);
  const col = (f: (p: typeof timed[number]) => number) => timed.map(f);
  const rows = [
    { what: "validate (handler checks)", ms: col((p) => p.validate_ms) },
    { what: "plan (store.beginSave, evicting)", ms: col((p) => p.plan_ms) },
    { what: "build (gather batch)", ms: col((p) => p.build_ms) },
    { what: "seal (store.completeSave)", ms: col((p) => p.seal_ms) },
    {
      what: "JS total (validate+plan+build+seal)",
      ms: col((p) => p.validate_ms + p.plan_ms + p.build_ms + p.seal_ms),
    },
    { what: "whole Save incl. host memcpy", ms: handlerMs },
  ].map((r) => ({
    what: r.what,
    p50_ms: pct(r.ms, 50).toFixed(3),
    p99_ms: pct(r.ms, 99).toFixed(3),
  }));
  console.log(`${blocks} blocks × ${model.numLayers} layers × ${KV} segments, ${iters} iterations`);
  console.table(rows);
  await Deno.mkdir(o.out, { recursive: true });
  await Deno.writeTextFile(
    `${o.out}/save-prepare.json`,
    JSON.stringify(
      {
        blocks,
        layers: model.numLayers,
        iters,
        date: new Date().toISOString(),
        command: `deno run -A bench/save_prepare.ts ${Deno.args.join(" ")}`.trim(),
        rows,
      },
      null,
      2,
    ) + "\n",
  );
} finally {
  await engine.close();
  await native.close();
  sim.close();
  client.close();
}
