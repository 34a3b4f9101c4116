/**
 * RPC latency of the engines' warm-path calls, over TCP and over the
 * server's Unix-domain socket (`--uds`), against a real server process
 * (host backend).
 *
 * Per server variant (the default server; the GOAWAY guard off, to see what
 * the relay costs; a larger V8 young generation, to see what the scavenges
 * cost) one server child is started with `--uds`; an engine registers
 * and saves `--hashes` blocks; then this process (grpc-js on Deno, the TS
 * SDK) times `--n` empty Health RPCs and `--n` QueryPrefetch RPCs of the
 * `--hashes` hashes (each a hit; its lease released after the timed call),
 * after `--warmup` untimed calls, alternating TCP and UDS in batches of 500 so
 * both see the same noise. Where `/usr/bin/python3` has grpcio, the same
 * probe runs with the engines' real client (bench/rpc_latency.py).
 *
 * For the tail: the server runs with V8's `--trace-gc`; the GC pauses that
 * fell into each timed window are counted beside the latencies.
 *
 * Prints a table and writes bench/results/rpc_latency.json. Never asserts.
 *
 *   deno run -A bench/rpc_latency.ts [--n 5000] [--warmup 500] [--hashes 625]
 *
 * @module
 */
import { Command } from "commander";
import { PegaflowClient } from "../lib/client/client.ts";
import { chainedBlockHashes, syntheticTokens } from "../lib/client/hashes.ts";
import { LLAMA_3_1_8B, SimEngine } from "../lib/client/sim_engine.ts";
import { QueryPrefetchRequest } from "../proto/pegaflow.ts";
import { strictCommand } from "./cli.ts";

const o = strictCommand(
  new Command("bench-rpc-latency")
    .option("--n <n>", "timed calls per RPC and transport", "5000")
    .option("--warmup <n>", "untimed calls per RPC and transport first", "500")
    .option("--hashes <n>", "hashes per QueryPrefetch (625 = 10K tokens)", "625")
    .option(
      "--variants <list>",
      "server variants: guard (the default server), noguard (GOAWAY guard off), singlegc (V8 GC on one thread), semispace (larger young generation)",
      "guard,noguard,singlegc,semispace",
    )
    .option("--python <bool>", "also probe with Python grpcio when available", "true")
    .option("--out <dir>", "where to write the JSON", "bench/results"),
  "a table on stdout and <--out>/rpc_latency.json",
)
  .parse(["deno", "run", ...Deno.args])
  .opts<{
    n: string;
    warmup: string;
    hashes: string;
    variants: string;
    python: string;
    out: string;
  }>();

const N = Number(o.n);
const WARMUP = Number(o.warmup);
const HASHES = Number(o.hashes);
/** Calls on one transport before switching to the other. */
const BATCH = 500;
const ROOT = new URL("../", import.meta.url).pathname;
/** A tiny KV shape: the RPCs' cost does not depend on the block size, the saved pool does. */
const MODEL = { ...LLAMA_3_1_8B, numLayers: 1, kvHeads: 1 };
const PYTHON = "/usr/bin/python3";
/** Server start-up budget on a loaded machine. */
const START_TIMEOUT_MS = 60_000;

/** A server variant: environment and extra V8 flags of the server process. */
interface Variant {
  env: Record<string, string>;
  v8: string[];
}
/** A young generation this large (per semi-space, MiB) is collected ~16× less often than V8's default. */
const LARGE_SEMI_SPACE_MB = 64;
const VARIANTS: Record<string, Variant> = {
  guard: { env: {}, v8: [] },
  noguard: { env: { PEGAFLOW_GOAWAY_GUARD: "false" }, v8: [] },
  // V8's scavenger runs on helper threads; on a machine whose cores are busy
  // the pause waits for them. This keeps the whole GC on the server's thread.
  singlegc: { env: {}, v8: ["--single-threaded-gc"] },
  semispace: {
    env: {},
    v8: [
      `--min-semi-space-size=${LARGE_SEMI_SPACE_MB}`,
      `--max-semi-space-size=${LARGE_SEMI_SPACE_MB}`,
    ],
  },
};

type Dist = {
  n: number;
  p50_us: number;
  p90_us: number;
  p99_us: number;
  p999_us: number;
  max_us: number;
  mean_us: number;
};

