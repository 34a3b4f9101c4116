/**
 * Router overhead benchmark: one streaming workload sent straight to a decode backend and then
 * through the router (client → router → prefill with max_tokens=1 → decode, relayed), at a fixed
 * concurrency on loopback, alternating the two paths so drift on a shared machine hits both.
 *
 * The fake decode engine works like a batching engine: the first chunk leaves at once, then one
 * timer emits the next chunk of every open stream each step. Each chunk carries the time it was
 * sent, so the client measures three latencies per path:
 * - TTFT: request sent → first chunk received (the router adds the prefill hop and the decode hop);
 * - chunk delivery: chunk sent by D → chunk received by the client (the relay's cost per chunk);
 * - total: request sent → stream done.
 * "Added" is router − direct at the same percentile. Also reported: throughput and the router
 * process's CPU time per request. Prints a table, writes bench/results/router.json (or --out).
 * Not a test: nothing is asserted about time.
 *
 * Run: `deno run -A --unstable-no-legacy-abort bench/router_bench.ts [--concurrency 256]
 *       [--requests 2048] [--chunks 32] [--step-ms 20] [--rounds 2] [--out FILE]`
 *
 * @module
 */

import { spawnBackend, spawnRouter } from "../tests/router/harness.ts";

function flag(name: string, fallback: number): number {
  const i = Deno.args.indexOf(`--${name}`);
  if (i < 0) return fallback;
  const v = Number(Deno.args[i + 1]);
  if (!Number.isFinite(v) || v <= 0) {
    throw new Error(`--${name}: expected a positive number, got '${Deno.args[i + 1]}'`);
  }
  return v;
}
const CONCURRENCY = flag("concurrency", 256);
const REQUESTS = flag("requests", 2048);
const CHUNKS = flag("chunks", 32);
const STEP_MS = flag("step-ms", 20);
const ROUNDS = flag("rounds", 2);
/** Enough to warm the JIT and fill every keep-alive pool on both paths. */
const WARMUP_REQUESTS = Math.min(CONCURRENCY * 2, 512);
const outIdx = Deno.args.indexOf("--out");
const OUT = outIdx >= 0
  ? Deno.args[outIdx + 1]
  : new URL("./results/router.json", import.meta.url).pathname;
/** Linux reports process CPU time in clock ticks of 1/100 s. */
const CLOCK_TICKS_PER_S = 100;

const body = JSON.stringify({
  model: "bench",
  prompt: "benchmark prompt",
  max_tokens: CHUNKS,
  stream: true,
});
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
}

const newSamples = (): PathSamples => ({ ttft: [], total: [], chunk: [], chunks: 0, wallMs: 0 });

async function one(url: string, into: PathSamples): Promise<void> {
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
      into.ttft.push(performance.now() - t0);
      first = false;
    }
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
  into.total.push(performance.now() - t0);
}

/** `total` requests with at most `concurrency` in flight (closed loop). */
async function load(url: string, total: number, concurrency: number, into: PathSamples) {
  let started = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: concurrency }, async () => {
    while (started < total) {
      started++;
      await one(url, into);
    }
  }));
  into.wallMs += performance.now() - t0;
}

function pct(values: number[], p: number): number {
  const sorted = values.toSorted((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))];
}

