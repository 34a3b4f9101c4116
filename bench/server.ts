/**
 * KV server end-to-end benchmark: a simulated Llama-3.1-8B engine in this
 * process against a real server child process, over real gRPC.
 *
 * - save: one Save RPC of the whole prefix (all layers, one gather batch),
 *   wall time at the engine, beside the native batch copy of the same
 *   segments (same geometry, same backend) measured in this process: ratio.
 * - warm load: QueryPrefetch + Load + wait for the last layer in the load
 *   state (and for layer 0: when layer-wise compute could start).
 * - QueryPrefetch of the prefix's hashes: p50/p99 (each lease released).
 *
 * Prints a table and writes bench/results/server-<backend>.json. Never asserts.
 *
 *   deno run -A bench/server.ts --backend host --tokens 2048
 *   deno run -A bench/server.ts --backend cuda --tokens 10000     # H100 target run
 */
import { Command } from "commander";
import { CopyBatch, CopyEngine, type Region } from "../ffi/mod.ts";
import { PegaflowClient } from "../lib/client/client.ts";
import { chainedBlockHashes, syntheticTokens } from "../lib/client/hashes.ts";
import { LLAMA_3_1_8B, SimEngine } from "../lib/client/sim_engine.ts";
import { pct } from "./stats.ts";
import { serverRunArgs } from "../lib/server/v8_flags.ts";
import { strictCommand } from "./cli.ts";

const o = strictCommand(
  new Command("bench-server")
    .option("--backend <name>", "auto | cuda | host", "auto")
    .option("--tokens <n>", "prefix length in tokens (default 10000 on cuda, 2048 on host)")
    .option("--iters <n>", "timed iterations per row", "5")
    .option("--query-iters <n>", "QueryPrefetch samples", "200")
    .option("--out <dir>", "where to write the JSON", "bench/results")
    .option("--server-log <file>", "write the server's debug log (per-phase save/load times) here")
    .option(
      "--transport <how>",
      "uds: the engine on the server's Unix socket with its local RPC socket, as an engine on the same host; tcp: gRPC over TCP",
      "uds",
    ),
  "a table on stdout and <--out>/server-<backend>.json (and --server-log when given)",
)
  .parse(["deno", "run", ...Deno.args])
  .opts<{
    backend: "auto" | "cuda" | "host";
    tokens?: string;
    iters: string;
    queryIters: string;
    out: string;
    serverLog?: string;
    transport: string;
  }>();
if (o.transport !== "uds" && o.transport !== "tcp") {
  console.error(`--transport ${o.transport}: expected uds or tcp`);
  Deno.exit(2);
}

const model = LLAMA_3_1_8B;
/** Concurrent Saves in the throughput row (the server copies up to 4 at once). */
const SAVE_STREAMS = 4;
const KV = 2;
const probe = CopyEngine.open({ backend: o.backend, poolBytes: 1 << 20 });
const backend = probe.engine.backend;
await probe.close();
const tokens = Number(o.tokens ?? (backend === "cuda" ? 10_000 : 2048));
const blocks = Math.floor(tokens / model.blockTokens);
const segBytes = model.blockTokens * model.kvHeads * model.headDim * model.dtypeBytes;
const prefixBytes = blocks * model.numLayers * KV * segBytes;
const iters = Number(o.iters);

