/**
 * Router overhead benchmark: one streaming workload sent straight to a decode backend and then
 * through the router (client → router → prefill with max_tokens=1 → decode, relayed), at a fixed
 * concurrency on loopback, alternating the two paths so drift on a shared machine hits both.
 *
 * The fake decode engine works like a batching engine: the first chunk leaves at once, then one
 * timer emits the next chunk of every open stream each step; a stream has max_tokens chunks,
 * drawn per request around --chunks. Each chunk carries the time it was
 * sent, so the client measures three latencies per path:
 * - TTFT: request sent → first chunk received (the router adds the prefill hop and the decode hop);
 * - chunk delivery: chunk sent by D → chunk received by the client (the relay's cost per chunk);
 * - total: request sent → stream done.
 * "Added" is router − direct at the same percentile. Also reported: throughput and the router
 * process's CPU time per request. Prints a table, writes bench/results/router.json (or --out).
 * Not a test: nothing is asserted about time.
 *
 * Run: `deno run -A --unstable-no-legacy-abort --unstable-net bench/router_overhead.ts
 *       [--concurrency 256] [--requests 2048] [--chunks 32] [--step-ms 20] [--rounds 2]
 *       [--workers N|auto] [--out FILE]` (`deno task bench:router ...` passes the Deno flags).
 * `--workers` is handed to both routers (default: the router's own default, auto).
 *
 * @module
 */

import { spawnBackend, spawnRouter } from "../tests/router/harness.ts";
import { statCpuSeconds } from "../lib/server/process_metrics.ts";
import { benchCli } from "./cli.ts";

const FLAGS = {
  "--concurrency": "concurrent streams, a closed loop (default 256)",
  "--requests": "recorded requests per path (default 2048)",
  "--chunks": "mean chunks per stream (default 32)",
  "--step-ms": "the fake decode engine's step, ms (default 20)",
  "--rounds": "rounds alternating the paths (default 2)",
  "--workers": "N or auto, handed to both routers (default: the router's own, auto)",
  "--out": "the JSON file (default bench/results/router.json)",
};
const args = benchCli({
  usage: "deno run -A --unstable-no-legacy-abort --unstable-net bench/router_overhead.ts " +
    "[--flag value ...]\n       (deno task bench:router [--flag value ...])",
  about: "One streaming workload straight to a fake decode backend and through the router " +
    "(prefill hop,\nthen decode relayed), alternated on loopback: TTFT, chunk delivery and " +
    "total latency the router adds.",
  flags: FLAGS,
  writes: "a table on stdout and bench/results/router.json (or --out)",
});

function flag(name: string, fallback: number): number {
  const given = args.flags[`--${name}`];
  if (given === undefined) return fallback;
  const v = Number(given);
  if (!Number.isFinite(v) || v <= 0) {
    console.error(`--${name}: expected a positive number, got '${given}'`);
    Deno.exit(2);
  }
  return v;
}
const CONCURRENCY = flag("concurrency", 256);
const REQUESTS = flag("requests", 2048);
const CHUNKS = flag("chunks", 32);
const STEP_MS = flag("step-ms", 20);
const ROUNDS = flag("rounds", 2);
/** Enough to warm the JIT and fill every keep-alive pool on both paths. */
const WARMUP_REQUESTS = CONCURRENCY;
/** `--workers` for both routers: a count or `auto`; absent, the router's default (auto). */
const WORKERS = args.flags["--workers"];
if (WORKERS !== undefined && !/^(auto|[1-9]\d*)$/.test(WORKERS)) {
  console.error(`--workers: expected 'auto' or a positive whole number, got '${WORKERS}'`);
  Deno.exit(2);
}
const OUT = args.flags["--out"] ?? new URL("./results/router.json", import.meta.url).pathname;

/**
 * Stream lengths vary (CHUNKS/2 … 3·CHUNKS/2 tokens, seeded so every path sees the same
 * sequence): with equal lengths every stream would end on the same engine step and the next
 * requests would all arrive in one burst, which real traffic does not do.
 */
function lengths(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    const r = ((t ^ (t >>> 14)) >>> 0) / 2 ** 32;
    return Math.max(1, Math.round(CHUNKS / 2 + r * CHUNKS));
  };
}
const LENGTH_SEED = 42;
const bodyFor = (tokens: number) =>
  JSON.stringify({ model: "bench", prompt: "benchmark prompt", max_tokens: tokens, stream: true });
