/**
 * Shared pieces of the SSD benchmarks: a sequential read or write of a file
 * through the io_uring engine at a given block size and queue depth, and the
 * same run through fio for comparison.
 *
 * Two measurements per point, as fio makes them:
 *  - throughput: the whole file as one batch; the engine keeps `qd` ops in
 *    the kernel and refills from the reaper thread (no JS per op);
 *  - latency: rounds of `qd` ops submitted together; each op's latency is
 *    the time from the submit to its completion record reaching JS.
 *
 * @module
 */

import { filter, firstValueFrom, type Subscription, take } from "rxjs";
import type { Completion } from "../ffi/ring.ts";
import { DONE_IO, DONE_IO_BATCH, FileFlag, Uring } from "../ffi/uring.ts";
import { IoBatch } from "../lib/ssd/io.ts";

/** One point of the sweep. */
export interface Point {
  op: "read" | "write";
  blockBytes: number;
  qd: number;
  direct: boolean;
}

/** What one engine (ours or fio) measured at a point. */
export interface Measured {
  gbps: number;
  iops: number;
  p50us: number;
  p99us: number;
}

const TAG_BASE = 2 ** 49;
let nextTag = 1;

/** Percentile of sorted values. */
export function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return 0;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

/** Runs one point on our engine. `poolBytes` ≥ qd × block size. */
export async function runOurs(
  pool: number,
  poolBytes: number,
  ring: { handle: number; completions$: import("rxjs").Observable<Completion> },
  path: string,
  fileBytes: number,
  pt: Point,
  latencyRounds: number,
): Promise<Measured> {
  const depth = 2 ** Math.ceil(Math.log2(pt.qd));
  const u = Uring.open(pool, ring.handle, depth, 0);
  const f = u.openFile(path, FileFlag.CREATE | (pt.direct ? FileFlag.DIRECT : 0));
  const arrivals: number[] = [];
  let sub: Subscription | undefined;
  try {
    const n = Math.floor(fileBytes / pt.blockBytes);
    const slots = Math.floor(poolBytes / pt.blockBytes);
    const make = (first: number, count: number) => {
      const b = new IoBatch();
      for (let i = first; i < first + count; i++) {
        const ext = [{ offset: (i % slots) * pt.blockBytes, bytes: pt.blockBytes }];
        if (pt.op === "write") b.write(f, i * pt.blockBytes, false, ext);
        else b.read(f, i * pt.blockBytes, false, ext, false);
      }
      return b.encode(null);
    };
    const run = async (desc: Uint8Array, perOp: boolean): Promise<number> => {
      const tag = TAG_BASE + nextTag++;
      const done = firstValueFrom(
        ring.completions$.pipe(filter((c) => c.tag === tag && c.kind === DONE_IO_BATCH), take(1)),
      );
      if (perOp) {
        sub = ring.completions$.pipe(filter((c) => c.tag === tag && c.kind === DONE_IO))
          .subscribe(() => arrivals.push(performance.now()));
      }
      const t0 = performance.now();
      u.submit(desc, BigInt(tag));
      const c = await done;
      sub?.unsubscribe();
      sub = undefined;
      if (c.status !== 0) throw new Error(`${pt.op} batch on ${path}: ${c.aux} ops failed`);
      return t0;
    };
    // As fio's --invalidate=1: start from an empty page cache for this file.
    u.dropCache(f);
    const desc = make(0, n);
    const t0 = performance.now();
    await run(desc, false);
    const secs = (performance.now() - t0) / 1000;
    // Latency rounds.
    const lat: number[] = [];
    const rounds = Math.min(latencyRounds, Math.floor(n / pt.qd));
    if (pt.op === "read" && !pt.direct) u.dropCache(f);
    for (let r = 0; r < rounds; r++) {
      arrivals.length = 0;
      const t = await run(make(r * pt.qd, pt.qd), true);
      for (const a of arrivals) lat.push((a - t) * 1000);
    }
    lat.sort((a, b) => a - b);
    return {
      gbps: (n * pt.blockBytes) / secs / 1e9,
      iops: n / secs,
      p50us: percentile(lat, 50),
      p99us: percentile(lat, 99),
    };
  } finally {
    sub?.unsubscribe();
    u.closeFile(f);
    await u.close();
  }
}

/** The fio command line for a point (printed into the results). */
export function fioArgs(path: string, fileBytes: number, pt: Point): string[] {
  return [
    "--name=pf",
    `--filename=${path}`,
    `--rw=${pt.op}`,
    `--bs=${pt.blockBytes}`,
    `--iodepth=${pt.qd}`,
    "--ioengine=io_uring",
    "--fixedbufs",
    "--registerfiles",
    `--direct=${pt.direct ? 1 : 0}`,
    `--size=${fileBytes}`,
    "--invalidate=1",
    "--output-format=json",
  ];
}

/** Runs fio on the same file and parameters; null where fio is not installed. */
export async function runFio(path: string, fileBytes: number, pt: Point): Promise<Measured | null> {
  let out: Deno.CommandOutput;
  try {
    out = await new Deno.Command("fio", {
      args: fioArgs(path, fileBytes, pt),
      stdout: "piped",
      stderr: "piped",
    })
      .output();
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return null;
    throw e;
  }
  if (out.code !== 0) throw new Error(`fio failed: ${new TextDecoder().decode(out.stderr)}`);
  const text = new TextDecoder().decode(out.stdout);
  const job = JSON.parse(text.slice(text.indexOf("{"))).jobs[0][pt.op];
  const pct = job.clat_ns?.percentile ?? {};
  return {
    gbps: job.bw_bytes / 1e9,
    iops: job.iops,
    p50us: (pct["50.000000"] ?? 0) / 1000,
    p99us: (pct["99.000000"] ?? 0) / 1000,
  };
}