function dist(samples: number[]): Dist {
  const s = samples.toSorted((a, b) => a - b);
  const at = (p: number) => s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
  return {
    n: s.length,
    p50_us: at(50),
    p90_us: at(90),
    p99_us: at(99),
    p999_us: at(99.9),
    max_us: s[s.length - 1],
    mean_us: s.reduce((a, b) => a + b, 0) / s.length,
  };
}

/** One V8 `--trace-gc` line: `[pid:isolate]  1234 ms: Scavenge 4.1 (6.2) -> 3.3 (7.0) MB, 0.52 / 0.00 ms ...`. */
const GC_LINE =
  /^\[\d+:[0-9a-fx]+\]\s+(\d+) ms: ([A-Za-z -]+?) [\d.]+ \([\d.]+\) -> .*?, ([\d.]+) \/ ([\d.]+) ms/;

interface GcEvent {
  kind: string;
  pauseMs: number;
}

/** A server child with `--uds`, its GC trace collected from stdout. */
async function startServer(variant: Variant, dir: string) {
  const child = new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      "-A",
      `--v8-flags=${["--trace-gc", ...variant.v8].join(",")}`,
      "main.ts",
      "--addr",
      "127.0.0.1:0",
      "--uds",
      `${dir}/grpc.sock`,
      "--backend",
      "host",
      "--pool-size",
      "256mb",
      "--http-addr",
      "127.0.0.1:0",
      "--log-level",
      "warn",
    ],
    cwd: ROOT,
    env: variant.env,
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const gc: GcEvent[] = [];
  type Listening = { grpc: string; uds: string; http: string };
  let resolveListening!: (l: Listening) => void;
  const listening = new Promise<Listening>((r) => resolveListening = r);
  const pump = (async () => {
    let buf = "";
    for await (const chunk of child.stdout.pipeThrough(new TextDecoderStream())) {
      buf += chunk;
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        if (line.startsWith('{"listening"')) resolveListening(JSON.parse(line).listening);
        const m = GC_LINE.exec(line);
        if (m) gc.push({ kind: m[2].trim(), pauseMs: Number(m[3]) });
      }
    }
  })();
  let timer: ReturnType<typeof setTimeout> | undefined;
  const l = await Promise.race([
    listening,
    new Promise<never>((_, rej) =>
      timer = setTimeout(() => rej(new Error("server did not start")), START_TIMEOUT_MS)
    ),
    child.status.then((s) => {
      throw new Error(`server exited (${s.code}) before listening`);
    }),
  ]).finally(() => clearTimeout(timer));
  return {
    ...l,
    gc,
    async kill() {
      // SIGKILL before the clients close: the unguarded variant would otherwise
      // abort on their GOAWAY (denoland/deno#36788) and print a crash here.
      child.kill("SIGKILL");
      await child.status;
      await pump;
    },
  };
}

/** GC pauses between two indexes of the trace: count, total and largest, by kind. */
function gcSummary(events: GcEvent[]) {
  const byKind: Record<string, { count: number; total_ms: number; max_ms: number }> = {};
  for (const e of events) {
    const k = byKind[e.kind] ??= { count: 0, total_ms: 0, max_ms: 0 };
    k.count++;
    k.total_ms += e.pauseMs;
    k.max_ms = Math.max(k.max_ms, e.pauseMs);
  }
  return byKind;
}

/** A client of one server variant over one transport. */
interface Target {
  variant: string;
  /** tcp / uds: gRPC over TCP / over `--uds`; local: the local RPC socket beside it. */
  via: "tcp" | "uds" | "local";
  client: PegaflowClient;
}

/**
 * Times `call` N times on every target, round-robin in batches of
 * {@link BATCH} (so every variant and transport sees the same machine noise),
 * after a warm-up on each.
 */
async function probe(
  targets: Target[],
  call: (c: PegaflowClient) => Promise<number>,
): Promise<number[][]> {
  for (const t of targets) for (let i = 0; i < WARMUP; i++) await call(t.client);
  const samples = targets.map(() => [] as number[]);
  while (samples.some((s) => s.length < N)) {
    for (const [i, t] of targets.entries()) {
      const k = Math.min(BATCH, N - samples[i].length);
      for (let j = 0; j < k; j++) samples[i].push(await call(t.client));
    }
  }
  return samples;
}