const client = Deno.createHttpClient({});
const decoder = new TextDecoder();
const SENT_AT = '"sent_at":';
const wallNow = () => performance.timeOrigin + performance.now();

interface PathSamples {
  ttft: number[];
  total: number[];
  chunk: number[];
  chunks: number;
  wallMs: number;
  /** Every request sent while measuring CPU, recorded or not (the ramp's too). */
  sent: number;
}

const newSamples = (): PathSamples => ({
  ttft: [],
  total: [],
  chunk: [],
  chunks: 0,
  wallMs: 0,
  sent: 0,
});

async function one(url: string, into: PathSamples | null, body: string): Promise<void> {
  const t0 = performance.now();
  const res = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body,
    client,
  });
  if (res.status !== 200 || res.body === null) {
    throw new Error(`HTTP ${res.status} from ${url}: ${await res.text()}`);
  }
  let first = true;
  for await (const bytes of res.body) {
    const at = wallNow();
    if (first) {
      into?.ttft.push(performance.now() - t0);
      first = false;
    }
    if (into === null) continue;
    // A read may hold several events when the relay coalesced them; time each one.
    const text = decoder.decode(bytes);
    for (let i = text.indexOf(SENT_AT); i >= 0; i = text.indexOf(SENT_AT, i + 1)) {
      const start = i + SENT_AT.length;
      let end = start;
      while (end < text.length && text[end] !== "," && text[end] !== "}") end++;
      into.chunk.push(at - Number(text.slice(start, end)));
      into.chunks++;
    }
  }
  if (first) throw new Error(`empty stream from ${url}`);
  into?.total.push(performance.now() - t0);
}

/**
 * A closed loop of `concurrency` clients measured in steady state. The clients join one by one
 * over a mean stream's duration, the way independent users arrive, and each client's first
 * request is not recorded: 256 requests landing in the same millisecond on a cold path would
 * measure connection set-up and a burst no real deployment sees, not the router. Then `total`
 * requests are recorded.
 */
async function load(url: string, total: number, concurrency: number, into: PathSamples) {
  let recorded = 0;
  const nextLength = lengths(LENGTH_SEED);
  const rampMs = CHUNKS * STEP_MS;
  let t0 = 0;
  let ramped = 0;
  await Promise.all(Array.from({ length: concurrency }, async (_, k) => {
    await new Promise((r) => setTimeout(r, (k * rampMs) / concurrency));
    into.sent++;
    await one(url, null, bodyFor(nextLength()));
    if (++ramped === concurrency) t0 = performance.now();
    while (recorded < total) {
      const measure = ramped === concurrency;
      if (measure) recorded++;
      into.sent++;
      await one(url, measure ? into : null, bodyFor(nextLength()));
    }
  }));
  into.wallMs += performance.now() - t0;
}

function pct(values: number[], p: number): number {
  const sorted = values.toSorted((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))];
}

function dist(values: number[]) {
  return {
    p50: pct(values, 50),
    p90: pct(values, 90),
    p95: pct(values, 95),
    p99: pct(values, 99),
    p999: pct(values, 99.9),
    max: pct(values, 100),
  };
}

/** Cumulative bucket counts of one router histogram, to show where the added time goes. */
function buckets(metrics: string, name: string): Record<string, number> {
  const out: Record<string, number> = {};
  for (const line of metrics.split("\n")) {
    if (!line.startsWith(`${name}_bucket{`)) continue;
    const le = /le="([^"]+)"/.exec(line)?.[1];
    if (le !== undefined) out[le] = (out[le] ?? 0) + Number(line.slice(line.lastIndexOf(" ") + 1));
  }
  return out;
}

function summarize(s: PathSamples) {
  return {
    requests: s.total.length,
    ttft_ms: dist(s.ttft),
    chunk_delivery_ms: dist(s.chunk),
    total_ms: dist(s.total),
    throughput_rps: s.total.length / (s.wallMs / 1000),
    chunks_per_s: s.chunks / (s.wallMs / 1000),
  };
}

