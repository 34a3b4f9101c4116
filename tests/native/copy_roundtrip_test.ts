/**
 * Byte-exact gather (region → pool) then scatter (pool → different blocks
 * of a second region) on the host backend, for every layout kind, random
 * and sorted block ids, and random geometries (fast-check).
 */
import fc from "fast-check";
import { CopyEngine, loadLibrary } from "../../ffi/mod.ts";
import {
  allocRegions,
  fillRegions,
  type LayoutKind,
  makeGeometry,
  pickBlocks,
  poolBytesFor,
  runRoundTrip,
} from "./kv_layout.ts";
import { mulberry32 as rng } from "../_seeded.ts";

loadLibrary(); // dlopen once, outside any test's resource accounting

const POOL_BYTES = 32 << 20;

async function roundTrip(
  ce: CopyEngine,
  kind: LayoutKind,
  numBlocks: number,
  numLayers: number,
  segBytes: number,
  n: number,
  sorted: boolean,
  seed: number,
  numSegsCross = 2,
): Promise<void> {
  const g = makeGeometry(kind, numBlocks, numLayers, segBytes, numSegsCross);
  if (poolBytesFor(g, n) > POOL_BYTES) throw new Error("test geometry exceeds the pool");
  const src = allocRegions(ce.engine, g);
  const dst = allocRegions(ce.engine, g);
  try {
    fillRegions(g, src);
    const rand = rng(seed);
    const srcBlocks = pickBlocks(rand, numBlocks, n, sorted);
    // Destination ids are a different draw, so blocks land elsewhere.
    const dstBlocks = pickBlocks(rand, numBlocks, n, sorted);
    await runRoundTrip(ce, g, src, dst, srcBlocks, dstBlocks);
  } finally {
    for (const r of [...src, ...dst]) r.close();
  }
}

const cases: Array<[LayoutKind, number, number, number, number, boolean, number?]> = [
  ["kv_split", 64, 4, 4096, 40, false],
  ["kv_split", 64, 4, 4096, 40, true],
  ["kv_interleaved", 32, 3, 2048, 32, true], // all blocks, sorted: K/V merge into long ranges
  ["mla", 128, 5, 576, 100, false],
  ["mla", 128, 5, 576, 128, true],
  ["cross_layer", 48, 6, 1024, 20, false, 2],
  ["cross_layer", 48, 6, 1536, 48, true, 1],
  ["kv_split", 8, 2, 1 << 20, 6, false], // segments larger than a host task
];

for (const [kind, blocks, layers, seg, n, sorted, segsCross] of cases) {
  Deno.test(
    `gather then scatter is byte-exact: ${kind}, ${blocks} blocks x ${layers} layers, ` +
      `${seg} B segments, ${n} ${sorted ? "sorted" : "random"} ids`,
    async () => {
      const ce = CopyEngine.open({ backend: "host", poolBytes: POOL_BYTES, workers: 2 });
      try {
        await roundTrip(ce, kind, blocks, layers, seg, n, sorted, blocks * 31 + n, segsCross);
      } finally {
        await ce.close();
      }
    },
  );
}

Deno.test("random geometries round-trip byte-exact (property)", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: POOL_BYTES, workers: 3 });
  try {
    await fc.assert(
      fc.asyncProperty(
        fc.constantFrom<LayoutKind>("kv_split", "kv_interleaved", "mla", "cross_layer"),
        fc.integer({ min: 1, max: 48 }), // blocks
        fc.integer({ min: 1, max: 5 }), // layers
        fc.constantFrom(1, 7, 16, 100, 512, 4096, 12288), // segment bytes, odd ones too
        fc.boolean(),
        fc.integer({ min: 0, max: 1 << 30 }),
        fc.integer({ min: 1, max: 2 }),
        async (kind, blocks, layers, seg, sorted, seed, segsCross) => {
          const n = 1 + (seed % blocks);
          await roundTrip(ce, kind, blocks, layers, seg, n, sorted, seed, segsCross);
        },
      ),
      { numRuns: 40, seed: 20261122 },
    );
  } finally {
    await ce.close();
  }
});
