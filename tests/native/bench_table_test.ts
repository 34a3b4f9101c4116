/**
 * The copy benchmark's table (bench/native_copy.ts): the header had no
 * column for the first-layer time, so every cell after "p99 ms" sat under
 * the next column's name ("peak" showed the first-layer ms, "huge" the ratio).
 */
import assert from "node:assert/strict";
import { table } from "../../bench/native_copy.ts";

Deno.test("the copy benchmark's table puts each figure under its own header", () => {
  const [head, row] = table([{
    direction: "h2d",
    path: "dma",
    segBytes: 32 << 10,
    segments: 100,
    layers: 4,
    bytes: 3_276_800,
    gbps: 51.2,
    wallGbps: 50.1,
    p50Ms: 0.11,
    p99Ms: 0.22,
    firstLayerMs: 0.33,
    peakGbps: 55.5,
    ratio: 0.92,
    hugepages: true,
    grid: 7,
  }]).split("\n").map((l) => l.split("\t"));
  assert.equal(head.length, row.length, `${head.length} headers for ${row.length} cells`);
  const cell = Object.fromEntries(head.map((h, i) => [h, row[i]]));
  assert.equal(cell["p99 ms"], "0.22");
  assert.equal(cell["first ms"], "0.33");
  assert.equal(cell["peak"], "55.5");
  assert.equal(cell["ratio"], "92%");
  assert.equal(cell["huge"], "y");
  assert.equal(cell["grid"], "7");
});
