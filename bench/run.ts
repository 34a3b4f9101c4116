/**
 * `deno task bench`: native copy microbenchmarks. D2H and H2D over segment
 * size (8 KB .. 2 MB) and path, layer count, block (segment) count, kernel
 * grid, huge pages on/off; each row prints GB/s and per-batch p50/p99 beside
 * the one-large-copy peak measured in the same run, and the ratio. Also
 * times the JS + FFI work to fill and submit a 40,000-segment batch.
 * Writes JSON under bench/results/. Host backend: a small, fast smoke run.
 *
 *   deno task bench                      # auto backend
 *   deno task bench --backend host       # CI smoke
 *   deno task bench --backend cuda --full
 */
import { Command } from "commander";
import { CopyBatch, CopyEngine, type CopyPath, type Direction, type Region } from "../ffi/mod.ts";
import { fillStrided, pct, type Row, table, timeBatch } from "./native_copy.ts";
import { PathPolicy } from "../lib/copy_path.ts";
import { measureCalibration } from "../lib/copy_calibration.ts";
import { strictCommand } from "./cli.ts";

const KB = 1024;
const MB = 1024 * KB;
/** 32 layers x K/V x 625 blocks: a 10K-token Llama-3.1-8B prefix. */
const LLAMA_SEGMENTS = 40_000;
const LLAMA_SEG = 32 * KB;

const program = strictCommand(
  new Command()
    .name("bench")
    .option("--backend <name>", "auto | cuda | host", "auto")
    .option("--device <n>", "CUDA device", "0")
    .option("--full", "full sweep even on the host backend", false)
    .option("--iters <n>", "timed batches per row (default 10 cuda, 3 host)")
    .option("--out <dir>", "where to write the JSON", "bench/results")
    .option(
      "--only <sections>",
      "comma-separated subset: size,layers,count,grid,variant,mixed,lanes,dmacheck,submit,calibrate,huge",
    ),
  "a table on stdout and <--out>/native-<backend>-<date>.json",
).parse(["deno", "run", ...Deno.args]);
const opts = program.opts<
  {
    backend: "auto" | "cuda" | "host";
    device: string;
    full: boolean;
    iters?: string;
    out: string;
    only?: string;
  }
>();
const only = opts.only ? new Set(opts.only.split(",")) : undefined;
/** Whether section `name` runs. */
const want = (name: string) => !only || only.has(name);

const probe = CopyEngine.open({
  backend: opts.backend,
  device: Number(opts.device),
  poolBytes: 1 * MB,
});
const backend = probe.engine.backend;
const smCount = probe.engine.smCount;
const features = probe.engine.features;
await probe.close();

const gpu = backend === "cuda";
const small = !gpu && !opts.full;
const iters = Number(opts.iters ?? (gpu ? 10 : 3));
const warm = gpu ? 2 : 1;
/** Bytes per batch: the Llama prefix on a GPU; small on the host. */
const TOTAL = gpu ? LLAMA_SEGMENTS * LLAMA_SEG : small ? 32 * MB : 256 * MB;
const SIZES = small
  ? [8 * KB, 32 * KB, 512 * KB, 2 * MB]
  : [8, 16, 32, 64, 128, 256, 512, 1024, 2048].map((k) => k * KB);
const PATHS: CopyPath[] = gpu
  ? (["kernel", "mixed", "dma_batch", "dma"] as CopyPath[]).filter((p) =>
    p !== "dma_batch" || features.dmaBatch
  )
  : ["dma"];
const DIRS: Direction[] = ["d2h", "h2d"];

interface Setup {
  ce: CopyEngine;
  region: Region;
  hugepages: boolean;
  peak: Record<Direction, number>;
}

async function setup(hugepages: boolean): Promise<Setup> {
  const ce = CopyEngine.open({
    backend,
    device: Number(opts.device),
    poolBytes: TOTAL,
    hugepages,
    pretouch: true,
  });
  const region = ce.engine.allocRegion(2 * TOTAL);
  const peak = { d2h: 0, h2d: 0 } as Record<Direction, number>;
  const one = new CopyBatch(1, 1);
  for (const dir of DIRS) {
    // The link's practical limit: one contiguous copy of TOTAL bytes.
    one.reset(dir, gpu ? "dma" : "host").group(region, 0).seg(0, 0, TOTAL);
    // Best of the timed copies: the rows below are medians, so their ratio
    // to the peak is conservative.
    const t = await timeBatch(ce, one, warm, iters);
    peak[dir] = TOTAL / t.minNs;
  }
  return { ce, region, hugepages, peak };
}

