/**
 * GPU suite: quiet batches on the cuda backend. A quiet batch without
 * progress words on the copy engines (a server's save) is issued whole —
 * one copy call per lane slice and one event per stream instead of one per
 * layer — and must still move every byte, on one lane and on several, in
 * both directions, post one record and release every region it touched. A
 * quiet batch with progress words still counts its groups one by one.
 */
import assert from "node:assert/strict";
import {
  type Completion,
  CopyBatch,
  CopyEngine,
  type GpuPath,
  PF_STATUS,
  type ProgressTarget,
  type Region,
} from "../../ffi/mod.ts";
import { noCuda } from "./_cuda.ts";
import { assertQuietProgress } from "../native/_quiet_progress.ts";
import { mulberry32 as rng } from "../_seeded.ts";

const SEG = 4096;
const GROUPS = 10;

/** A batch of `segs` 4 KiB segments in GROUPS groups, strided on the region side. */
function strided(
  b: CopyBatch,
  dir: "d2h" | "h2d",
  path: GpuPath,
  region: Region,
  segs: number,
  progress?: ProgressTarget,
): CopyBatch {
  b.reset(dir, path, progress);
  const per = Math.ceil(segs / GROUPS);
  for (let i = 0; i < segs; i++) {
    if (i % per === 0) b.group(region, 100 + i / per);
    b.seg(i * 2 * SEG, i * SEG, SEG);
  }
  return b;
}

Deno.test({
  name:
    "cuda: a quiet save is issued whole and moves every byte, on one lane and on several, both ways",
  ignore: noCuda !== undefined,
  fn: async () => {
    const ce = CopyEngine.open({ backend: "cuda", poolBytes: 32 << 20 });
    const src = ce.engine.allocRegion(32 << 20);
    const dst = ce.engine.allocRegion(32 << 20);
    const records: Completion[] = [];
    const sub = ce.ring.completions$.subscribe((c) => records.push(c));
    try {
      const paths: GpuPath[] = ce.engine.features.dmaBatch ? ["dma_batch", "dma"] : ["dma"];
      for (const path of paths) {
        // 40 segments: one lane; 1,100: three (a lane per 512 ranges).
        for (const segs of [40, 1100]) {
          const what = `${path}, ${segs} segments`;
          const r = rng(segs + path.length);
          const data = new Uint8Array(segs * 2 * SEG).map(() => r() * 256);
          src.write(0, data);
          ce.pool.view(0, segs * SEG).fill(0);
          const b = new CopyBatch(GROUPS, segs);
          const saved = await ce.submitQuiet(strided(b, "d2h", path, src, segs));
          assert.equal(saved.status, 0, `${what}: ${saved.error}`);
          assert.equal(saved.bytes, segs * SEG);
          assert.equal(saved.path, path);
          const pool = ce.pool.view(0, segs * SEG);
          for (let i = 0; i < segs; i++) {
            assert.deepEqual(
              pool.subarray(i * SEG, (i + 1) * SEG),
              data.subarray(i * 2 * SEG, i * 2 * SEG + SEG),
              `${what}: segment ${i} saved`,
            );
          }
          dst.write(0, new Uint8Array(segs * 2 * SEG));
          const loaded = await ce.submitQuiet(strided(b, "h2d", path, dst, segs));
          assert.equal(loaded.status, 0, `${what}: ${loaded.error}`);
          const back = dst.read(0, segs * 2 * SEG);
          for (let i = 0; i < segs; i++) {
            assert.deepEqual(
              back.subarray(i * 2 * SEG, i * 2 * SEG + SEG),
              data.subarray(i * 2 * SEG, i * 2 * SEG + SEG),
              `${what}: segment ${i} loaded`,
            );
          }
        }
      }
      const tags = new Set(records.map((c) => c.tag));
      assert.equal(records.length, tags.size, "one record a quiet batch");
      assert.ok(records.every((c) => c.kind === 2));
      assert.equal(src.info().inflight, 0);
      assert.equal(dst.info().inflight, 0);
    } finally {
      sub.unsubscribe();
      src.close();
      dst.close();
      await ce.close();
    }
  },
});

Deno.test({
  name: "cuda: a quiet load with progress words still counts its groups and ends ok",
  ignore: noCuda !== undefined,
  fn: async () => {
    const ce = CopyEngine.open({ backend: "cuda", poolBytes: 8 << 20 });
    const region = ce.engine.allocRegion(16 << 20);
    try {
      await assertQuietProgress(
        ce,
        "gpu-quiet",
        GROUPS,
        (progress) => strided(new CopyBatch(GROUPS, 200), "h2d", "dma", region, 200, progress),
      );
    } finally {
      region.close();
      await ce.close();
    }
  },
});

Deno.test({
  name:
    "cuda: a quiet save on a failed device fails whole, naming the device, and releases its regions",
  ignore: noCuda !== undefined,
  fn: async () => {
    const ce = CopyEngine.open({ backend: "cuda", poolBytes: 8 << 20 });
    const region = ce.engine.allocRegion(16 << 20);
    try {
      ce.engine.fail(PF_STATUS.PF_EIO);
      const r = await ce.submitQuiet(
        strided(new CopyBatch(GROUPS, 200), "d2h", "dma", region, 200),
      );
      assert.equal(r.status, PF_STATUS.PF_EIO);
      assert.equal(r.bytes, 0);
      assert.match(
        r.error ?? "",
        /group 0 \(layer 100\): device \d+ failed .*set by pf_engine_fail/,
      );
      assert.equal(region.info().inflight, 0, "every group released its region");
    } finally {
      region.close();
      await ce.close();
    }
  },
});
