/**
 * Peer fetch over TCP between two server processes in two network
 * namespaces vs the raw TCP throughput of the same path, measured in the
 * same run (`deno run -A bench/peer_fetch.ts`; root and `ip netns`, else
 * loopback, said so).
 *
 * Node A saves a prefix of `PEER_BENCH_BLOCKS` (default 256) Llama-3.1-8B
 * blocks (32 layers × K/V × 32 KiB = 2 MiB each); an engine on node B queries
 * it, which fetches it from A (index lookup → lock → one READ batch →
 * checksums → release) and answers from RAM. Then B evicts it and the next
 * run fetches again. Each run is alternated with a raw blast over the same
 * path (`pf_tcp_blast` from A's transfer listener into a pinned pool in B's
 * namespace, the same bytes over the same number of streams). Reported per
 * run, median of `PEER_BENCH_REPEAT` (default 5) after `PEER_BENCH_WARMUP` (default 1) warm-up
 * fetches:
 *
 *  - fetch GB/s: bytes / B's fetch duration (lookup to lock release, the
 *    server's own histogram), what a query waits for;
 *  - READ GB/s: bytes / the READ batch's own time (the transport's ns);
 *  - raw GB/s: the blast;
 *  - query ms: the engine's first query to the answer. After "loading" the
 *    engine waits with WaitPrefetch and queries again once answered (the
 *    connector's default), or with `PEER_BENCH_POLL_MS=N` polls every N ms;
 *    over B's local RPC socket (`--uds`: what an engine on the same host
 *    uses, README's `pegaflow.addr`), or with `PEER_BENCH_ENGINE_RPC=grpc`
 *    over gRPC (each poll then costs B's CPU more, which the READ feels where
 *    cores are few).
 *
 * Prints a table, writes bench/results/peer_fetch.json and draws
 * bench/results/peer_fetch.png (bench/peer_chart.py, where Python has
 * matplotlib). No assertion on time.
 *
 * @module
 */
import { LLAMA_3_1_8B, SimEngine } from "../lib/client/sim_engine.ts";
import { PegaflowClient } from "../lib/client/client.ts";
import { RedisBlockIndex } from "../lib/index/block_index.ts";
import { hostSim, type ServerProc, uid } from "../tests/server/harness.ts";
import { makeCluster } from "../tests/peer/_cluster.ts";
import { prefix } from "../tests/peer/_fetch.ts";
import { waitFor } from "../tests/index/_redis.ts";
import { benchCli, cleanupOnSignal, positiveInt } from "./cli.ts";
import { cpuDeltaMs, sampleCpu, softirqPids } from "./thread_cpu.ts";

benchCli({
  usage: "deno run -A bench/peer_fetch.ts   (settings from the environment)",
  about: "Peer fetch over TCP between two servers in two network namespaces (root and ip netns; " +
    "else loopback)\nbeside the raw TCP throughput of the same path, in the same run.",
  env: {
    PEER_BENCH_BLOCKS: "2 MiB Llama-3.1-8B blocks of the prefix (default 256)",
    PEER_BENCH_REPEAT: "measured runs after the warm-up, median reported (default 5)",
    PEER_BENCH_WARMUP: "warm-up fetches before them (default 1; a long-running server's code " +
      "is tiered up: e.g. 40)",
    PEER_BENCH_STREAMS: "TCP streams of the transfer and of the raw blast (default 4)",
    PEER_BENCH_POLL_MS: 'poll every N ms after "loading" instead of waiting with WaitPrefetch ' +
      "(default: wait, as the connector does)",
    PEER_BENCH_ENGINE_RPC: "uds (B's local RPC socket, default) or grpc",
    PEGAFLOW_PYTHON: "the Python that draws the chart (default /usr/bin/python3)",
  },
  writes: "a table on stdout, bench/results/peer_fetch.json and bench/results/peer_fetch.png",
});

const MiB = 1 << 20;
const envInt = (name: string, fallback: number) => positiveInt(name, Deno.env.get(name), fallback);
const blocks = envInt("PEER_BENCH_BLOCKS", 256);
const repeat = envInt("PEER_BENCH_REPEAT", 5);
const warmup = envInt("PEER_BENCH_WARMUP", 1);
const streams = envInt("PEER_BENCH_STREAMS", 4);
/** undefined: the engine waits with WaitPrefetch (the connector's default). */
const pollMs = Deno.env.get("PEER_BENCH_POLL_MS") === undefined
  ? undefined
  : envInt("PEER_BENCH_POLL_MS", 2);
