/**
 * Registration's geometry check is what makes every later copy safe: a
 * geometry it accepts must address only bytes inside the region, with no
 * two (block, segment) ranges overlapping. Checked by brute force over
 * random small geometries (fast-check).
 */
import assert from "node:assert/strict";
import fc from "fast-check";
import { type Geometry, validateGeometry } from "../../lib/engine/geometry.ts";

function ranges(g: Geometry): [number, number][] {
  const out: [number, number][] = [];
  for (let b = 0; b < g.numBlocks; b++) {
    for (let s = 0; s < g.numSegments; s++) {
      const start = g.baseOffset + b * g.blockStride + s * g.segStride;
      out.push([start, start + g.segBytes]);
    }
  }
  return out.sort((x, y) => x[0] - y[0]);
}

const geometry = fc.record({
  numBlocks: fc.integer({ min: 0, max: 12 }),
  blockStride: fc.integer({ min: 0, max: 64 }),
  segStride: fc.integer({ min: 0, max: 400 }),
  segBytes: fc.integer({ min: 0, max: 48 }),
  numSegments: fc.integer({ min: 0, max: 4 }),
  baseOffset: fc.integer({ min: 0, max: 32 }),
  regionBytes: fc.integer({ min: 0, max: 1200 }),
});

Deno.test("an accepted geometry stays inside its region and never overlaps itself", () => {
  fc.assert(
    fc.property(geometry, (g) => {
      let accepted = true;
      try {
        validateGeometry(g, "layer");
      } catch (e) {
        accepted = false;
        assert.match((e as Error).message, /^layer: /, "the error names where");
      }
      if (!accepted) return;
      const r = ranges(g);
      assert.ok(r.length > 0);
      for (const [start, end] of r) {
        assert.ok(
          start >= 0 && end <= g.regionBytes,
          `range [${start}, ${end}) inside ${g.regionBytes}`,
        );
      }
      for (let i = 1; i < r.length; i++) {
        assert.ok(r[i][0] >= r[i - 1][1], `ranges ${i - 1} and ${i} do not overlap`);
      }
    }),
    { numRuns: 5000 },
  );
});

Deno.test("the real layouts are accepted: K/V planes, K/V inside the block, MLA", () => {
  const kvPlanes = {
    numBlocks: 64,
    blockStride: 32768,
    segStride: 64 * 32768,
    segBytes: 32768,
    numSegments: 2,
    baseOffset: 0,
    regionBytes: 2 * 64 * 32768,
  };
  const kvInside = {
    numBlocks: 64,
    blockStride: 65536,
    segStride: 32768,
    segBytes: 32768,
    numSegments: 2,
    baseOffset: 0,
    regionBytes: 64 * 65536,
  };
  const mla = {
    numBlocks: 64,
    blockStride: 36864,
    segStride: 0,
    segBytes: 36864,
    numSegments: 1,
    baseOffset: 0,
    regionBytes: 64 * 36864,
  };
  for (const g of [kvPlanes, kvInside, mla]) validateGeometry(g, "layer");
  assert.throws(
    () => validateGeometry({ ...kvPlanes, regionBytes: kvPlanes.regionBytes - 1 }, "layer 3"),
    /layer 3: geometry reaches byte/,
  );
  assert.throws(
    () => validateGeometry({ ...kvInside, segStride: 16384 }, "layer 4"),
    /layer 4: segments overlap/,
  );
});