// ---- native baseline: the same gather (all layers, K and V planes) without the server.
async function nativeGatherGbps(): Promise<number> {
  const ce = CopyEngine.open({ backend, poolBytes: prefixBytes, pretouch: true });
  const regions: Region[] = [];
  try {
    for (let l = 0; l < model.numLayers; l++) {
      regions.push(ce.engine.allocRegion(KV * 2 * blocks * segBytes));
    }
    const batch = new CopyBatch(model.numLayers, model.numLayers * blocks * KV);
    const samples: number[] = [];
    for (let i = 0; i < iters + 1; i++) {
      // The copy engines' batch path is the native baseline on a GPU (what the
      // server's calibrated policy picks for 32 KB segments); memcpy on the host.
      batch.reset("d2h", backend === "cuda" ? "dma_batch" : "host");
      let pool = 0;
      for (let l = 0; l < model.numLayers; l++) {
        batch.group(regions[l], l);
        for (let b = 0; b < blocks; b++) {
          for (let s = 0; s < KV; s++) {
            batch.seg(s * 2 * blocks * segBytes + b * segBytes, pool, segBytes);
            pool += segBytes;
          }
        }
      }
      const t0 = performance.now();
      const r = await ce.submit(batch).done;
      const ms = performance.now() - t0;
      if (r.status !== 0) throw new Error(`native gather failed: ${r.status}`);
      if (i > 0) samples.push(prefixBytes / ms / 1e6); // first run warms the pages
    }
    return pct(samples, 50);
  } finally {
    for (const r of regions) r.close();
    await ce.close();
  }
}

// ---- the server, as a child process.
const poolBytes = Math.ceil((prefixBytes * 1.25) / (1 << 20)) * (1 << 20);
const sockDir = o.transport === "uds" ? await Deno.makeTempDir({ prefix: "pf-bench-" }) : undefined;
const child = new Deno.Command(Deno.execPath(), {
  args: [
    ...serverRunArgs(), // as `deno task serve` runs it
    "main.ts",
    "--addr",
    "127.0.0.1:0",
    "--http-addr",
    "127.0.0.1:0",
    "--backend",
    backend,
    "--pool-size",
    `${poolBytes}`,
    "--log-level",
    o.serverLog ? "debug" : "warn",
    ...(sockDir ? ["--uds", `${sockDir}/pf.sock`] : []),
  ],
  cwd: new URL("../", import.meta.url).pathname,
  stdout: "piped",
  stderr: o.serverLog ? "piped" : "inherit",
}).spawn();
const serverLog = o.serverLog
  ? await Deno.open(o.serverLog, { write: true, create: true, truncate: true })
  : null;
