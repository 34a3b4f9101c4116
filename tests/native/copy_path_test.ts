/** The path policy prefers SM-free DMA where it comes close to the fastest path. */
import assert from "node:assert/strict";
import type { CalibrationTable } from "../../ffi/mod.ts";
import { FALLBACK_PATH, forcedPath, PathPolicy } from "../../lib/copy_path.ts";

const KB = 1024;
// Shaped like an H100 run (docs/native.md): kernel ~51, mixed ~53 at 32 KB;
// dma_batch reaches the link from 128 KB up.
const table: CalibrationTable = {
  direction: "d2h",
  sizes: [8 * KB, 32 * KB, 128 * KB, 2048 * KB],
  peak: 55,
  gbps: {
    kernel: [47, 51.5, 52, 51],
    dma_batch: [10, 39, 54.4, 53.4],
    dma: [3.5, 11.7, 26.6, 52.4],
    mixed: [25, 53.2, 53.5, 53.8],
  },
};

Deno.test("small segments take the fastest SM path, the rest the copy engines", () => {
  const p = new PathPolicy({ d2h: table });
  assert.equal(p.choose("d2h", 8 * KB), "kernel"); // DMA at 21 % of the kernel
  assert.equal(p.choose("d2h", 32 * KB), "dma_batch"); // 73 % of mixed: no SMs taken
  assert.equal(p.choose("d2h", 40 * KB), "dma_batch"); // nearest calibrated size: 32 KB
  assert.equal(p.choose("d2h", 128 * KB), "dma_batch");
  assert.equal(p.choose("d2h", 4096 * KB), "dma_batch");
});

Deno.test("saves keep DMA where a kernel copy is a few % faster: its SMs slow the steps it runs beside", () => {
  // An H100 start's d2h figures at 2 MB, where the kernel came out ahead.
  const d2h: CalibrationTable = {
    direction: "d2h",
    sizes: [2048 * KB],
    peak: 54.8,
    gbps: { kernel: [54.1], dma_batch: [51.2], dma: [50.9], mixed: [53.0] },
  };
  assert.equal(new PathPolicy({ d2h }).choose("d2h", 16384 * KB), "dma_batch");
});

Deno.test("loads (h2d) never take the mixed path: its first layer lands late", () => {
  const p = new PathPolicy({ h2d: { ...table, direction: "h2d" } }, { dmaTolerance: 0.95 });
  assert.equal(p.choose("h2d", 32 * KB), "kernel"); // mixed is faster there, but not layer-wise
  assert.equal(p.choose("h2d", 128 * KB), "dma_batch");
});

Deno.test("a forced path wins over the table", () => {
  assert.equal(new PathPolicy({ d2h: table }, { force: "dma" }).choose("d2h", 8 * KB), "dma");
  assert.equal(
    new PathPolicy({ d2h: table }, { force: "kernel" }).choose("d2h", 2048 * KB),
    "kernel",
  );
});

Deno.test("the host backend is always sent the host path, forced or not", () => {
  const host = new PathPolicy({ d2h: table }, { backend: "host", force: "kernel" });
  assert.equal(host.choose("d2h", 8 * KB), "host");
  assert.equal(host.choose("h2d", 2048 * KB), "host");
});

Deno.test("with no usable figure the policy names plain DMA, never nothing", () => {
  assert.equal(new PathPolicy({}).choose("h2d", 32 * KB), FALLBACK_PATH);
  assert.equal(new PathPolicy({ d2h: table }).choose("h2d", 32 * KB), FALLBACK_PATH);
  const dead: CalibrationTable = {
    ...table,
    gbps: { kernel: [0, 0, 0, 0], dma_batch: [0, 0, 0, 0], dma: [0, 0, 0, 0], mixed: [0, 0, 0, 0] },
  };
  assert.equal(new PathPolicy({ d2h: dead }).choose("d2h", 32 * KB), "dma");
  assert.equal(FALLBACK_PATH, "dma");
});

Deno.test("--transfer-path dma means batch DMA where the driver has it", () => {
  assert.equal(forcedPath("dma", { dmaBatch: true }), "dma_batch");
  assert.equal(forcedPath("dma", { dmaBatch: false }), "dma");
  assert.equal(forcedPath("kernel", { dmaBatch: true }), "kernel");
  assert.equal(forcedPath("auto", { dmaBatch: true }), undefined);
});

Deno.test("the summary names the choice at every calibrated size", () => {
  const p = new PathPolicy({ d2h: table, h2d: { ...table, direction: "h2d" } });
  assert.deepEqual(p.summary(), {
    d2h: "8K:kernel,32K:dma_batch,128K:dma_batch,2048K:dma_batch",
    h2d: "8K:kernel,32K:dma_batch,128K:dma_batch,2048K:dma_batch",
  });
});

Deno.test("below the tolerance the fastest path wins, DMA included", () => {
  const p = new PathPolicy({ d2h: table }, { dmaTolerance: 0.995 });
  assert.equal(p.choose("d2h", 2048 * KB), "mixed"); // 53.8 beats dma_batch's 53.4
  assert.equal(p.choose("d2h", 128 * KB), "dma_batch"); // still the fastest there
});

Deno.test("DMA wins even where no path reaches the link's peak, down to half the fastest path's rate", () => {
  // H100 figures (bench/results, native step): 32 KB saves and loads.
  const h100: CalibrationTable = {
    direction: "d2h",
    sizes: [32 * KB],
    peak: 54.8,
    gbps: { kernel: [51.1], dma_batch: [51.8], dma: [11.4], mixed: [52.2] },
  };
  const h2d: CalibrationTable = {
    direction: "h2d",
    sizes: [32 * KB],
    peak: 54.8,
    gbps: { kernel: [48.3], dma_batch: [33.2], dma: [11.0], mixed: [48.7] },
  };
  const p = new PathPolicy({ d2h: h100, h2d });
  assert.equal(p.choose("d2h", 32 * KB), "dma_batch"); // 99 % of mixed: no SMs taken
  // A load's kernel copy takes SMs from the forward it feeds: DMA at 69 % of the kernel wins.
  assert.equal(p.choose("h2d", 32 * KB), "dma_batch");
  assert.equal(new PathPolicy({ h2d }, { dmaTolerance: 0.8 }).choose("h2d", 32 * KB), "kernel");
});

Deno.test("a NaN or infinite figure is no throughput: it never wins, and all-unusable falls back to DMA", () => {
  const t = (kernel: number, dma_batch: number, dma: number, mixed: number): CalibrationTable => ({
    direction: "d2h",
    sizes: [32 * KB],
    peak: 55,
    gbps: { kernel: [kernel], dma_batch: [dma_batch], dma: [dma], mixed: [mixed] },
  });
  // A NaN kernel figure must not shadow the real ones behind it.
  assert.equal(new PathPolicy({ d2h: t(NaN, 10, 3, 50) }).choose("d2h", 32 * KB), "mixed");
  assert.equal(new PathPolicy({ d2h: t(NaN, 40, 3, 50) }).choose("d2h", 32 * KB), "dma_batch");
  assert.equal(new PathPolicy({ d2h: t(Infinity, 40, 3, 50) }).choose("d2h", 32 * KB), "dma_batch");
  assert.equal(
    new PathPolicy({ d2h: t(NaN, NaN, NaN, NaN) }).choose("d2h", 32 * KB),
    FALLBACK_PATH,
  );
  assert.equal(new PathPolicy({ d2h: t(0, 0, 0, 0) }).choose("d2h", 32 * KB), FALLBACK_PATH);
});