/** One WaitPrefetch's hold: far above a fetch; the server answers when the fetch ends. */
const WAIT_MS = 10_000;
const engineRpc = Deno.env.get("PEER_BENCH_ENGINE_RPC") ?? "uds";
if (engineRpc !== "grpc" && engineRpc !== "uds") {
  console.error(`PEER_BENCH_ENGINE_RPC=${engineRpc}; expected grpc or uds`);
  Deno.exit(2);
}
const model = LLAMA_3_1_8B;
const blockBytes = model.numLayers * 2 * model.kvHeads * model.headDim * model.dtypeBytes *
  model.blockTokens;
const bytes = blocks * blockBytes;
const poolMiB = Math.ceil((bytes * 1.25) / MiB) + 64;
const out = decodeURIComponent(new URL("./results/peer_fetch.json", import.meta.url).pathname);
const CHILD = decodeURIComponent(new URL("./peer_blast_child.ts", import.meta.url).pathname);

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
async function metric(s: ServerProc, name: string, labels = ""): Promise<number> {
  const v = await s.metric(name, labels);
  return Number.isNaN(v) ? 0 : v;
}

const c = await makeCluster(2, "bp");
let udsDir = "";
let removing: Promise<void> | undefined;
/** Once: a signal's cleanup and the main path's `finally` share it, so the first one finishes. */
const removeAll = () =>
  removing ??= (async () => {
    await c.remove();
    if (udsDir) await Deno.remove(udsDir, { recursive: true });
  })();