/** Handler-time histogram of one method from a server's /metrics: calls, and calls over 1 ms. */
async function handlerTimes(http: string, method: string) {
  const text = await (await fetch(`http://${http}/metrics`)).text();
  const bucket = (le: string) => {
    const labels = [`method="${method}"`, `status="OK"`, `le="${le}"`];
    const line = text.split("\n").find((l) =>
      l.startsWith("pegaflow_rpc_duration_seconds_bucket{") && labels.every((x) => l.includes(x))
    );
    return line ? Number(line.slice(line.lastIndexOf(" ") + 1)) : 0;
  };
  const all = bucket("+Inf");
  return { calls: all, over_1ms: all - bucket("0.001"), over_250us: all - bucket("0.00025") };
}

function diffHandler(
  a: { calls: number; over_1ms: number; over_250us: number },
  b: { calls: number; over_1ms: number; over_250us: number },
) {
  return {
    calls: b.calls - a.calls,
    over_250us: b.over_250us - a.over_250us,
    over_1ms: b.over_1ms - a.over_1ms,
  };
}

async function pythonAvailable(): Promise<boolean> {
  if (o.python !== "true") return false;
  try {
    const r = await new Deno.Command(PYTHON, { args: ["-c", "import grpc"], stderr: "null" })
      .output();
    return r.success;
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return false;
    throw e;
  }
}

const usePython = await pythonAvailable();
const rows: string[][] = [];
const fmt = (us: number) => (us / 1000).toFixed(3);
const addRow = (variant: string, client: string, rpc: string, via: string, v: Dist) =>
  rows.push([
    variant,
    client,
    rpc,
    via,
    fmt(v.p50_us),
    fmt(v.p90_us),
    fmt(v.p99_us),
    fmt(v.p999_us),
    fmt(v.max_us),
    (v.p99_us / v.p50_us).toFixed(2),
  ]);

