/**
 * The JS work around a warm load, in-process (no gRPC): the KvEngine's
 * QueryPrefetch handler (store.query + lease) and the Load handler up to the
 * native submit (load state, lease consume, target-id checks, the scatter
 * batch) for a 10K-token Llama-3.1-8B prefix, on the real host backend and
 * the real store. The scatter itself is awaited between iterations but not
 * timed here (bench/server.ts measures the whole stack).
 *
 * Prints a table and writes bench/results/load-prepare.json. Never asserts.
 *
 *   deno run -A bench/load_prepare.ts --tokens 10000 --iters 30
 *   deno run -A --v8-flags=--cpu-prof bench/load_prepare.ts   # where the time goes
 */
import { Logger } from "../lib/log.ts";
import { LoadState } from "../lib/client/load_state.ts";
import { chainedBlockHashes, syntheticTokens } from "../lib/client/hashes.ts";
import {
  benchOptions,
  KV,
  openBenchEngine,
  prefixShape,
  printTable,
  writeBenchResult,
} from "./in_process.ts";
import { pct } from "./stats.ts";

const o = benchOptions("bench-load-prepare", "load-prepare.json");
const { model, blocks, prefixBytes } = prefixShape(o.tokens);
const iters = o.iters;

/** The engine logs each load's prepare_ms at debug level; collect them. */
const prepareMs: number[] = [];
const log = new Logger("debug", {}, (line) => {
  if (line.includes('"load done"')) prepareMs.push(JSON.parse(line).prepare_ms);
});
const bench = await openBenchEngine({
  namespace: "bench-prepare",
  poolBytes: prefixBytes * 1.1,
  simBlocks: 2 * blocks,
  log,
});
const { engine } = bench;
const st = LoadState.create();
const queryMs: number[] = [];
const loadSubmitMs: number[] = [];
try {
  const src = Array.from({ length: blocks }, (_, i) => i);
  const dst = Array.from({ length: blocks }, (_, i) => blocks + i);
  const hashes = chainedBlockHashes(
    syntheticTokens(7, blocks * model.blockTokens),
    model.blockTokens,
  );
  const saved = await engine.save({
    instanceId: "bench",
    tpRank: 0,
    ppRank: 0,
    layers: [],
    blockIds: src,
    blockHashes: hashes,
  });
  if (saved.blocksSaved !== blocks) throw new Error(`saved ${saved.blocksSaved}/${blocks}`);
  for (let i = 0; i < iters + 2; i++) {
    st.rearm();
    const t0 = performance.now();
    const q = engine.query("bench", hashes, `q-${i}`);
    const t1 = performance.now();
    if (q.hits !== blocks || !q.leaseId) throw new Error(`query hit ${q.hits}/${blocks}`);
    const l = await engine.load({
      instanceId: "bench",
      tpRank: 0,
      ppRank: 0,
      leaseId: q.leaseId,
      blockIds: dst,
      loadStateShm: st.name,
      requestId: `l-${i}`,
    });
    const t2 = performance.now();
    await l.done;
    if (i >= 2) { // the first two warm the mappings and the JIT
      queryMs.push(t1 - t0);
      loadSubmitMs.push(t2 - t1);
    }
  }
  printTable(
    `${blocks} blocks × ${model.numLayers} layers × ${KV} segments, ${iters} iterations`,
    [
      { what: `query ${blocks} hashes (+ lease)`, ms: queryMs },
      { what: "load: handler to submit", ms: loadSubmitMs },
      { what: "load: prepare_ms (engine log)", ms: prepareMs.slice(2) },
    ],
  );
  await writeBenchResult(o.out, "load-prepare.json", "bench/load_prepare.ts", {
    blocks,
    layers: model.numLayers,
    iters,
    query_p50_ms: pct(queryMs, 50),
    load_submit_p50_ms: pct(loadSubmitMs, 50),
    prepare_p50_ms: pct(prepareMs.slice(2), 50),
  });
} finally {
  st.close();
  await bench.close();
}
