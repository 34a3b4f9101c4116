/**
 * Peer READ throughput over the TCP transport vs the raw TCP throughput of
 * the same path, measured in the same run (`deno run -A bench/xfer_tcp.ts`).
 *
 * Two node processes, each with its own pool, in two network namespaces
 * joined by a veth pair (made here; needs root and `ip netns`) — or on
 * loopback, said so in the output, where namespaces cannot be made. The
 * reading node READs `XFER_BENCH_BYTES` (default 512 MiB) per batch from the
 * serving node, for several segment sizes and stream counts; the raw figure
 * is an iperf-style blast (`pf_tcp_blast`: the same number of plain
 * connections receiving the same bytes unframed into a 1 MiB buffer) over
 * the same path, alternated with our batches, in two forms: "same memory"
 * (sent from the serving node's pool into the reading node's pool, each
 * stream its own slice: what a transfer moves between; on loopback/veth TCP
 * is copy-bound, so this is the like-for-like figure) and iperf's way (1 MiB
 * cache-resident buffers at both ends). GB/s from the median of
 * `XFER_BENCH_REPEAT` (default 5) runs after one warm-up. Prints a table and
 * writes bench/results/xfer_tcp.json. Nothing here asserts on time.
 *
 * @module
 */
import { makeNetnsPair, type NodeProc, spawnNode } from "../tests/xfer/_harness.ts";
import { benchCli, cleanupOnSignal, positiveInt } from "./cli.ts";

benchCli({
  usage: "deno run -A bench/xfer_tcp.ts   (settings from the environment)",
  about: "Peer READ over the TCP transport beside the raw TCP throughput of the same path " +
    "(two node processes\nin two network namespaces where root and ip netns allow, else loopback).",
  env: {
    XFER_BENCH_BYTES: "bytes per READ batch (default 536870912 = 512 MiB)",
    XFER_BENCH_REPEAT: "measured runs after one warm-up, median reported (default 5)",
    XFER_BENCH_STREAMS: "comma-separated stream counts (default 1,4)",
    XFER_BENCH_SEGS: "comma-separated segment sizes in bytes (default 32768,2097152)",
  },
  writes: "a table on stdout and bench/results/xfer_tcp.json",
});

const MiB = 1 << 20;
const envInt = (name: string, fallback: number) => positiveInt(name, Deno.env.get(name), fallback);
const envInts = (name: string, fallback: string) =>
  (Deno.env.get(name) ?? fallback).split(",").map((x) => positiveInt(name, x, 1));
const bytes = envInt("XFER_BENCH_BYTES", 512 * MiB);
const repeat = envInt("XFER_BENCH_REPEAT", 5);
const streamsList = envInts("XFER_BENCH_STREAMS", "1,4");
const segList = envInts("XFER_BENCH_SEGS", `${32 * 1024},${2 * MiB}`);
const out = decodeURIComponent(new URL("./results/xfer_tcp.json", import.meta.url).pathname);

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const gbps = (b: number, ns: number) => b / ns;

interface Row {
  streams: number;
  segBytes: number;
  segments: number;
  xferGBps: number;
  /** iperf-style: 1 MiB buffers. */
  rawGBps: number;
  /** Same memory footprint as the transfer. */
  rawWideGBps: number;
  ratio: number;
  ratioWide: number;
  xferNs: number[];
  rawNs: number[];
  rawWideNs: number[];
}

const ns = await makeNetnsPair("b");
const path = typeof ns === "string"
  ? `loopback (ip netns unavailable: ${ns})`
  : "veth between two network namespaces";
