/**
 * `deno task demo`: a simulated Llama-3.1-8B engine against a running KV
 * server. Several "requests" share a prompt prefix: the first is cold
 * (query misses → the engine computes the KV, simulated by writing it → Save),
 * the rest are warm (query hits → Load into different block ids → every byte
 * verified). Prints cold vs warm timings and the hit rate.
 *
 * @example
 * ```sh
 * deno task serve --backend host --pool-size 2gb &
 * deno task demo --tokens 4096 --requests 4
 * ```
 * @module
 */
import { Command, InvalidArgumentError, Option } from "commander";
import { PegaflowClient } from "./client.ts";
import { chainedBlockHashes, syntheticTokens } from "./hashes.ts";
import { LLAMA_3_1_8B, SimEngine } from "./sim_engine.ts";

function intArg(v: string): number {
  if (!/^\d+$/.test(v) || Number(v) < 1) {
    throw new InvalidArgumentError(`"${v}" is not a positive integer`);
  }
  return Number(v);
}

const cmd = new Command("pegaflow-demo")
  .description(
    "simulated Llama-3.1-8B engine: cold save vs warm load through a running PegaFlow server",
  )
  .addOption(
    new Option("--addr <host:port>", "server gRPC address").default("127.0.0.1:50055").env(
      "PEGAFLOW_ADDR",
    ),
  )
  .addOption(
    new Option("--tokens <n>", "prompt length in tokens (16 per block)").default(2048).argParser(
      intArg,
    ),
  )
  .addOption(
    new Option("--requests <n>", "requests sharing the prompt (1 cold + n-1 warm)").default(4)
      .argParser(intArg),
  )
  .addOption(
    new Option("--backend <kind>", "where the simulated KV lives: auto, cuda or host").default(
      "auto",
    ).choices(["auto", "cuda", "host"]),
  )
  .addOption(
    new Option("--layers <n>", "model layers (Llama-3.1-8B: 32)").default(32).argParser(intArg),
  )
  .parse(Deno.args, { from: "user" });
const o = cmd.opts();

const model = { ...LLAMA_3_1_8B, numLayers: o.layers };
const blocks = Math.floor(o.tokens / model.blockTokens);
if (blocks < 1) {
  console.error(`--tokens ${o.tokens}: need at least ${model.blockTokens} tokens (one block)`);
  Deno.exit(2);
}
const client = new PegaflowClient(o.addr);
const health = await client.health().catch((e) => {
  console.error(
    `cannot reach the server at ${o.addr}: ${
      (e as Error).message
    }\nstart it with: deno task serve --addr ${o.addr}`,
  );
  Deno.exit(1);
});
const instanceId = `demo-${Deno.pid}`;
// Room for the saved copy and a different target for each load.
const sim = SimEngine.create({
  client,
  instanceId,
  namespace: `demo-${model.name}-L${model.numLayers}`,
  model,
  numBlocks: blocks * 2,
  backend: o.backend,
});
let session: ReturnType<typeof client.openSession> | undefined;
// Ctrl-C or SIGTERM mid-run: the engine's KV regions are shm files that outlive the process
// unless closed (a 100K-token demo leaves GiBs in /dev/shm). Close them, then exit as a signal would.
const stop = (signal: Deno.Signal, code: number) => () => {
  session?.close();
  sim.close();
  client.close();
  console.error(`demo stopped by ${signal}: its shared-memory regions were removed`);
  Deno.exit(code);
};
const onInt = stop("SIGINT", 130);
const onTerm = stop("SIGTERM", 143);
Deno.addSignalListener("SIGINT", onInt);
Deno.addSignalListener("SIGTERM", onTerm);
const mb = (n: number) => (n / 2 ** 20).toFixed(1);
const rows: {
  request: string;
  hit: string;
  queryMs: string;
  copyMs: string;
  firstLayerMs: string;
  gbps: string;
  verified: string;
}[] = [];
let hits = 0;
let asked = 0;
try {
  await sim.register();
  // Opened once registered: the session presents the registration's token.
  session = client.openSession(instanceId);
  console.log(
    `server ${o.addr} (${health.backend}, ${health.version}); engine KV on ${sim.engine.backend}; ` +
      `${model.name} x${model.numLayers} layers, ${o.tokens} tokens = ${blocks} blocks = ${
        mb(blocks * sim.blockBytes)
      } MiB of KV`,
  );
  const hashes = chainedBlockHashes(
    syntheticTokens(Deno.pid, blocks * model.blockTokens),
    model.blockTokens,
    instanceId,
  );
  const src = Array.from({ length: blocks }, (_, i) => i);
  const dst = Array.from({ length: blocks }, (_, i) => blocks + i);
  for (let r = 0; r < o.requests; r++) {
    // Targets are zeroed before the clock starts, so a verify after the load proves the load wrote them.
    sim.clear(dst);
    const t0 = performance.now();
    const q = await sim.query(hashes, `demo-req-${r}`);
    const queryMs = performance.now() - t0;
    const hit = q.kind === "ready" ? q.hits : 0;
    asked += blocks;
    hits += hit;
    if (hit === 0) {
      sim.fill(src, hashes); // "prefill": the engine computes the KV (not timed: it is the model's work)
      const tSave = performance.now();
      const s = await sim.save(src, hashes);
      const saveMs = performance.now() - tSave;
      rows.push({
        request: `#${r} cold`,
        hit: `0/${blocks}`,
        queryMs: queryMs.toFixed(2),
        copyMs: `save ${saveMs.toFixed(1)}`,
        firstLayerMs: "-",
        gbps: (s.bytesCopied / saveMs / 1e6).toFixed(2),
        verified: "-",
      });
    } else if (q.kind === "ready") {
      const l = await sim.load(q.leaseId, dst.slice(0, hit));
      const v = sim.verify(dst.slice(0, hit), hashes);
      rows.push({
        request: `#${r} warm`,
        hit: `${hit}/${blocks}`,
        queryMs: queryMs.toFixed(2),
        copyMs: `load ${l.allMs.toFixed(1)}`,
        firstLayerMs: l.firstLayerMs.toFixed(2),
        gbps: (hit * sim.blockBytes / l.allMs / 1e6).toFixed(2),
        verified: v.badSegments === 0 ? "all bytes" : `${v.badSegments} bad segments: ${v.first}`,
      });
    }
  }
  console.table(rows);
  console.log(`hit rate ${(100 * hits / asked).toFixed(1)}% (${hits}/${asked} blocks)`);
  await client.unregisterContext(instanceId);
} finally {
  Deno.removeSignalListener("SIGINT", onInt);
  Deno.removeSignalListener("SIGTERM", onTerm);
  session?.close();
  sim.close();
  client.close();
}