// Every variant's server runs at once, each filled by its own engine.
const variantNames = o.variants.split(",").map((s) => s.trim()).filter((s) => s !== "");
const servers: {
  name: string;
  srv: Awaited<ReturnType<typeof startServer>>;
  dir: string;
  sim: SimEngine;
  request: QueryPrefetchRequest;
  clients: PegaflowClient[];
}[] = [];
const targets: Target[] = [];
const results: Record<string, Record<string, unknown>> = {};
try {
  for (const name of variantNames) {
    const v = VARIANTS[name];
    if (!v) {
      throw new Error(
        `--variants: unknown variant "${name}" (${Object.keys(VARIANTS).join(", ")})`,
      );
    }
    const dir = await Deno.makeTempDir({ prefix: "pegaflow-rpc-bench-" });
    const srv = await startServer(v, dir).catch(async (e) => {
      // Not yet in `servers`, whose cleanup removes the dirs of the servers that started.
      await Deno.remove(dir, { recursive: true });
      throw e;
    });
    const tcp = new PegaflowClient(srv.grpc);
    const uds = new PegaflowClient(`unix:${srv.uds}`, { localRpc: false });
    const local = new PegaflowClient(`unix:${srv.uds}`);
    const sim = SimEngine.create({
      client: tcp,
      instanceId: `bench-${name}`,
      namespace: "bench-rpc",
      model: MODEL,
      numBlocks: HASHES,
      backend: "host",
    });
    servers.push({
      name,
      srv,
      dir,
      sim,
      clients: [tcp, uds, local],
      request: {
        instanceId: sim.instanceId,
        blockHashes: [],
        requestId: "bench-q",
        loadInto: undefined,
        engineId: "",
      },
    });
    await sim.register();
    const hashes = chainedBlockHashes(syntheticTokens(7, HASHES * MODEL.blockTokens), 16);
    const ids = Array.from({ length: HASHES }, (_, i) => i);
    sim.fill(ids, hashes);
    await sim.save(ids, hashes);
    servers.at(-1)!.request.blockHashes = hashes;
    targets.push(
      { variant: name, via: "tcp", client: tcp },
      { variant: name, via: "uds", client: uds },
      { variant: name, via: "local", client: local },
    );
    results[name] = {};
  }
  const requestOf = new Map<PegaflowClient, QueryPrefetchRequest>();
  for (const s of servers) for (const c of s.clients) requestOf.set(c, s.request);

  const rpcs: [string, (c: PegaflowClient) => Promise<number>][] = [
    ["health", async (c) => {
      const t0 = performance.now();
      await c.health();
      return (performance.now() - t0) * 1000;
    }],
    ["query", async (c) => {
      const t0 = performance.now();
      const q = await c.queryPrefetch(requestOf.get(c)!);
      const us = (performance.now() - t0) * 1000;
      if (q.kind !== "ready" || q.hits !== HASHES) throw new Error(`query missed: ${q.kind}`);
      await c.release(q.leaseId);
      return us;
    }],
  ];
  for (const [rpc, call] of rpcs) {
    const method = rpc === "health" ? "Health" : "QueryPrefetch";
    const gcFrom = servers.map((s) => s.srv.gc.length);
    const hFrom = await Promise.all(servers.map((s) => handlerTimes(s.srv.http, method)));
    const samples = await probe(targets, call);
    for (const [i, s] of servers.entries()) {
      const r = results[s.name];
      r[`${rpc}_server_gc`] = gcSummary(s.srv.gc.slice(gcFrom[i]));
      r[`${rpc}_server_handler`] = diffHandler(hFrom[i], await handlerTimes(s.srv.http, method));
    }
    for (const [i, t] of targets.entries()) {
      const d = dist(samples[i]);
      results[t.variant][`${rpc}_deno_${t.via}`] = d;
      addRow(t.variant, "deno grpc-js", rpc === "health" ? "Health" : `Query(${HASHES})`, t.via, d);
    }
  }

  if (usePython) {
    for (const s of servers) {
      const reqFile = `${s.dir}/query.bin`;
      await Deno.writeFile(reqFile, QueryPrefetchRequest.encode(s.request).finish());
      const gcFrom = s.srv.gc.length;
      const r = await new Deno.Command(PYTHON, {
        args: [
          `${ROOT}bench/rpc_latency.py`,
          "--tcp",
          s.srv.grpc,
          "--uds",
          s.srv.uds,
          "--n",
          String(N),
          "--warmup",
          String(WARMUP),
          "--query-request",
          reqFile,
        ],
        stderr: "inherit",
      }).output();
      if (!r.success) throw new Error(`python probe failed (${r.code})`);
      const py = JSON.parse(new TextDecoder().decode(r.stdout)) as {
        grpcio: string;
        results: Record<string, Dist>;
      };
      results[s.name].python = py;
      results[s.name].python_server_gc = gcSummary(s.srv.gc.slice(gcFrom));
      for (const [key, d] of Object.entries(py.results)) {
        const [rpc, via] = key.split("/");
        addRow(
          s.name,
          `python grpcio ${py.grpcio}`,
          rpc === "health" ? "Health" : `Query(${HASHES})`,
          via,
          d,
        );
      }
    }
  }
} finally {
  for (const s of servers) {
    s.sim.close();
    await s.srv.kill();
    for (const c of s.clients) c.close();
    await Deno.remove(s.dir, { recursive: true });
  }
}

const header = ["server", "client", "rpc", "via", "p50", "p90", "p99", "p99.9", "max", "p99/p50"];
const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => r[i].length)));
const line = (r: string[]) => "| " + r.map((c, i) => c.padEnd(widths[i])).join(" | ") + " |";
console.log(`RPC latency, ms (n=${N} per row after ${WARMUP} warm-up; host backend)`);
console.log(line(header));
console.log("| " + widths.map((w) => "-".repeat(w)).join(" | ") + " |");
for (const r of rows) console.log(line(r));
// Server side of the Deno probe's windows: GC pauses (V8 --trace-gc) and handler times.
for (const [variant, r] of Object.entries(results)) {
  for (const rpc of ["health", "query"]) {
    console.log(
      `${variant} ${rpc}: server GC ${JSON.stringify(r[`${rpc}_server_gc`])}; handler ` +
        JSON.stringify(r[`${rpc}_server_handler`]),
    );
  }
}

await Deno.mkdir(o.out, { recursive: true });
const file = `${o.out}/rpc_latency.json`;
await Deno.writeTextFile(
  file,
  JSON.stringify(
    {
      when: new Date().toISOString(),
      machine: {
        cpus: navigator.hardwareConcurrency,
        loadavg: Deno.loadavg(),
        deno: Deno.version.deno,
      },
      workload: { n: N, warmup: WARMUP, hashes: HASHES, batch: BATCH, python: usePython },
      results,
    },
    null,
    1,
  ) + "\n",
);
console.log(`wrote ${file}`);
