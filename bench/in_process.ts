/**
 * The set-up the in-process benches share (bench/save_prepare.ts, bench/load_prepare.ts): their
 * command line, the prefix's shape, a KvEngine on the real host backend and the real store with one
 * simulated Llama-3.1-8B engine registered (no gRPC, no server), percentiles, and the result file.
 *
 * @module
 */
import { Command } from "commander";
import { KvEngine, PROTOCOL_VERSION } from "../lib/engine/engine.ts";
import { openNative } from "../lib/engine/native_adapter.ts";
import { KvStore } from "../lib/storage/store.ts";
import type { Logger } from "../lib/log.ts";
import { PegaflowClient } from "../lib/client/client.ts";
import { LLAMA_3_1_8B, SimEngine } from "../lib/client/sim_engine.ts";
import { pct } from "./stats.ts";
import { strictCommand } from "./cli.ts";

/** Segments per block and layer: K and V. */
export const KV = 2;
const MIB = 1 << 20;

/**
 * `--tokens`, `--iters`, `--out` of a bench named `name` that writes `file` under `--out`;
 * `--help` and an unknown flag as {@link strictCommand} says.
 */
export function benchOptions(
  name: string,
  file: string,
): { tokens: number; iters: number; out: string } {
  const cmd = new Command(name)
    .option("--tokens <n>", "prefix length in tokens", "10000")
    .option("--iters <n>", "timed iterations", "30")
    .option("--out <dir>", "where to write the JSON", "bench/results");
  const o = strictCommand(cmd, `a table on stdout and <--out>/${file}`)
    .parse(["deno", "run", ...Deno.args])
    .opts<{ tokens: string; iters: string; out: string }>();
  return { tokens: Number(o.tokens), iters: Number(o.iters), out: o.out };
}

/** The shape of a `tokens`-long prefix of the Llama-3.1-8B model. */
export function prefixShape(tokens: number) {
  const model = LLAMA_3_1_8B;
  const blocks = Math.floor(tokens / model.blockTokens);
  const segBytes = model.blockTokens * model.kvHeads * model.headDim * model.dtypeBytes;
  return { model, blocks, segBytes, prefixBytes: blocks * model.numLayers * KV * segBytes };
}

/** A KvEngine over the host backend with one simulated engine registered as instance "bench". */
export interface BenchEngine {
  engine: KvEngine;
  sim: SimEngine;
  close(): Promise<void>;
}

/**
 * Opens the host backend with a pool of `poolBytes` (rounded up to MiB), a store and an engine
 * logging to `log`, and registers a simulated engine of `simBlocks` blocks per layer (TP 1, PP 1)
 * in `namespace`.
 */
export async function openBenchEngine(
  opts: { namespace: string; poolBytes: number; simBlocks: number; log: Logger },
): Promise<BenchEngine> {
  const { log } = opts;
  const native = await openNative({
    backend: "host",
    devices: [0],
    poolBytes: Math.ceil(opts.poolBytes / MIB) * MIB,
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
    namespace: opts.namespace,
    model: LLAMA_3_1_8B,
    numBlocks: opts.simBlocks,
    backend: "host",
  });
  const close = async () => {
    await engine.close();
    await native.close();
    sim.close();
    client.close();
  };
  try {
    engine.register({ ...sim.registration(), clientVersion: PROTOCOL_VERSION });
  } catch (e) {
    await close();
    throw e;
  }
  return { engine, sim, close };
}

/** Writes `result` (with the date and the command line) to `<out>/<file>`. */
export async function writeBenchResult(
  out: string,
  file: string,
  script: string,
  result: Record<string, unknown>,
): Promise<void> {
  const { blocks, layers, iters, ...rest } = result;
  await Deno.mkdir(out, { recursive: true });
  await Deno.writeTextFile(
    `${out}/${file}`,
    JSON.stringify(
      {
        blocks,
        layers,
        iters,
        date: new Date().toISOString(),
        command: `deno run -A ${script} ${Deno.args.join(" ")}`.trim(),
        ...rest,
      },
      null,
      2,
    ) + "\n",
  );
}

/** Prints `header` and a p50/p99 table of each row's times in ms; returns the table's rows. */
export function printTable(
  header: string,
  rows: { what: string; ms: number[] }[],
): { what: string; p50_ms: string; p99_ms: string }[] {
  const table = rows.map((r) => ({
    what: r.what,
    p50_ms: pct(r.ms, 50).toFixed(3),
    p99_ms: pct(r.ms, 99).toFixed(3),
  }));
  console.log(header);
  console.table(table);
  return table;
}