async function teardown(s: Setup): Promise<void> {
  s.region.close();
  await s.ce.close();
}

async function row(
  s: Setup,
  dir: Direction,
  path: CopyPath,
  segBytes: number,
  segments: number,
  layers: number,
  batch: CopyBatch,
  grid?: number,
): Promise<Row> {
  fillStrided(batch, s.region, dir, path, segBytes, segments, layers);
  const t = await timeBatch(s.ce, batch, warm, iters);
  const gbps = t.bytes / t.libNs;
  return {
    direction: dir,
    path: t.path,
    segBytes,
    segments,
    layers,
    bytes: t.bytes,
    gbps,
    wallGbps: t.bytes / (pct(t.wall, 0.5) * 1e6),
    p50Ms: pct(t.wall, 0.5),
    p99Ms: pct(t.wall, 0.99),
    firstLayerMs: pct(t.first, 0.5),
    peakGbps: s.peak[dir],
    ratio: gbps / s.peak[dir],
    hugepages: s.hugepages,
    grid,
  };
}

const rows: Row[] = [];
const sections: Record<string, Row[]> = {};
function add(section: string, r: Row): void {
  rows.push(r);
  (sections[section] ??= []).push(r);
}

const maxSegs = Math.max(LLAMA_SEGMENTS * 2, TOTAL / (8 * KB));
const batch = new CopyBatch(128, maxSegs);
const base = await setup(false);
console.log(
  `backend ${backend}${
    gpu ? ` (${smCount} SMs, kernel grid ${base.ce.engine.kernelGrid})` : ""
  }; ` +
    `peak D2H ${base.peak.d2h.toFixed(1)} GB/s, H2D ${base.peak.h2d.toFixed(1)} GB/s`,
);

// 1. Segment size x path x direction (32 layers; at most TOTAL bytes, at most 40k segments).
for (const dir of want("size") ? DIRS : []) {
  for (const path of PATHS) {
    for (const seg of SIZES) {
      const segments = Math.max(1, Math.min(LLAMA_SEGMENTS, Math.floor(TOTAL / seg)));
      add(
        "segment size",
        await row(
          base,
          dir,
          path,
          seg,
          segments,
          32,
          batch,
          gpu ? base.ce.engine.kernelGrid : undefined,
        ),
      );
    }
  }
}

// 2. Layer count at 32 KB (same bytes, more or fewer completions).
const seg32 = gpu ? LLAMA_SEG : 32 * KB;
const segs32 = Math.floor(TOTAL / seg32);
const mainPath: CopyPath = gpu ? "kernel" : "dma";
for (const dir of want("layers") ? DIRS : []) {
  for (const layers of small ? [1, 32] : [1, 8, 32, 128]) {
    add("layer count", await row(base, dir, mainPath, seg32, segs32, layers, batch));
  }
}

// 3. Block (segment) count at 32 KB.
for (const dir of want("count") ? DIRS : []) {
  for (const n of small ? [1000, segs32] : [2000, 10_000, LLAMA_SEGMENTS]) {
    add("segment count", await row(base, dir, mainPath, seg32, Math.min(n, segs32), 32, batch));
  }
}

// 4. Kernel grid (cuda): the smallest grid that reaches the link rate.
if (gpu && features.kernel && want("grid")) {
  const def = base.ce.engine.kernelGrid;
  for (const grid of [4, 8, 16, 24, 32, 48, 64, smCount]) {
    base.ce.engine.setKernelGrid(grid);
    for (const dir of DIRS) {
      add("kernel grid", await row(base, dir, "kernel", seg32, segs32, 32, batch, grid));
    }
  }
  base.ce.engine.setKernelGrid(0);
  console.log(`kernel grid restored to ${def}`);
}

// 5. JS + FFI cost of filling and submitting a 40,000-segment batch.
const submitCost: undefined | {
  path: CopyPath;
  segments: number;
  fillP50Ms: number;
  fillP99Ms: number;
  submitP50Ms: number;
  submitP99Ms: number;
  totalP50Ms: number;
} = !want("submit") ? undefined : await submitCostOf(mainPath);
const submitByPath: Record<string, unknown> = {};
if (gpu && want("submit")) {
  for (const p of ["mixed", "dma_batch", "dma", "kernel"] as CopyPath[]) {
    if (p === "dma_batch" && !features.dmaBatch) continue;
    submitByPath[p] = await submitCostOf(p);
  }
}

