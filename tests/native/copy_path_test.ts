/** The path policy prefers SM-free DMA where it reaches the link rate. */
import assert from "node:assert/strict";
import type { CalibrationTable } from "../../ffi/mod.ts";
import { PathPolicy } from "../../lib/copy_path.ts";

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

Deno.test("small segments take the fastest SM path, large ones the copy engines", () => {
  const p = new PathPolicy({ d2h: table });
  assert.equal(p.choose("d2h", 8 * KB), "kernel");
  assert.equal(p.choose("d2h", 32 * KB), "mixed");
  assert.equal(p.choose("d2h", 40 * KB), "mixed"); // nearest calibrated size: 32 KB
  assert.equal(p.choose("d2h", 128 * KB), "dma_batch");
  assert.equal(p.choose("d2h", 4096 * KB), "dma_batch");
});

Deno.test("loads (h2d) never take the mixed path: its first layer lands late", () => {
  const p = new PathPolicy({ h2d: { ...table, direction: "h2d" } });
  assert.equal(p.choose("h2d", 32 * KB), "kernel"); // mixed is faster there, but not layer-wise
  assert.equal(p.choose("h2d", 128 * KB), "dma_batch");
});

Deno.test("a forced path wins; no table means auto", () => {
  assert.equal(new PathPolicy({ d2h: table }, { force: "dma" }).choose("d2h", 8 * KB), "dma");
  assert.equal(new PathPolicy({}).choose("h2d", 32 * KB), "auto");
  assert.equal(new PathPolicy({ d2h: table }).choose("h2d", 32 * KB), "auto");
});

Deno.test("below the tolerance the fastest path wins, DMA included", () => {
  const p = new PathPolicy({ d2h: table }, { dmaTolerance: 0.995 });
  assert.equal(p.choose("d2h", 2048 * KB), "mixed"); // 53.8 beats dma_batch's 53.4
  assert.equal(p.choose("d2h", 128 * KB), "dma_batch"); // still the fastest there
});
