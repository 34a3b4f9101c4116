/**
 * `deno task demo`: a simulated Llama-3.1-8B engine against a running KV
 * server. Several "requests" share a prompt prefix: the first is cold
 * (query misses → the engine computes the KV, simulated by writing it → Save),
 * the rest are warm (query hits → Load into different block ids → every byte
 * verified). Prints cold vs warm timings and the hit rate.
 *
 * With `--save-addr`, the cold request saves to another server (a second node
 * of the same Redis block index) and the warm ones ask `--addr`, which finds
 * the prefix in the index and fetches it across nodes (docs/peer.md): the
 * first warm query answers `loading` until the fetch lands, then hits.
 *
 * @example
 * ```sh
 * deno task serve --backend host --pool-size 2gb &
 * deno task demo --tokens 4096 --requests 4
 * ```
 * @module
 */
import { Command, InvalidArgumentError, Option } from "commander";
import { PegaflowClient, type QueryResult } from "./client.ts";
import { chainedBlockHashes, syntheticTokens } from "./hashes.ts";
import { LLAMA_3_1_8B, SimEngine } from "./sim_engine.ts";

type ReadyResult = Extract<QueryResult, { kind: "ready" }>;

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
    new Option(
      "--save-addr <host:port>",
      "server the cold request saves to; another node of the same block index makes the warm " +
        "requests fetch the prefix across nodes (default: --addr)",
    ).env("PEGAFLOW_DEMO_SAVE_ADDR"),
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
/** Longest wait for a lower tier (the SSD, a peer node) to bring a prefix in. */
const LOADING_DEADLINE_MS = 30_000;
/** Pause before asking again after a miss while the saver's advertise may be in flight. */
const LAG_PAUSE_MS = 2;
/** Cross-node: a warm request's miss is asked again for this long (the saver's advertise in flight). */
const INDEX_LAG_MS = 2_000;

async function connect(addr: string): Promise<PegaflowClient> {
  const client = new PegaflowClient(addr);
  await client.health().catch((e) => {
    console.error(
      `cannot reach the server at ${addr}: ${
        (e as Error).message
      }\nstart it with: deno task serve --addr ${addr}`,
    );
    Deno.exit(1);
  });
  return client;
}

const saveAddr: string = o.saveAddr ?? o.addr;
const crossNode = saveAddr !== o.addr;
const client = await connect(o.addr);
const health = await client.health();
const saveClient = crossNode ? await connect(saveAddr) : client;
const instanceId = `demo-${Deno.pid}`;
const namespace = `demo-${model.name}-L${model.numLayers}`;
// Room for the saved copy and a different target for each load.
const sim = SimEngine.create({
  client,
  instanceId,
  namespace,
  model,
  numBlocks: blocks * 2,
  backend: o.backend,
});
// Cross-node: the saving node's own engine (the same namespace: the same model and layout).
// If it cannot be made (/dev/shm full), the first engine's regions go before the error does.
const saver = crossNode ? saverEngine() : sim;
function saverEngine(): SimEngine {
  try {
    return SimEngine.create({
      client: saveClient,
      instanceId: `${instanceId}-saver`,
      namespace,
      model,
      numBlocks: blocks,
      backend: o.backend,
    });
  } catch (e) {
    sim.close();
    throw e;
  }
}
const sims = crossNode ? [sim, saver] : [sim];
const sessions: ReturnType<typeof client.openSession>[] = [];
const closeAll = () => {
  for (const s of sessions) s.close();
  for (const e of sims) e.close();
  client.close();
  if (crossNode) saveClient.close();
};
// Ctrl-C or SIGTERM mid-run: the engine's KV regions are shm files that outlive the process
// unless closed (a 100K-token demo leaves GiBs in /dev/shm). Close them, then exit as a signal would.
const stop = (signal: Deno.Signal, code: number) => () => {
  closeAll();
  console.error(`demo stopped by ${signal}: its shared-memory regions were removed`);
  Deno.exit(code);
};
const onInt = stop("SIGINT", 130);
const onTerm = stop("SIGTERM", 143);
Deno.addSignalListener("SIGINT", onInt);
Deno.addSignalListener("SIGTERM", onTerm);
const mb = (n: number) => (n / 2 ** 20).toFixed(1);
const hashes = chainedBlockHashes(
  syntheticTokens(Deno.pid, blocks * model.blockTokens),
  model.blockTokens,
  instanceId,
);