async function submitCostOf(path: CopyPath) {
  const n = LLAMA_SEGMENTS;
  const seg = Math.min(LLAMA_SEG, Math.floor(TOTAL / n / 16) * 16 || 16);
  const big = new CopyBatch(32, n);
  const fill: number[] = [], submit: number[] = [], total: number[] = [];
  for (let i = 0; i < (gpu ? 30 : 20); i++) {
    const t0 = performance.now();
    fillStrided(big, base.region, "d2h", path, seg, n, 32);
    const t1 = performance.now();
    const s = base.ce.submit(big);
    const t2 = performance.now();
    await s.done;
    if (i >= 3) {
      fill.push(t1 - t0);
      submit.push(t2 - t1);
      total.push(t2 - t0);
    }
  }
  for (const a of [fill, submit, total]) a.sort((x, y) => x - y);
  return {
    path,
    segments: n,
    fillP50Ms: pct(fill, 0.5),
    fillP99Ms: pct(fill, 0.99),
    submitP50Ms: pct(submit, 0.5),
    submitP99Ms: pct(submit, 0.99),
    totalP50Ms: pct(total, 0.5),
  };
}
await teardown(base);

// 6. Kernel variants (cuda): SIMT loads/stores vs the Hopper bulk-copy engine.
if (gpu && features.kernel && want("variant")) {
  for (const variant of ["simt", "tma"]) {
    Deno.env.set("PEGAFLOW_KERNEL", variant);
    const v = await setup(false);
    const got = v.ce.engine.kernelVariant;
    for (const grid of [8, 16, 32, 64, smCount]) {
      v.ce.engine.setKernelGrid(grid);
      for (const dir of DIRS) {
        const r = await row(v, dir, "kernel", seg32, segs32, 32, batch, grid);
        r.note = `variant ${got}`;
        add(`kernel variant ${got}`, r);
      }
    }
    v.ce.engine.setKernelGrid(0);
    for (const seg of [8 * KB, 512 * KB, 2 * MB]) {
      for (const dir of DIRS) {
        const r = await row(
          v,
          dir,
          "kernel",
          seg,
          Math.min(LLAMA_SEGMENTS, Math.floor(TOTAL / seg)),
          32,
          batch,
          v.ce.engine.kernelGrid,
        );
        r.note = `variant ${got}`;
        add(`kernel variant ${got}`, r);
      }
    }
    await teardown(v);
  }
  Deno.env.delete("PEGAFLOW_KERNEL");
}

// 7. Mixed path (cuda): kernel and copy engines on one batch, by DMA share.
if (gpu && features.kernel && want("mixed")) {
  const m = await setup(false);
  for (const share of [350, 450, 550, 650, 750]) {
    m.ce.engine.setDmaShare(share);
    for (const dir of DIRS) {
      const r = await row(m, dir, "mixed", seg32, segs32, 32, batch, m.ce.engine.kernelGrid);
      r.note = `dma share ${share}`;
      add("mixed path (dma share)", r);
    }
  }
  m.ce.engine.setDmaShare(0);
  for (const seg of [8 * KB, 16 * KB, 64 * KB, 512 * KB, 2 * MB]) {
    for (const dir of DIRS) {
      add(
        "mixed path (default share)",
        await row(
          m,
          dir,
          "mixed",
          seg,
          Math.min(LLAMA_SEGMENTS, Math.floor(TOTAL / seg)),
          32,
          batch,
          m.ce.engine.kernelGrid,
        ),
      );
    }
  }
  await teardown(m);
}

// 7a. DMA lanes (cuda): threads issuing copy-engine descriptors in parallel.
if (gpu && want("lanes")) {
  for (const lanes of [1, 2, 4, 8]) {
    Deno.env.set("PEGAFLOW_DMA_LANES", String(lanes));
    const v = await setup(false);
    for (const path of PATHS.filter((p) => p !== "kernel")) {
      for (const dir of DIRS) {
        const r = await row(v, dir, path, seg32, segs32, 32, batch);
        r.note = `lanes ${lanes}`;
        add(`dma lanes ${lanes}`, r);
      }
    }
    await teardown(v);
  }
  Deno.env.delete("PEGAFLOW_DMA_LANES");
}