/** CPU seconds of the process's main thread (where the JS event loop runs) and of all threads. */
async function threadCpu(pid: number): Promise<{ main: number; all: number }> {
  let all = 0;
  let main = 0;
  for await (const t of Deno.readDir(`/proc/${pid}/task`)) {
    const s = statCpuSeconds(await Deno.readTextFile(`/proc/${pid}/task/${t.name}/stat`));
    all += s;
    if (t.name === String(pid)) main = s;
  }
  return { main, all };
}

async function cpuSeconds(pid: number): Promise<number> {
  return statCpuSeconds(await Deno.readTextFile(`/proc/${pid}/stat`));
}

const p = await spawnBackend("P-bench", ["--no-record"]);
const d = await spawnBackend("D-bench", ["--no-record"]);
await d.control({ chunks: CHUNKS, stepMs: STEP_MS });
const common = [
  "--prefill",
  p.url,
  "--decode",
  d.url,
  "--log-level",
  "warn",
  ...(WORKERS === undefined ? [] : ["--workers", WORKERS]),
];
// The default router pipes D's body natively; with --stream-idle-timeout it inspects each chunk.
const routers = {
  router: await spawnRouter(common),
  "router+idle": await spawnRouter([...common, "--stream-idle-timeout", "60s"]),
};
const paths = {
  direct: `${d.url}/v1/completions`,
  router: `${routers.router.url}/v1/completions`,
  "router+idle": `${routers["router+idle"].url}/v1/completions`,
};
type PathName = keyof typeof paths;
const names = Object.keys(paths) as PathName[];
try {
  for (const name of names) await load(paths[name], WARMUP_REQUESTS, CONCURRENCY, newSamples());
  const acc = Object.fromEntries(names.map((n) => [n, newSamples()])) as Record<
    PathName,
    PathSamples
  >;
  const cpu: Record<PathName, number> = { direct: 0, router: 0, "router+idle": 0 };
  const perRound = Math.ceil(REQUESTS / ROUNDS);
  // Alternate the paths so slow drift on a shared machine hits all of them alike.
  for (let r = 0; r < ROUNDS; r++) {
    for (const name of names) {
      const pid = name === "direct" ? null : routers[name].pid;
      const c0 = pid === null ? 0 : await cpuSeconds(pid);
      await load(paths[name], perRound, CONCURRENCY, acc[name]);
      if (pid !== null) cpu[name] += (await cpuSeconds(pid)) - c0;
    }
  }
  const stats = Object.fromEntries(names.map((n) => [n, summarize(acc[n])])) as Record<
    PathName,
    ReturnType<typeof summarize>
  >;
  const addedOver = (s: ReturnType<typeof summarize>) => ({
    ttft_p50_ms: s.ttft_ms.p50 - stats.direct.ttft_ms.p50,
    ttft_p99_ms: s.ttft_ms.p99 - stats.direct.ttft_ms.p99,
    chunk_p50_ms: s.chunk_delivery_ms.p50 - stats.direct.chunk_delivery_ms.p50,
    chunk_p99_ms: s.chunk_delivery_ms.p99 - stats.direct.chunk_delivery_ms.p99,
    total_p50_ms: s.total_ms.p50 - stats.direct.total_ms.p50,
    total_p99_ms: s.total_ms.p99 - stats.direct.total_ms.p99,
  });
  const added = { router: addedOver(stats.router), "router+idle": addedOver(stats["router+idle"]) };
  const cpuUs = (n: "router" | "router+idle") => (cpu[n] / acc[n].sent) * 1e6;

  const f = (n: number, w = 8) => n.toFixed(2).padStart(w);
  console.log(
    `\nrouter overhead: ${CONCURRENCY} concurrent streams, ${CHUNKS} chunks each (one per ` +
      `${STEP_MS} ms engine step), ${acc.router.total.length} requests per path, ` +
      `${navigator.hardwareConcurrency} CPUs, router --workers ${WORKERS ?? "auto"}\n`,
  );
  console.log(
    "path         | ttft p50 | ttft p99 | chunk p50 | chunk p99 | total p50 | total p99 |  req/s | chunks/s | router CPU/req",
  );
  console.log(
    "-------------|----------|----------|-----------|-----------|-----------|-----------|--------|----------|---------------",
  );
  for (const name of names) {
    const s = stats[name];
    const c = name === "direct" ? "" : `${cpuUs(name).toFixed(0)} µs`;
    console.log(
      `${name.padEnd(12)} | ${f(s.ttft_ms.p50)} | ${f(s.ttft_ms.p99)} | ${
        f(s.chunk_delivery_ms.p50, 9)
      } | ` +
        `${f(s.chunk_delivery_ms.p99, 9)} | ${f(s.total_ms.p50, 9)} | ${f(s.total_ms.p99, 9)} | ` +
        `${s.throughput_rps.toFixed(0).padStart(6)} | ${
          s.chunks_per_s.toFixed(0).padStart(8)
        } | ${c}`,
    );
  }
  for (const name of ["router", "router+idle"] as const) {
    const a = added[name];
    console.log(
      `${("+" + name).padEnd(12)} | ${f(a.ttft_p50_ms)} | ${f(a.ttft_p99_ms)} | ${
        f(a.chunk_p50_ms, 9)
      } | ` +
        `${f(a.chunk_p99_ms, 9)} | ${f(a.total_p50_ms, 9)} | ${f(a.total_p99_ms, 9)} |`,
    );
  }
  console.log(
    "(ms; +router = router − direct at the same percentile, i.e. the latency the router adds; " +
      "target: added p99 ≤ 2 ms)\n",
  );
  const threads = await threadCpu(routers.router.pid);
  console.log(
    `router (native) CPU since start: ${threads.all.toFixed(2)} s, of which the main (JS + ` +
      `event loop) thread ${threads.main.toFixed(2)} s`,
  );
  const m = await routers.router.metrics();
  const breakdown = {
    prefill_duration_le_seconds: buckets(m, "pegaflow_router_prefill_duration_seconds"),
    decode_ttfb_le_seconds: buckets(m, "pegaflow_router_decode_ttfb_seconds"),
  };
  const tails = (n: PathName) =>
    `${n}: ttft p90 ${f(stats[n].ttft_ms.p90, 0)} p95 ${f(stats[n].ttft_ms.p95, 0)} p99.9 ` +
    `${f(stats[n].ttft_ms.p999, 0)} max ${f(stats[n].ttft_ms.max, 0)}`;
  console.log(names.map(tails).join("\n"));
  console.log(
    `router (native) prefill round trip, cumulative counts by le (s): ${
      JSON.stringify(breakdown.prefill_duration_le_seconds)
    }`,
  );
  console.log(
    `router (native) decode headers, cumulative counts by le (s): ${
      JSON.stringify(breakdown.decode_ttfb_le_seconds)
    }\n`,
  );
  const result = {
    benchmark: "router_overhead",
    date: new Date().toISOString(),
    command: `deno run -A --unstable-no-legacy-abort --unstable-net bench/router_overhead.ts ${
      Deno.args.join(" ")
    }`.trim(),
    machine: { cpus: navigator.hardwareConcurrency, os: Deno.build.os, deno: Deno.version.deno },
    workload: {
      concurrency: CONCURRENCY,
      requests_per_path: acc.router.total.length,
      chunks_per_stream: `${Math.round(CHUNKS / 2)}…${
        Math.round(CHUNKS * 1.5)
      } (seeded, mean ${CHUNKS})`,
      engine_step_ms: STEP_MS,
      rounds: ROUNDS,
      warmup_requests_per_path: WARMUP_REQUESTS,
      router_workers: WORKERS === undefined
        ? `auto (min(4, ${navigator.hardwareConcurrency} cores) = ${
          Math.min(4, navigator.hardwareConcurrency)
        })`
        : WORKERS,
      router_path: "client → router → prefill (max_tokens=1, answers at once) → decode, relayed",
      paths: {
        direct: "client → decode",
        router: "default router: decode body piped natively",
        "router+idle": "router with --stream-idle-timeout 60s: every chunk inspected in JS",
      },
    },
    results: stats,
    added,
    router_cpu_us_per_request: { router: cpuUs("router"), "router+idle": cpuUs("router+idle") },
    router_histograms_including_warmup: breakdown,
    router_cpu_seconds_since_start: threads,
    target: { added_p99_ms: 2 },
  };
  await Deno.mkdir(OUT.slice(0, OUT.lastIndexOf("/")) || ".", { recursive: true });
  await Deno.writeTextFile(OUT, JSON.stringify(result, null, 2) + "\n");
  console.log(`wrote ${OUT}`);
} finally {
  client.close();
  await Promise.all([routers.router.stop(), routers["router+idle"].stop(), p.stop(), d.stop()]);
}
