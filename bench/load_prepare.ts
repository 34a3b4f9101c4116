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
import { Command } from "commander";
import { KvEngine, PROTOCOL_VERSION } from "../lib/engine/engine.ts";
import { openNative } from "../lib/engine/native_adapter.ts";
import { KvStore } from "../lib/storage/store.ts";
import { Logger } from "../lib/log.ts";
import { PegaflowClient } from "../lib/client/client.ts";
import { LoadState } from "../lib/client/load_state.ts";
import { chainedBlockHashes, syntheticTokens } from "../lib/client/hashes.ts";
import { LLAMA_3_1_8B, SimEngine } from "../lib/client/sim_engine.ts";

const o = new Command("bench-load-prepare")
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

function pct(xs: number[], p: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
}

/** The engine logs each load's prepare_ms at debug level; collect them. */
const prepareMs: number[] = [];
const log = new Logger("debug", {}, (line) => {
  if (line.includes('"load done"')) prepareMs.push(JSON.parse(line).prepare_ms);
});
const native = await openNative({
  backend: "host",
  devices: [0],
  poolBytes: Math.ceil((prefixBytes * 1.1) / (1 << 20)) * (1 << 20),
  useHugepages: false,
  transferPath: "auto",
}, log);
const store = new KvStore({ capacityBytes: native.poolBytes });
const engine = new KvEngine({ native, store, log, leaseTtlMs: 60_000 });
// The simulated engine only provides its regions; no server connection is made.
const client = new PegaflowClient("127.0.0.1:1");
const sim = SimEngine.create({
  client,
  instanceId: "bench",
  namespace: "bench-prepare",
  model,
  numBlocks: 2 * blocks,
  backend: "host",
});
const planeBytes = sim.numBlocks * segBytes;
const st = LoadState.create();
const queryMs: number[] = [];
const loadSubmitMs: number[] = [];
try {
  engine.register({
    instanceId: "bench",
    namespace: "bench-prepare",
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
  const rows = [
    { what: `query ${blocks} hashes (+ lease)`, ms: queryMs },
    { what: "load: handler to submit", ms: loadSubmitMs },
    { what: "load: prepare_ms (engine log)", ms: prepareMs.slice(2) },
  ].map((r) => ({
    what: r.what,
    p50_ms: pct(r.ms, 50).toFixed(3),
    p99_ms: pct(r.ms, 99).toFixed(3),
  }));
  console.log(`${blocks} blocks × ${model.numLayers} layers × ${KV} segments, ${iters} iterations`);
  console.table(rows);
  await Deno.mkdir(o.out, { recursive: true });
  await Deno.writeTextFile(
    `${o.out}/load-prepare.json`,
    JSON.stringify(
      {
        blocks,
        layers: model.numLayers,
        iters,
        date: new Date().toISOString(),
        command: `deno run -A bench/load_prepare.ts ${Deno.args.join(" ")}`.trim(),
        query_p50_ms: pct(queryMs, 50),
        load_submit_p50_ms: pct(loadSubmitMs, 50),
        prepare_p50_ms: pct(prepareMs.slice(2), 50),
      },
      null,
      2,
    ) + "\n",
  );
} finally {
  await engine.close();
  await native.close();
  st.close();
  sim.close();
  client.close();
}