// Interrupted, the servers die with this process; Redis's dir and the namespaces would not.
const offSignal = cleanupOnSignal(removeAll);
const flags = [
  "--pool-size",
  `${poolMiB}mb`,
  "--xfer-streams",
  String(streams),
  "--log-level",
  "info",
];
interface Run {
  fetchS: number;
  readS: number;
  rawNs: number;
  queryMs: number;
  /** B's "peer fetch done" log line: time per phase (ms). */
  phases: Record<string, number>;
  /**
   * ms of CPU per transfer by process role and thread name (bench/thread_cpu.ts): the fetch's
   * window (the engine's first query to its answer) and the raw blast's (its child's own CPU
   * during the timed blast as `blast child total`).
   */
  cpuMs: { fetch: Record<string, number>; blast: Record<string, number> };
}
const PHASES = [
  "lookup_ms",
  "lock_ms",
  "lock_rest_ms",
  "connect_ms",
  "plan_ms",
  "read_ms",
  "verify_tail_ms",
  "total_ms",
];
const runs: Run[] = [];
// Everything made after the cluster is undone by c.remove() (engines and probe first, through
// c.defer), on success and on any failure: a server that fails to start must not leave the
// other one, Redis and the namespaces behind.
try {
  const a = await c.start(0, flags);
  if (engineRpc === "uds") udsDir = await Deno.makeTempDir({ prefix: "pf-peer-bench-" });
  const b = await c.start(1, engineRpc === "uds" ? [...flags, "--uds", `${udsDir}/b.sock`] : flags);
  const clientB = engineRpc === "uds" ? new PegaflowClient(`unix:${b.uds}`) : b.client;
  if (clientB !== b.client) c.defer(() => clientB.close());
  const probe = new RedisBlockIndex({
    url: c.redis.url,
    nodeId: "probe",
    advertiseAddr: "probe:1",
    listSealed: () => [],
  });
  probe.start();
  c.defer(() => probe.close());
  const ns = uid("bench");
  const simA = hostSim(a, { instanceId: uid("a"), namespace: ns, model, numBlocks: blocks });
  c.defer(() => simA.close());
  const simB = SimEngine.create({
    client: clientB,
    instanceId: uid("b"),
    namespace: ns,
    model,
    numBlocks: 1,
    backend: "host",
  });
  c.defer(() => simB.close());
  await simA.register();
  await simB.register();
  const hashes = prefix(7, blocks);
  const ids = hashes.map((_, i) => i);
  simA.fill(ids, hashes);
  await simA.save(ids, hashes);
  await waitFor(
    "advertised",
    async () => (await probe.lookup(ns, hashes)).length === blocks,
    60_000,
  );
  await waitFor(
    "A's checksums",
    async () => await metric(a, "pegaflow_peer_checksums_total", '{when="seal"}') === blocks,
    60_000,
  );
  const open = a.logs().map((l) => JSON.parse(l)).find((o) => o.msg === "transfer endpoint open");
  const xferAddr = `${c.nodeAddr(0)}:${open.port}`;
  // The engine's polls run in this process (`bench`); the veth's deferred softirq work in `kernel`.
  const roles = { A: [a.pid], B: [b.pid], bench: [Deno.pid], kernel: softirqPids() };
  /** One fetch by B's engine (polled until answered), then B's copy evicted for the next. */
  const fetchAndEvict = async (id: string) => {
    const f0 = await metric(b, "pegaflow_peer_fetch_duration_seconds_sum");
    const r0 = await metric(b, "pegaflow_peer_read_seconds_total");
    const cpu0 = sampleCpu(roles);
    const t0 = performance.now();
    let q = await simB.query(hashes, id);
    while (q.kind === "loading") {
      if (pollMs === undefined) {
        await clientB.waitPrefetch({ instanceId: simB.instanceId, requestId: id, waitMs: WAIT_MS });
      } else {
        await new Promise((r) => setTimeout(r, pollMs));
      }
      q = await simB.query(hashes, id);
    }
    const queryMs = performance.now() - t0;
    const fetchCpu = cpuDeltaMs(cpu0, sampleCpu(roles));
    if (q.hits !== blocks) throw new Error(`${id}: ${q.hits} of ${blocks} blocks fetched`);
    const fetchS = await metric(b, "pegaflow_peer_fetch_duration_seconds_sum") - f0;
    const readS = await metric(b, "pegaflow_peer_read_seconds_total") - r0;
    await b.client.release(q.leaseId);
    await (await b.http_post("/cache/memory/cleanup")).body?.cancel();
    await waitFor("B evicted", async () => await metric(b, "pegaflow_cache_blocks") === 0);
    return { queryMs, fetchCpu, fetchS, readS };
  };
  // Fetches past the first warm-up (no blast): a long-running server's code is tiered up.
  for (let w = 1; w < warmup; w++) await fetchAndEvict(`w-${w}`);
  for (let i = 0; i <= repeat; i++) {
    const { queryMs, fetchCpu, fetchS, readS } = await fetchAndEvict(`q-${i}`);
    const argv = ["run", "-A", CHILD, xferAddr, String(streams), String(bytes)];
    const nsB = c.nodeNs(1);
    const cpu2 = sampleCpu({ A: roles.A, kernel: roles.kernel });
    const child = await new Deno.Command(nsB ? "ip" : Deno.execPath(), {
      args: nsB ? ["netns", "exec", nsB, Deno.execPath(), ...argv] : argv,
      stdout: "piped",
      stderr: "inherit",
    }).output();
    if (!child.success) throw new Error("raw blast child failed");
    const raw = JSON.parse(new TextDecoder().decode(child.stdout).trim()) as {
      ns: number;
      cpuUs: number;
    };
    // A's blast threads exit with their connections: only its total (ticks) counts them.
    const blastCpu = cpuDeltaMs(cpu2, sampleCpu({ A: roles.A, kernel: roles.kernel }));
    blastCpu["blast child total"] = raw.cpuUs / 1e3;
    const done = b.logs().map((l) => JSON.parse(l)).filter((o) => o.msg === "peer fetch done");
    const last = done[done.length - 1] ?? {};
    const phases = Object.fromEntries(PHASES.map((p) => [p, Number(last[p])]));
    const cpuMs = { fetch: fetchCpu, blast: blastCpu };
    if (i > 0) runs.push({ fetchS, readS, rawNs: raw.ns, queryMs, phases, cpuMs }); // run 0 warms up
  }
} finally {
  offSignal();
  await removeAll();
}

const fetchGBps = bytes / median(runs.map((r) => r.fetchS)) / 1e9;
const readGBps = bytes / median(runs.map((r) => r.readS)) / 1e9;
const rawGBps = bytes / median(runs.map((r) => r.rawNs));
const path = c.mode === "netns"
  ? "veth pairs to a bridge, node A's namespace → node B's namespace"
  : `loopback (${c.why})`;