// 7b. Why calibration and rows may disagree for dma_batch at 32 KB: rows
// before and after a calibration of the same size, same engine.
if (gpu && want("dmacheck")) {
  const c = await setup(false);
  for (const phase of ["before", "after"]) {
    if (phase === "after") {
      const t = c.ce.engine.calibrate(c.ce.pool, "d2h", [seg32], TOTAL);
      console.log(
        `calibrate d2h 32K: dma_batch ${t.gbps.dma_batch[0].toFixed(1)} kernel ${
          t.gbps.kernel[0].toFixed(1)
        }`,
      );
    }
    for (const dir of DIRS) {
      const r = await row(c, dir, "dma_batch", seg32, segs32, 32, batch);
      r.note = `dmacheck ${phase}`;
      add(`dma_batch 32K ${phase} calibration`, r);
      const r1 = await row(c, dir, "dma_batch", seg32, segs32, 1, batch);
      r1.note = `dmacheck ${phase} 1 group`;
      add(`dma_batch 32K ${phase} calibration`, r1);
    }
  }
  await teardown(c);
}

// 8. Calibration (what the path policy sees) and the policy's choices.
let calibration: unknown;
if (gpu && want("calibrate")) {
  const c = await setup(false);
  const policy = new PathPolicy(measureCalibration(c.ce.engine, c.ce.pool, TOTAL));
  const choices: Record<string, Record<string, CopyPath>> = {};
  for (const dir of DIRS) {
    choices[dir] = {};
    for (const seg of SIZES) choices[dir][String(seg)] = policy.choose(dir, seg);
  }
  calibration = { tables: policy.tables, choices };
  console.log(
    `\n## calibration (pf_calibrate, best of 3, ${(TOTAL / 1e6).toFixed(0)} MB per point)`,
  );
  for (const dir of DIRS) {
    const t = policy.tables[dir]!;
    console.log(`${dir}: peak ${t.peak.toFixed(1)} GB/s`);
    console.log(["seg", "kernel", "mixed", "dma_batch", "dma", "policy"].join("\t"));
    t.sizes.forEach((sz, i) =>
      console.log(
        [
          `${sz >> 10}K`,
          t.gbps.kernel[i].toFixed(1),
          t.gbps.mixed[i].toFixed(1),
          t.gbps.dma_batch[i].toFixed(1),
          t.gbps.dma[i].toFixed(1),
          policy.choose(dir, sz),
        ].join("\t"),
      )
    );
  }
  await teardown(c);
}

// 9. Huge pages on (if the machine has them reserved).
let hugeNote = "";
if (want("huge")) {
  try {
    const huge = await setup(true);
    console.log(
      `huge pages: peak D2H ${huge.peak.d2h.toFixed(1)} GB/s, H2D ${huge.peak.h2d.toFixed(1)} GB/s`,
    );
    for (const dir of DIRS) {
      for (
        const [path, seg] of [[mainPath, seg32], [gpu ? "dma" : "dma", 2 * MB]] as Array<
          [CopyPath, number]
        >
      ) {
        add(
          "huge pages",
          await row(
            huge,
            dir,
            path,
            seg,
            Math.min(LLAMA_SEGMENTS, Math.floor(TOTAL / seg)),
            32,
            batch,
          ),
        );
      }
    }
    await teardown(huge);
  } catch (e) {
    hugeNote = e instanceof Error ? e.message : String(e);
    console.log(`huge pages: not measured: ${hugeNote}`);
  }
}

for (const [name, rs] of Object.entries(sections)) {
  console.log(`\n## ${name}\n${table(rs)}`);
}
if (submitCost) {
  console.log(
    `\n## submit cost (${submitCost.segments} segments, JS fill + FFI submit)\n` +
      `fill p50 ${submitCost.fillP50Ms.toFixed(3)} ms (p99 ${submitCost.fillP99Ms.toFixed(3)}), ` +
      `submit p50 ${submitCost.submitP50Ms.toFixed(3)} ms (p99 ${
        submitCost.submitP99Ms.toFixed(3)
      }), ` +
      `total p50 ${submitCost.totalP50Ms.toFixed(3)} ms (path ${submitCost.path})`,
  );
}
for (const [p, c] of Object.entries(submitByPath)) {
  console.log(`submit cost, path ${p}: ${JSON.stringify(c)}`);
}

const stamp = new Date().toISOString().replace(/[:.]/g, "-");
await Deno.mkdir(opts.out, { recursive: true });
const file = `${opts.out}/native-${backend}-${stamp}.json`;
await Deno.writeTextFile(
  file,
  JSON.stringify(
    {
      bench: "native copy",
      backend,
      smCount,
      features,
      totalBytes: TOTAL,
      iters,
      command: `deno task bench ${Deno.args.join(" ")}`.trim(),
      date: new Date().toISOString(),
      hugepagesNote: hugeNote || undefined,
      submitCost,
      submitByPath,
      calibration,
      sections,
    },
    null,
    1,
  ),
);
console.log(`\nwrote ${file}`);
