/**
 * SSD tier benchmark runner (`deno task bench:ssd`): sweeps block size ×
 * queue depth × O_DIRECT/buffered for sequential writes and reads through
 * the io_uring engine, runs fio with the same parameters on the same file,
 * prints a table with the ratio, then measures a 1.31 GB prefix (625 blocks
 * of 2 MiB: 10K tokens of Llama-3.1-8B) from SSD into the pool through the
 * tier's prefetch path. Writes everything to bench/results/ssd.json.
 *
 * Environment: SSD_BENCH_DIR (default: a temp dir under bench/results/tmp),
 * SSD_BENCH_BYTES (file bytes per point, default 256 MiB),
 * SSD_BENCH_PREFIX_BLOCKS (default 625), SSD_BENCH_QUICK=1 (one point, written
 * to bench/results/tmp/ssd-quick.json so the recorded figures stay).
 * Nothing here asserts on time.
 *
 * @module
 */

import { Engine } from "../ffi/native.ts";
import { CompletionRing } from "../ffi/ring.ts";
import { fsSpace } from "../ffi/uring.ts";
import type { PrefetchWant } from "../lib/ssd/prefetch.ts";
import { SsdTier } from "../lib/ssd/tier.ts";
import { layoutIdentity } from "../lib/storage/layout.ts";
import { Logger } from "../lib/log.ts";
import { fioArgs, type Measured, type Point, runFio, runOurs } from "./ssd_lib.ts";
import { benchCli, positiveInt } from "./cli.ts";

benchCli({
  usage: "deno run -A bench/ssd_run.ts   (deno task bench:ssd; settings from the environment)",
  about: "Sequential reads and writes through the io_uring engine beside fio (block size x " +
    "queue depth x\nO_DIRECT/buffered), then a 1.31 GB prefix from SSD into the pool through " +
    "the tier's prefetch.",
  env: {
    SSD_BENCH_DIR: "where the files go (default: a temp dir under bench/results/tmp, removed)",
    SSD_BENCH_BYTES: "file bytes per point (default 268435456 = 256 MiB)",
    SSD_BENCH_PREFIX_BLOCKS: "2 MiB blocks of the prefix (default 625)",
    SSD_BENCH_REPEAT: "runs per point per engine, median reported (default 3)",
    SSD_BENCH_QUICK: "1: one point, written to bench/results/tmp/ssd-quick.json instead",
  },
  writes: "a table on stdout and bench/results/ssd.json (SSD_BENCH_QUICK=1: " +
    "bench/results/tmp/ssd-quick.json)",
});

const MiB = 1 << 20;
const LLAMA_BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2; // layers × K/V × tokens × kv heads × head dim × bf16
const envInt = (name: string, fallback: number) => positiveInt(name, Deno.env.get(name), fallback);
const fileBytes = envInt("SSD_BENCH_BYTES", 256 * MiB);
if (fileBytes % MiB !== 0) {
  // Every point reads and writes the whole file in blocks of up to 1 MiB.
  console.error(`SSD_BENCH_BYTES must be a multiple of 1 MiB (${MiB}), got ${fileBytes}`);
  Deno.exit(2);
}
const prefixBlocks = envInt("SSD_BENCH_PREFIX_BLOCKS", 625);
const quick = Deno.env.get("SSD_BENCH_QUICK") === "1";
/** Runs per point per engine, alternating ours/fio; the median is reported (shared disk: noisy). */
const repeat = envInt("SSD_BENCH_REPEAT", 3);
/** The layout the benchmark's blocks are written and read under. */
const BENCH_LAYOUT = layoutIdentity({
  tpSize: 1,
  ppSize: 1,
  collapseTp: false,
  layers: [{ name: "bench", segBytes: LLAMA_BLOCK_BYTES, numSegments: 1 }],
});
const FP = BENCH_LAYOUT.fingerprint;
const root = decodeURIComponent(new URL("./results/", import.meta.url).pathname);
await Deno.mkdir(`${root}tmp`, { recursive: true });
const dir = Deno.env.get("SSD_BENCH_DIR") ??
  await Deno.makeTempDir({ dir: `${root}tmp`, prefix: "ssd-" });

async function sh(cmd: string, args: string[]): Promise<string> {
  try {
    const o = await new Deno.Command(cmd, { args, stdout: "piped", stderr: "null" }).output();
    return new TextDecoder().decode(o.stdout).trim();
  } catch {
    return `(${cmd} unavailable)`; // informational only: the disk description
  }
}

const disk = {
  dir,
  df: await sh("df", ["-hT", dir]),
  lsblk: await sh("lsblk", ["-o", "NAME,SIZE,ROTA,TYPE,MODEL,LOG-SEC,PHY-SEC", "-d"]),
  fio: await sh("fio", ["--version"]),
  kernel: Deno.osRelease(),
  cpus: navigator.hardwareConcurrency,
};