function dist(values: number[]) {
  return { p50: pct(values, 50), p90: pct(values, 90), p99: pct(values, 99), max: pct(values, 100) };
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

async function cpuSeconds(pid: number): Promise<number> {
  const stat = await Deno.readTextFile(`/proc/${pid}/stat`);
  // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  return (Number(fields[11]) + Number(fields[12])) / CLOCK_TICKS_PER_S;
}

const p = await spawnBackend("P-bench", ["--no-record"]);
const d = await spawnBackend("D-bench", ["--no-record"]);
await d.control({ chunks: CHUNKS, stepMs: STEP_MS });
const router = await spawnRouter(["--prefill", p.url, "--decode", d.url, "--log-level", "warn"]);
const direct = `${d.url}/v1/completions`;
const routed = `${router.url}/v1/completions`;
try {
  await load(direct, WARMUP_REQUESTS, CONCURRENCY, newSamples());
  await load(routed, WARMUP_REQUESTS, CONCURRENCY, newSamples());
  const acc = { direct: newSamples(), router: newSamples() };
  const perRound = Math.ceil(REQUESTS / ROUNDS);
  let routerCpu = 0;
  for (let r = 0; r < ROUNDS; r++) {
    await load(direct, perRound, CONCURRENCY, acc.direct);
    const c0 = await cpuSeconds(router.pid);
    await load(routed, perRound, CONCURRENCY, acc.router);
    routerCpu += (await cpuSeconds(router.pid)) - c0;
  }
  const dir = summarize(acc.direct);
  const rt = summarize(acc.router);
  const added = {
    ttft_p50_ms: rt.ttft_ms.p50 - dir.ttft_ms.p50,
    ttft_p99_ms: rt.ttft_ms.p99 - dir.ttft_ms.p99,
    chunk_p50_ms: rt.chunk_delivery_ms.p50 - dir.chunk_delivery_ms.p50,
    chunk_p99_ms: rt.chunk_delivery_ms.p99 - dir.chunk_delivery_ms.p99,
    total_p50_ms: rt.total_ms.p50 - dir.total_ms.p50,
    total_p99_ms: rt.total_ms.p99 - dir.total_ms.p99,
  };
  const routerCpuUsPerRequest = (routerCpu / acc.router.total.length) * 1e6;

  const f = (n: number, w = 8) => n.toFixed(2).padStart(w);
  console.log(
    `\nrouter overhead: ${CONCURRENCY} concurrent streams, ${CHUNKS} chunks each (one per ` +
      `${STEP_MS} ms engine step), ${acc.router.total.length} requests per path, ` +
      `${navigator.hardwareConcurrency} CPUs\n`,
  );
  console.log(
    "path     | ttft p50 | ttft p99 | chunk p50 | chunk p99 | total p50 | total p99 |  req/s | chunks/s",
  );
  console.log(
    "---------|----------|----------|-----------|-----------|-----------|-----------|--------|---------",
  );
  for (const [name, s] of [["direct D", dir], ["router", rt]] as const) {
    console.log(
      `${name.padEnd(8)} | ${f(s.ttft_ms.p50)} | ${f(s.ttft_ms.p99)} | ${f(s.chunk_delivery_ms.p50, 9)} | ` +
        `${f(s.chunk_delivery_ms.p99, 9)} | ${f(s.total_ms.p50, 9)} | ${f(s.total_ms.p99, 9)} | ` +
        `${s.throughput_rps.toFixed(0).padStart(6)} | ${s.chunks_per_s.toFixed(0).padStart(8)}`,
    );
  }
  console.log(
    `added    | ${f(added.ttft_p50_ms)} | ${f(added.ttft_p99_ms)} | ${f(added.chunk_p50_ms, 9)} | ` +
      `${f(added.chunk_p99_ms, 9)} | ${f(added.total_p50_ms, 9)} | ${f(added.total_p99_ms, 9)} |`,
  );
  console.log(
    `(ms; added = router − direct at the same percentile; target: added p99 ≤ 2 ms)\n` +
      `router CPU: ${routerCpuUsPerRequest.toFixed(0)} µs per request ` +
      `(${(routerCpu / (acc.router.wallMs / 1000) * 100).toFixed(0)}% of one core while loaded)\n`,
  );
  const result = {
    benchmark: "router_overhead",
    date: new Date().toISOString(),
    command: `deno run -A --unstable-no-legacy-abort bench/router_bench.ts ${Deno.args.join(" ")}`
      .trim(),
    machine: { cpus: navigator.hardwareConcurrency, os: Deno.build.os, deno: Deno.version.deno },
    workload: {
      concurrency: CONCURRENCY,
      requests_per_path: acc.router.total.length,
      chunks_per_stream: CHUNKS,
      engine_step_ms: STEP_MS,
      rounds: ROUNDS,
      warmup_requests_per_path: WARMUP_REQUESTS,
      router_path: "client → router → prefill (max_tokens=1, answers at once) → decode, relayed",
    },
    direct: dir,
    router: rt,
    added,
    router_cpu_us_per_request: routerCpuUsPerRequest,
    target: { added_p99_ms: 2 },
  };
  await Deno.mkdir(OUT.slice(0, OUT.lastIndexOf("/")) || ".", { recursive: true });
  await Deno.writeTextFile(OUT, JSON.stringify(result, null, 2) + "\n");
  console.log(`wrote ${OUT}`);
} finally {
  client.close();
  await Promise.all([router.stop(), p.stop(), d.stop()]);
}
