/**
 * Router overhead benchmark: the same streaming workload sent straight to a decode backend and
 * through the router (prefill + decode + relay), at a fixed concurrency, on loopback.
 *
 * Reports time to first chunk (TTFT) and full-stream latency percentiles for both paths, the
 * latency the router adds (router pXX − direct pXX), and throughput. Prints a table and writes
 * bench/results/router.json. Not a test: it asserts nothing about time.
 *
 * Run: `deno run -A --unstable-no-legacy-abort bench/router_bench.ts [--concurrency 256]
 *       [--requests 2048] [--chunks 16] [--chunk-delay-ms 20] [--rounds 2] [--out FILE]`
 *
 * @module
 */

import { spawnBackend, spawnRouter } from "../tests/router/harness.ts";

function flag(name: string, fallback: number): number {
  const i = Deno.args.indexOf(`--${name}`);
  if (i < 0) return fallback;
  const v = Number(Deno.args[i + 1]);
  if (!Number.isFinite(v) || v <= 0) throw new Error(`--${name}: expected a positive number, got '${Deno.args[i + 1]}'`);
  return v;
}
const CONCURRENCY = flag("concurrency", 256);
const REQUESTS = flag("requests", 2048);
const CHUNKS = flag("chunks", 16);
const CHUNK_DELAY_MS = flag("chunk-delay-ms", 20);
const ROUNDS = flag("rounds", 2);
const WARMUP_REQUESTS = Math.min(CONCURRENCY * 2, 512);
const outIdx = Deno.args.indexOf("--out");
const OUT = outIdx >= 0 ? Deno.args[outIdx + 1] : new URL("./results/router.json", import.meta.url).pathname;

interface Sample {
  ttftMs: number;
  totalMs: number;
}

const body = JSON.stringify({ model: "bench", prompt: "benchmark prompt", max_tokens: CHUNKS, stream: true });
const client = Deno.createHttpClient({});

async function one(url: string): Promise<Sample> {
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
  let ttft = -1;
  let bytes = 0;
  for await (const chunk of res.body) {
    if (ttft < 0) ttft = performance.now() - t0;
    bytes += chunk.byteLength;
  }
  if (bytes === 0) throw new Error(`empty stream from ${url}`);
  return { ttftMs: ttft, totalMs: performance.now() - t0 };
}

/** Runs `total` requests with at most `concurrency` in flight; returns samples and wall time. */
async function load(url: string, total: number, concurrency: number) {
  const samples: Sample[] = [];
  let next = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: concurrency }, async () => {
    while (next < total) {
      next++;
      samples.push(await one(url));
    }
  }));
  return { samples, wallMs: performance.now() - t0 };
}

function pct(sorted: number[], p: number): number {
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1));
  return sorted[i];
}

function summarize(samples: Sample[], wallMs: number) {
  const ttft = samples.map((s) => s.ttftMs).sort((a, b) => a - b);
  const total = samples.map((s) => s.totalMs).sort((a, b) => a - b);
  return {
    requests: samples.length,
    ttft_ms: { p50: pct(ttft, 50), p90: pct(ttft, 90), p99: pct(ttft, 99), max: ttft.at(-1)! },
    total_ms: { p50: pct(total, 50), p90: pct(total, 90), p99: pct(total, 99), max: total.at(-1)! },
    throughput_rps: samples.length / (wallMs / 1000),
    chunks_per_s: (samples.length * (CHUNKS + 1)) / (wallMs / 1000),
  };
}

const p = await spawnBackend("P-bench", ["--no-record"]);
const d = await spawnBackend("D-bench", ["--no-record"]);
await d.control({ chunks: CHUNKS, chunkDelayMs: CHUNK_DELAY_MS });
const router = await spawnRouter(["--prefill", p.url, "--decode", d.url, "--log-level", "warn"]);
const direct = `${d.url}/v1/completions`;
const routed = `${router.url}/v1/completions`;
try {
  // Warm both paths: JIT, keep-alive pools on client → router → backends.
  await load(direct, WARMUP_REQUESTS, CONCURRENCY);
  await load(routed, WARMUP_REQUESTS, CONCURRENCY);
  const acc = { direct: { samples: [] as Sample[], wallMs: 0 }, router: { samples: [] as Sample[], wallMs: 0 } };
  // Alternate the two paths so slow drift on a shared machine hits both alike.
  for (let r = 0; r < ROUNDS; r++) {
    for (const [name, url] of [["direct", direct], ["router", routed]] as const) {
      const { samples, wallMs } = await load(url, Math.ceil(REQUESTS / ROUNDS), CONCURRENCY);
      acc[name].samples.push(...samples);
      acc[name].wallMs += wallMs;
    }
  }
  const dir = summarize(acc.direct.samples, acc.direct.wallMs);
  const rt = summarize(acc.router.samples, acc.router.wallMs);
  const added = {
    ttft_p50_ms: rt.ttft_ms.p50 - dir.ttft_ms.p50,
    ttft_p99_ms: rt.ttft_ms.p99 - dir.ttft_ms.p99,
    total_p50_ms: rt.total_ms.p50 - dir.total_ms.p50,
    total_p99_ms: rt.total_ms.p99 - dir.total_ms.p99,
  };
  const f = (n: number) => n.toFixed(2).padStart(9);
  console.log(`\nrouter overhead: ${CONCURRENCY} concurrent streams, ${CHUNKS} chunks every ${CHUNK_DELAY_MS} ms, ${acc.router.samples.length} requests per path\n`);
  console.log("path      | ttft p50 | ttft p90 | ttft p99 | total p50 | total p99 |   req/s | chunks/s");
  console.log("----------|----------|----------|----------|-----------|-----------|---------|---------");
  for (const [name, s] of [["direct D", dir], ["router", rt]] as const) {
    console.log(
      `${name.padEnd(9)} |${f(s.ttft_ms.p50)} |${f(s.ttft_ms.p90)} |${f(s.ttft_ms.p99)} | ${f(s.total_ms.p50)} | ${f(s.total_ms.p99)} | ${s.throughput_rps.toFixed(0).padStart(7)} | ${s.chunks_per_s.toFixed(0).padStart(8)}`,
    );
  }
  console.log(
    `added     |${f(added.ttft_p50_ms)} |          |${f(added.ttft_p99_ms)} | ${f(added.total_p50_ms)} | ${f(added.total_p99_ms)} |`,
  );
  console.log("(ms; added = router − direct at the same percentile; target: added p99 ≤ 2 ms)\n");
  const result = {
    benchmark: "router_overhead",
    date: new Date().toISOString(),
    command: `deno run -A --unstable-no-legacy-abort bench/router_bench.ts ${Deno.args.join(" ")}`.trim(),
    machine: { cpus: navigator.hardwareConcurrency, os: Deno.build.os, deno: Deno.version.deno },
    workload: {
      concurrency: CONCURRENCY,
      requests_per_path: acc.router.samples.length,
      chunks_per_stream: CHUNKS,
      chunk_delay_ms: CHUNK_DELAY_MS,
      rounds: ROUNDS,
      warmup_requests_per_path: WARMUP_REQUESTS,
      router_path: "client → router → prefill (max_tokens=1, instant) → decode stream relayed",
    },
    direct: dir,
    router: rt,
    added,
    target: { added_p99_ms: 2 },
  };
  await Deno.mkdir(new URL(".", `file://${OUT}`).pathname, { recursive: true });
  await Deno.writeTextFile(OUT, JSON.stringify(result, null, 2) + "\n");
  console.log(`wrote ${OUT}`);
} finally {
  client.close();
  await Promise.all([router.stop(), p.stop(), d.stop()]);
}