/** The run with the median throughput. */
function median(runs: Measured[]): Measured {
  return [...runs].sort((a, b) => a.gbps - b.gbps)[Math.floor(runs.length / 2)];
}

const rows:
  (Point & { ours: Measured; fio: Measured | null; ratio: number | null; fioCommand: string })[] =
    [];
const prefixBytes = prefixBlocks * LLAMA_BLOCK_BYTES;
const prefix: Record<string, unknown> = {
  blocks: prefixBlocks,
  blockBytes: LLAMA_BLOCK_BYTES,
  bytes: prefixBytes,
};
// A failed run must not leave its files under bench/results/tmp: everything that makes them is
// inside this try.
try {
  const engine = Engine.open({ backend: "host" });
  try {
    const points: Point[] = [];
    for (const blockBytes of quick ? [MiB] : [64 * 1024, MiB]) {
      for (const qd of quick ? [32] : [1, 32]) {
        for (const direct of quick ? [true] : [true, false]) {
          for (const op of ["write", "read"] as const) points.push({ op, blockBytes, qd, direct });
        }
      }
    }

    {
      const poolBytes = 64 * MiB;
      const pool = engine.createPool(poolBytes);
      const ring = new CompletionRing(1 << 16);
      const path = `${dir}/bench.dat`;
      // Lay the file out first, as fio does before its jobs: both engines then
      // overwrite allocated blocks instead of measuring the filesystem's allocator.
      {
        const f = await Deno.open(path, { write: true, create: true, truncate: true });
        const chunk = new Uint8Array(8 * MiB);
        for (let off = 0; off < fileBytes; off += chunk.length) await f.write(chunk);
        await f.syncData();
        f.close();
      }
      try {
        for (const pt of points) {
          const oursRuns: Measured[] = [], fioRuns: Measured[] = [];
          for (let r = 0; r < repeat; r++) {
            // Alternate who goes first: the run right after a write pays for the device's write-back.
            const ours = () =>
              runOurs(pool.handle, poolBytes, ring, path, fileBytes, pt, 64).then((m) =>
                oursRuns.push(m)
              );
            const fio = () => runFio(path, fileBytes, pt).then((m) => m && fioRuns.push(m));
            if (r % 2 === 0) await ours().then(fio);
            else await fio().then(ours);
          }
          const ours = median(oursRuns);
          const fio = fioRuns.length ? median(fioRuns) : null;
          const ratio = fio ? ours.gbps / fio.gbps : null;
          rows.push({
            ...pt,
            ours,
            fio,
            ratio,
            fioCommand: `fio ${fioArgs(path, fileBytes, pt).join(" ")}`,
          });
          console.log(
            `${pt.op.padEnd(5)} bs ${String(pt.blockBytes / 1024).padStart(5)}K qd ${
              String(pt.qd).padStart(2)
            } ` +
              `${pt.direct ? "direct  " : "buffered"} | ours ${ours.gbps.toFixed(2)} GB/s ${
                ours.iops.toFixed(0).padStart(6)
              } IOPS ` +
              `p50 ${ours.p50us.toFixed(0)}us p99 ${ours.p99us.toFixed(0)}us | fio ${
                fio ? fio.gbps.toFixed(2) : "-"
              } GB/s ` +
              `p50 ${fio ? fio.p50us.toFixed(0) : "-"}us p99 ${
                fio ? fio.p99us.toFixed(0) : "-"
              }us | ratio ${ratio ? (ratio * 100).toFixed(0) + "%" : "-"}`,
          );
        }
      } finally {
        await ring.shutdown();
        ring.destroy();
        pool.close();
        await Deno.remove(path).catch(() => {});
      }
    }

    // ---- 1.31 GB prefix: tier write-behind, then prefetch into the pool -------
    if (fsSpace(dir).availableBytes > 3 * prefixBytes) {
      const pool = engine.createPool(prefixBytes);
      const ring = new CompletionRing(1 << 16);
      const tierDir = `${dir}/tier`;
      await Deno.mkdir(tierDir, { recursive: true });
      try {
        const tier = await SsdTier.open({
          pool: pool.handle,
          ring,
          paths: [tierDir],
          capacityBytes: prefixBytes + 256 * MiB,
          reset: true,
          maxPrefetchBlocks: prefixBlocks,
          writeQueueDepth: 4,
          log: new Logger("error", {}, () => {}),
        });
        const view = pool.view(0, prefixBytes);
        for (let off = 0; off < prefixBytes; off += MiB) view[off] = (off / MiB) & 0xff;
        const keys = Array.from({ length: prefixBlocks }, (_, i) => `bench/llama-8b/${i}`);
        const tw = performance.now();
        const slot = new Map(keys.map((k, i) => [k, i]));
        tier.enqueueWrite({
          blocks: keys.map((key) => ({ key, namespace: "bench", layout: BENCH_LAYOUT })),
          pin: (fresh) => ({
            extents: fresh.map((b) => [
              { offset: slot.get(b.key)! * LLAMA_BLOCK_BYTES, bytes: LLAMA_BLOCK_BYTES },
            ]),
            release: () => {},
          }),
        });
        await tier.flushWrites();
        const writeSecs = (performance.now() - tw) / 1000;
        view.fill(0, 0, Math.min(prefixBytes, 64 * MiB));
        let at = 0;
        let committed = 0;
        const alloc = (wanted: readonly PrefetchWant[]) =>
          wanted.map(({ payloadBytes: n }) => {
            const off = at;
            at += n;
            return {
              extents: [{ offset: off, bytes: n }],
              free: () => {},
              commit: () => committed++,
            };
          });
        const file = tier.files[0].path;
        // Alternate tier reads and fio reads of the same file; report medians.
        const reads: number[] = [], fios: number[] = [];
        let served = 0;
        for (let r = 0; r < repeat; r++) {
          at = 0;
          committed = 0;
          const tr = performance.now();
          tier.prefetch(`bench-${r}`, keys, alloc, FP);
          await tier.prefetchSettled(`bench-${r}`);
          reads.push((performance.now() - tr) / 1000);
          const got = tier.prefetch(`bench-${r}`, keys, alloc, FP);
          served = got.state === "ready" ? committed : 0;
          // The disk's own rate on the same file: fio, 2 MiB sequential reads, QD 32, O_DIRECT.
          const f = await runFio(file, prefixBytes, {
            op: "read",
            blockBytes: 2 * MiB,
            qd: 32,
            direct: true,
          });
          if (f) fios.push(f.gbps);
        }
        const readSecs = [...reads].sort((a, b) => a - b)[Math.floor(reads.length / 2)];
        const fio = fios.length
          ? { gbps: [...fios].sort((a, b) => a - b)[Math.floor(fios.length / 2)] }
          : null;
        const s = tier.stats();
        await tier.close();
        Object.assign(prefix, {
          writeSecs,
          writeGBps: prefixBytes / writeSecs / 1e9,
          readSecs,
          readSecsRuns: reads,
          fioReadGBpsRuns: fios,
          readGBps: prefixBytes / readSecs / 1e9,
          servedBlocks: served,
          checksumFailures: s.checksumFailures,
          fioReadGBps: fio?.gbps ?? null,
          ratioToFio: fio ? prefixBytes / readSecs / 1e9 / fio.gbps : null,
        });
        console.log(
          `1.31 GB prefix (${prefixBlocks} × ${LLAMA_BLOCK_BYTES} B): write-behind ${
            (prefixBytes / writeSecs / 1e9).toFixed(2)
          } GB/s, ` +
            `prefetch into pool ${(readSecs * 1000).toFixed(0)} ms = ${
              (prefixBytes / readSecs / 1e9).toFixed(2)
            } GB/s ` +
            `(${served} blocks verified), fio seq read on the same file ${
              fio ? fio.gbps.toFixed(2) : "-"
            } GB/s`,
        );
      } finally {
        await ring.shutdown();
        ring.destroy();
        pool.close();
        await Deno.remove(tierDir, { recursive: true }).catch(() => {});
      }
    } else {
      prefix.skipped = `less than ${3 * prefixBytes} bytes free at ${dir}`;
      console.log(`1.31 GB prefix skipped: ${prefix.skipped}`);
    }
  } finally {
    engine.close();
  }
} finally {
  if (!Deno.env.get("SSD_BENCH_DIR")) await Deno.remove(dir, { recursive: true }).catch(() => {});
}

const out = {
  when: new Date().toISOString(),
  command: "deno task bench:ssd",
  fileBytesPerPoint: fileBytes,
  repeatPerPoint: repeat,
  disk,
  notes: [
    "each point: median of the runs (ours and fio alternate on the same file, and which goes first alternates)",
    "throughput: the whole file in one batch, the engine keeping qd ops in flight (fio: --iodepth=qd)",
    "latency (ours): submit to completion record in JS, rounds of qd ops; fio: clat percentiles",
  ],
  points: rows,
  prefix,
};
const outFile = `${root}${quick ? "tmp/ssd-quick.json" : "ssd.json"}`;
await Deno.writeTextFile(outFile, JSON.stringify(out, null, 2) + "\n");
console.log(`wrote ${outFile}`);