const cpu = (await Deno.readTextFile("/proc/cpuinfo")).match(/model name\s*:\s*(.*)/)?.[1] ?? "?";
const cores = navigator.hardwareConcurrency;
console.log(
  `\npeer fetch of ${blocks} blocks × ${blockBytes / MiB} MiB (${
    bytes / MiB
  } MiB) over TCP, ${streams} streams, ${path}`,
);
console.log(
  `${cores} cores (${cpu}); median of ${repeat} runs after ${warmup} warm-up fetch${
    warmup > 1 ? "es" : ""
  }; engine ${
    pollMs === undefined ? "waits (WaitPrefetch)" : `polls every ${pollMs} ms`
  } over ${engineRpc}\n`,
);
console.log("| what | GB/s | vs raw TCP |");
console.log("| ---- | ---- | ---------- |");
console.log(
  `| raw TCP, same path, same bytes, into a pinned pool | ${rawGBps.toFixed(2)} | 100 % |`,
);
console.log(
  `| peer fetch (lookup → lock → READ → checksums → release) | ${fetchGBps.toFixed(2)} | ${
    (100 * fetchGBps / rawGBps).toFixed(0)
  } % |`,
);
console.log(
  `| its READ batch alone | ${readGBps.toFixed(2)} | ${(100 * readGBps / rawGBps).toFixed(0)} % |`,
);
console.log(`\nquery → answer on B, p50: ${median(runs.map((r) => r.queryMs)).toFixed(1)} ms`);
console.log(
  `fetch phases on B, p50 ms: ${
    PHASES.map((p) => `${p.replace("_ms", "")} ${median(runs.map((r) => r.phases[p])).toFixed(2)}`)
      .join(", ")
  }`,
);
printCpu(runs);
await Deno.mkdir(new URL("./results/", import.meta.url), { recursive: true });
await Deno.writeTextFile(
  out,
  JSON.stringify(
    {
      when: new Date().toISOString(),
      path,
      cores,
      cpu,
      blocks,
      blockBytes,
      bytes,
      streams,
      repeat,
      warmup,
      pollMs: pollMs ?? null,
      engineWaits: pollMs === undefined,
      engineRpc,
      fetchGBps,
      readGBps,
      rawGBps,
      fetchVsRaw: fetchGBps / rawGBps,
      readVsRaw: readGBps / rawGBps,
      runs,
    },
    null,
    2,
  ) + "\n",
);
console.log(`\nwrote ${out}`);
// The chart (bench/peer_chart.py, matplotlib): where Python has it; else the JSON is the record.
const python = Deno.env.get("PEGAFLOW_PYTHON") ??
  (await Deno.stat("/usr/bin/python3").then(() => "/usr/bin/python3", () => "python3"));
const chart = await new Deno.Command(python, {
  args: [new URL("./peer_chart.py", import.meta.url).pathname, out.replace(/\.json$/, ".png"), out],
}).output().catch((e: Error) => ({ success: false, stdout: new Uint8Array(), stderr: e.message }));
console.log(
  chart.success
    ? new TextDecoder().decode(chart.stdout).trim()
    : `chart skipped (${python} bench/peer_chart.py failed)`,
);

/**
 * The median ms of CPU per transfer of each process role and thread group, fetch beside raw
 * blast (the 0.5 ms and larger, largest first): where a fetch spends what the blast does not.
 */
function printCpu(rs: Run[]): void {
  const keys = new Set(
    rs.flatMap((r) => [...Object.keys(r.cpuMs.fetch), ...Object.keys(r.cpuMs.blast)]),
  );
  const med = (k: string, w: "fetch" | "blast") => median(rs.map((r) => r.cpuMs[w][k] ?? 0));
  const rows = [...keys].map((k) => ({ k, f: med(k, "fetch"), b: med(k, "blast") }))
    .filter((r) => r.f >= 0.5 || r.b >= 0.5)
    .sort((x, y) => y.f + y.b - (x.f + x.b));
  console.log(
    "\nCPU ms per transfer, p50 (totals in clock ticks: ±10 ms; the blast's A and kernel rows " +
      "span the child's warm-up blast and its timed one)",
  );
  console.log("| process, threads | fetch | raw blast |");
  console.log("| ---------------- | ----- | --------- |");
  for (const r of rows) console.log(`| ${r.k} | ${r.f.toFixed(1)} | ${r.b.toFixed(1)} |`);
}
