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
import { Logger } from "../lib/log.ts";
import { chainedBlockHashes, syntheticTokens } from "../lib/client/hashes.ts";
import {
  benchOptions,
  KV,
  openBenchEngine,
  prefixShape,
  printTable,
  writeBenchResult,
} from "./in_process.ts";

const o = benchOptions("bench-save-prepare", "save-prepare.json");
const { model, blocks, prefixBytes } = prefixShape(o.tokens);
const iters = o.iters;
/** Iterations left out of the table: the first ones fault the mappings in and warm the JIT. */
const WARMUP = 2;

/** The engine logs each save's phases at debug level; collect them. */
const phases: { plan_ms: number; build_ms: number; seal_ms: number; validate_ms: number }[] = [];
const log = new Logger("debug", {}, (line) => {
  if (line.includes('"save done"')) phases.push(JSON.parse(line));
});
const bench = await openBenchEngine({
  namespace: "bench-save",
  poolBytes: 2 * prefixBytes * 1.05,
  simBlocks: blocks,
  log,
});
const { engine } = bench;
const handlerMs: number[] = [];
try {
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
  const rows = printTable(
    `${blocks} blocks × ${model.numLayers} layers × ${KV} segments, ${iters} iterations`,
    [
      { what: "validate (handler checks)", ms: col((p) => p.validate_ms) },
      { what: "plan (store.beginSave, evicting)", ms: col((p) => p.plan_ms) },
      { what: "build (gather batch)", ms: col((p) => p.build_ms) },
      { what: "seal (store.completeSave)", ms: col((p) => p.seal_ms) },
      {
        what: "JS total (validate+plan+build+seal)",
        ms: col((p) => p.validate_ms + p.plan_ms + p.build_ms + p.seal_ms),
      },
      { what: "whole Save incl. host memcpy", ms: handlerMs },
    ],
  );
  await writeBenchResult(o.out, "save-prepare.json", "bench/save_prepare.ts", {
    blocks,
    layers: model.numLayers,
    iters,
    rows,
  });
} finally {
  await bench.close();
}