/**
 * Request `r`'s query, asked again once a WaitPrefetch is answered while it
 * answers `loading` (a lower tier bringing the prefix in) and, cross-node,
 * after a short pause while a warm request misses for up to
 * {@link INDEX_LAG_MS} (the saver's advertise may not have reached the index
 * yet). `polls`: how many answers were not the last.
 */
async function queryReady(r: number): Promise<{ q: ReadyResult; polls: number }> {
  const t0 = performance.now();
  for (let polls = 0;; polls++) {
    const q = await sim.query(hashes, `demo-req-${r}`);
    const waited = performance.now() - t0;
    const lagging = crossNode && r > 0 && q.kind === "ready" && q.hits === 0 &&
      waited < INDEX_LAG_MS;
    if (q.kind === "ready" && !lagging) return { q, polls };
    if (waited > LOADING_DEADLINE_MS) {
      throw new Error(
        `request #${r}: ${o.addr} still answers loading after ${LOADING_DEADLINE_MS} ms`,
      );
    }
    if (q.kind === "loading") {
      const waitMs = Math.max(1, Math.ceil(LOADING_DEADLINE_MS - waited));
      await client.waitPrefetch({ instanceId, requestId: `demo-req-${r}`, waitMs });
    } else {
      await new Promise((res) => setTimeout(res, LAG_PAUSE_MS));
    }
  }
}

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
  for (const e of sims) {
    await e.register();
    // Opened once registered: the session presents the registration's token.
    sessions.push(e.client.openSession(e.instanceId));
  }
  console.log(
    `server ${o.addr} (${health.backend}, ${health.version}); engine KV on ${sim.engine.backend}; ` +
      `${model.name} x${model.numLayers} layers, ${o.tokens} tokens = ${blocks} blocks = ${
        mb(blocks * sim.blockBytes)
      } MiB of KV` + (crossNode ? `; cold saves go to ${saveAddr}` : ""),
  );
  const src = Array.from({ length: blocks }, (_, i) => i);
  const dst = Array.from({ length: blocks }, (_, i) => blocks + i);
  for (let r = 0; r < o.requests; r++) {
    // Targets are zeroed before the clock starts, so a verify after the load proves the load wrote them.
    sim.clear(dst);
    const t0 = performance.now();
    const { q, polls } = await queryReady(r);
    const queryMs = performance.now() - t0;
    const hit = q.hits;
    asked += blocks;
    hits += hit;
    if (hit === 0) {
      saver.fill(src, hashes); // "prefill": the engine computes the KV (not timed: it is the model's work)
      const tSave = performance.now();
      const s = await saver.save(src, hashes);
      const saveMs = performance.now() - tSave;
      rows.push({
        request: `#${r} cold`,
        hit: `0/${blocks}`,
        queryMs: queryMs.toFixed(2),
        copyMs: `save ${saveMs.toFixed(1)}` + (crossNode ? ` on ${saveAddr}` : ""),
        firstLayerMs: "-",
        gbps: (s.bytesCopied / saveMs / 1e6).toFixed(2),
        verified: "-",
      });
    } else {
      const l = await sim.load(q.leaseId, dst.slice(0, hit));
      const v = sim.verify(dst.slice(0, hit), hashes);
      rows.push({
        request: `#${r} warm`,
        hit: `${hit}/${blocks}` + (polls > 0 ? ` after ${polls} polls` : ""),
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
  for (const e of sims) await e.client.unregisterContext(e.instanceId);
} finally {
  Deno.removeSignalListener("SIGINT", onInt);
  Deno.removeSignalListener("SIGTERM", onTerm);
  closeAll();
}