const serverLogDone = serverLog ? child.stderr.pipeTo(serverLog.writable) : null;
let grpc: string, http: string, uds: string | undefined;
let client: PegaflowClient | undefined;
let sim: SimEngine;
try {
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  let line = "";
  while (!line.includes("\n")) {
    const r = await reader.read();
    if (r.done) {
      throw new Error(`server exited before announcing its ports (${(await child.status).code})`);
    }
    line += r.value;
  }
  reader.releaseLock();
  ({ grpc, http, uds } = JSON.parse(line.slice(0, line.indexOf("\n"))).listening);
  client = new PegaflowClient(uds ? `unix:${uds}` : grpc);
  sim = SimEngine.create({
    client,
    instanceId: `bench-${Deno.pid}`,
    namespace: `bench-${backend}`,
    model,
    numBlocks: blocks * 2,
    backend,
  });
} catch (e) {
  // A server that did not start (or an engine that could not be made) leaves nothing behind.
  client?.close();
  try {
    child.kill("SIGKILL");
  } catch {
    // it has exited already
  }
  await child.status;
  if (sockDir) await Deno.remove(sockDir, { recursive: true });
  throw e;
}
const rows: Record<string, string | number>[] = [];
const result: Record<string, unknown> = {
  backend,
  tokens,
  blocks,
  prefix_bytes: prefixBytes,
  segment_bytes: segBytes,
  layers: model.numLayers,
  transport: o.transport,
  date: new Date().toISOString(),
  command: `deno run -A bench/server.ts ${Deno.args.join(" ")}`.trim(),
};
try {
  await sim.register();
  const src = Array.from({ length: blocks }, (_, i) => i);
  const dst = Array.from({ length: blocks }, (_, i) => blocks + i);

  // Save: fresh hashes each time (no dedup), cache emptied between runs.
  const saveGbps: number[] = [];
  const saveMs: number[] = [];
  let lastHashes: Uint8Array[] = [];
  let filledWith: Uint8Array[] = [];
  for (let i = 0; i < iters + 1; i++) {
    const hashes = chainedBlockHashes(
      syntheticTokens(1000 + i, blocks * model.blockTokens),
      model.blockTokens,
    );
    // The bytes are written once: later saves store the same content under new keys.
    if (i === 0) {
      sim.fill(src, hashes);
      filledWith = hashes;
    }
    const t0 = performance.now();
    const r = await sim.save(src, hashes);
    const ms = performance.now() - t0;
    if (r.blocksSaved !== blocks) throw new Error(`save stored ${r.blocksSaved}/${blocks} blocks`);
    if (i > 0) {
      saveMs.push(ms);
      saveGbps.push(r.bytesCopied / ms / 1e6);
    }
    lastHashes = hashes;
    if (i < iters) {
      await (await fetch(`http://${http}/cache/memory/cleanup`, { method: "POST" })).body?.cancel();
    }
  }
  // Server-side Save time (handler entry to response), from the RPC histogram.
  const metricsText = await (await fetch(`http://${http}/metrics`)).text();
  const metric = (name: string) => {
    const line = metricsText.split("\n").find((l) => l.startsWith(name + " "));
    return line ? Number(line.slice(name.length + 1)) : NaN;
  };
  const serverSaveMeanMs = 1000 *
    metric('pegaflow_rpc_duration_seconds_sum{method="Save",status="OK"}') /
    metric('pegaflow_rpc_duration_seconds_count{method="Save",status="OK"}');
  // Save throughput with requests in flight together, as an engine saving every
  // step produces them: the prefix as SAVE_STREAMS concurrent Saves of a quarter
  // each; per-request overheads overlap other requests' copies.
  const streamGbps: number[] = [];
  const per = Math.floor(blocks / SAVE_STREAMS);
  for (let i = 0; i < iters + 1; i++) {
    await (await fetch(`http://${http}/cache/memory/cleanup`, { method: "POST" })).body?.cancel();
    const parts = Array.from({ length: SAVE_STREAMS }, (_, k) => {
      const ids = src.slice(k * per, (k + 1) * per);
      const hashes = chainedBlockHashes(
        syntheticTokens(5000 + i * SAVE_STREAMS + k, per * model.blockTokens),
        model.blockTokens,
      );
      return { ids, hashes };
    });
    const t0 = performance.now();
    const rs = await Promise.all(parts.map((p) => sim.save(p.ids, p.hashes)));
    const ms = performance.now() - t0;
    const bytes = rs.reduce((n, r) => n + r.bytesCopied, 0);
    if (i > 0) streamGbps.push(bytes / ms / 1e6);
  }
  // Back to the state the warm-load rows expect: the prefix saved under lastHashes.
  await (await fetch(`http://${http}/cache/memory/cleanup`, { method: "POST" })).body?.cancel();
  await sim.save(src, lastHashes);

  const nativeGbps = await nativeGatherGbps();
  rows.push({
    what: "save (whole stack)",
    p50_ms: pct(saveMs, 50).toFixed(2),
    p99_ms: pct(saveMs, 99).toFixed(2),
    gbps: pct(saveGbps, 50).toFixed(2),
    vs_native: (pct(saveGbps, 50) / nativeGbps).toFixed(3),
  });
  rows.push({
    what: `save throughput, ${SAVE_STREAMS} Saves in flight`,
    p50_ms: (prefixBytes / pct(streamGbps, 50) / 1e6).toFixed(2),
    p99_ms: "-",
    gbps: pct(streamGbps, 50).toFixed(2),
    vs_native: (pct(streamGbps, 50) / nativeGbps).toFixed(3),
  });
  rows.push({
    what: "save: server-side RPC (mean, incl. warm-up)",
    p50_ms: serverSaveMeanMs.toFixed(2),
    p99_ms: "-",
    gbps: "-",
    vs_native: "-",
  });
  rows.push({
    what: "native gather (same segments)",
    p50_ms: (prefixBytes / nativeGbps / 1e6).toFixed(2),
    p99_ms: "-",
    gbps: nativeGbps.toFixed(2),
    vs_native: "1.000",
  });
  result.save = {
    p50_ms: pct(saveMs, 50),
    p99_ms: pct(saveMs, 99),
    gbps_p50: pct(saveGbps, 50),
    native_gather_gbps: nativeGbps,
    server_rpc_mean_ms: serverSaveMeanMs,
    concurrent_streams: SAVE_STREAMS,
    concurrent_gbps_p50: pct(streamGbps, 50),
    concurrent_ratio: pct(streamGbps, 50) / nativeGbps,
    ratio: pct(saveGbps, 50) / nativeGbps,
  };

  // Warm load of the saved prefix.
  const loadMs: number[] = [];
  const firstMs: number[] = [];
  for (let i = 0; i < iters + 1; i++) {
    const t0 = performance.now();
    const q = await sim.query(lastHashes, `bench-load-${i}`);
    if (q.kind !== "ready" || q.hits !== blocks) {
      throw new Error(`warm query hit ${q.kind === "ready" ? q.hits : "loading"}`);
    }
    const l = await sim.load(q.leaseId, dst);
    const total = performance.now() - t0;
    if (i > 0) {
      loadMs.push(total);
      firstMs.push(l.firstLayerMs);
    }
  }
  const v = sim.verify(dst, filledWith);
  rows.push({
    what: "warm load: query+load+all layers",
    p50_ms: pct(loadMs, 50).toFixed(2),
    p99_ms: pct(loadMs, 99).toFixed(2),
    gbps: (prefixBytes / pct(loadMs, 50) / 1e6).toFixed(2),
    vs_native: "-",
  });
  rows.push({
    what: "warm load: until layer 0 usable",
    p50_ms: pct(firstMs, 50).toFixed(2),
    p99_ms: pct(firstMs, 99).toFixed(2),
    gbps: "-",
    vs_native: "-",
  });
  result.warm_load = {
    p50_ms: pct(loadMs, 50),
    p99_ms: pct(loadMs, 99),
    first_layer_p50_ms: pct(firstMs, 50),
    verified: v.badSegments === 0,
  };

  // Transport floor: an empty unary RPC.
  const hMs: number[] = [];
  for (let i = 0; i < Number(o.queryIters); i++) {
    const t0 = performance.now();
    await client.health();
    hMs.push(performance.now() - t0);
  }
  rows.push({
    what: `Health (empty RPC: transport floor, ${o.transport})`,
    p50_ms: pct(hMs, 50).toFixed(3),
    p99_ms: pct(hMs, 99).toFixed(3),
    gbps: "-",
    vs_native: "-",
  });
  result.health_rpc = { p50_ms: pct(hMs, 50), p99_ms: pct(hMs, 99) };

  // QueryPrefetch latency.
  const qMs: number[] = [];
  for (let i = 0; i < Number(o.queryIters); i++) {
    const t0 = performance.now();
    const q = await sim.query(lastHashes, `bench-q-${i}`);
    qMs.push(performance.now() - t0);
    if (q.kind === "ready" && q.hits > 0) await client.release(q.leaseId);
  }
  rows.push({
    what: `QueryPrefetch of ${blocks} hashes`,
    p50_ms: pct(qMs, 50).toFixed(3),
    p99_ms: pct(qMs, 99).toFixed(3),
    gbps: "-",
    vs_native: "-",
  });
  result.query = { hashes: blocks, p50_ms: pct(qMs, 50), p99_ms: pct(qMs, 99) };

  console.log(
    `backend ${backend}: ${tokens} tokens = ${blocks} blocks = ${
      (prefixBytes / 2 ** 20).toFixed(1)
    } MiB of Llama-3.1-8B KV; byte-exact after load: ${v.badSegments === 0}`,
  );
  console.table(rows);
  await Deno.mkdir(o.out, { recursive: true });
  const path = `${o.out}/server-${backend}.json`;
  await Deno.writeTextFile(path, JSON.stringify(result, null, 2) + "\n");
  console.log(`wrote ${path}`);
  await client.unregisterContext(sim.instanceId);
} finally {
  sim.close();
  client.close();
  child.kill("SIGTERM");
  const st = await child.status;
  if (!st.success) console.error(`server exited with code ${st.code} signal ${st.signal}`);
  await serverLogDone;
  if (sockDir) await Deno.remove(sockDir, { recursive: true });
}