if (typeof ns === "string") console.log(`ip netns unavailable (${ns}); benchmarking on loopback`);
const net = typeof ns === "string" ? undefined : ns;
const addrA = net?.addrA ?? "127.0.0.1";
const rows: Row[] = [];
// The nodes die with this process; the namespaces do not.
const nodes = new Set<NodeProc>();
let removing: Promise<void> | undefined;
/** Once: a signal's cleanup and the main path's `finally` share it, so the first one finishes. */
const removeNet = () => removing ??= net?.remove() ?? Promise.resolve();
const offSignal = cleanupOnSignal(async () => {
  for (const n of nodes) {
    await n.close().catch((e) => console.error(`closing a node: ${(e as Error).message}`));
  }
  await removeNet();
});
try {
  for (const streams of streamsList) {
    let a: NodeProc | undefined, b: NodeProc | undefined;
    try {
      a = await spawnNode(
        { poolBytes: 2 * bytes, seed: 1, streams, bindAddr: addrA, fill: false },
        net?.a,
      );
      nodes.add(a);
      b = await spawnNode({ poolBytes: 2 * bytes, seed: 2, streams, fill: false }, net?.b);
      nodes.add(b);
      const addr = `${addrA}:${a.port}`;
      await b.cmd({ cmd: "connect", addr });
      for (const segBytes of segList) {
        await b.cmd({ cmd: "bench", bytes, segBytes, repeat: 1 }); // warm-up
        await b.cmd({ cmd: "blast", addr, streams, bytes, repeat: 1 });
        const xferNs: number[] = [], rawNs: number[] = [], rawWideNs: number[] = [];
        let moved = 0, rawMoved = 0;
        for (let i = 0; i < repeat; i++) {
          const rw = await b.cmd<{ ns: number[] }>({
            cmd: "blast",
            addr,
            streams,
            bytes,
            repeat: 1,
            wide: true,
          });
          rawWideNs.push(rw.ns[0]);
          const x = await b.cmd<{ ns: number[]; bytes: number }>({
            cmd: "bench",
            bytes,
            segBytes,
            repeat: 1,
          });
          const r = await b.cmd<{ ns: number[]; bytes: number }>({
            cmd: "blast",
            addr,
            streams,
            bytes,
            repeat: 1,
          });
          xferNs.push(x.ns[0]);
          rawNs.push(r.ns[0]);
          moved = x.bytes;
          rawMoved = r.bytes;
        }
        const xferGBps = gbps(moved, median(xferNs));
        const rawGBps = gbps(rawMoved, median(rawNs));
        const rawWideGBps = gbps(rawMoved, median(rawWideNs));
        rows.push({
          streams,
          segBytes,
          segments: Math.floor(bytes / segBytes),
          xferGBps,
          rawGBps,
          rawWideGBps,
          ratio: xferGBps / rawGBps,
          ratioWide: xferGBps / rawWideGBps,
          xferNs,
          rawNs,
          rawWideNs,
        });
      }
    } finally {
      await b?.close();
      await a?.close();
      nodes.clear();
    }
  }
} finally {
  offSignal();
  await removeNet();
}

const cpu = (await Deno.readTextFile("/proc/cpuinfo")).match(/model name\s*:\s*(.*)/)?.[1] ?? "?";
const cores = navigator.hardwareConcurrency;
console.log(`\npeer READ over TCP vs raw TCP, ${bytes / MiB} MiB per batch, ${path}`);
console.log(`${cores} cores (${cpu}); median of ${repeat} runs after a warm-up\n`);
console.log(
  "| streams | segment | segments | transfer GB/s | raw, same memory GB/s | ratio | raw, 1 MiB buffers GB/s | ratio |",
);
console.log(
  "| ------- | ------- | -------- | ------------- | --------------------- | ----- | ----------------------- | ----- |",
);
for (const r of rows) {
  const seg = r.segBytes >= MiB ? `${r.segBytes / MiB} MiB` : `${r.segBytes / 1024} KiB`;
  console.log(
    `| ${r.streams} | ${seg} | ${r.segments} | ${r.xferGBps.toFixed(2)} | ${
      r.rawWideGBps.toFixed(2)
    } | ${(100 * r.ratioWide).toFixed(0)} % | ${r.rawGBps.toFixed(2)} | ${
      (100 * r.ratio).toFixed(0)
    } % |`,
  );
}
await Deno.mkdir(new URL("./results/", import.meta.url), { recursive: true });
await Deno.writeTextFile(
  out,
  JSON.stringify(
    { when: new Date().toISOString(), path, cores, cpu, bytesPerBatch: bytes, repeat, rows },
    null,
    2,
  ) + "\n",
);
console.log(`\nwrote ${out}`);
