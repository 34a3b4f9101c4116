/**
 * GPU suite (`deno task test:gpu`): the host suite's byte-exact cases on the
 * cuda backend, per copy path, in one process and with exporter and importer
 * in two processes (CUDA IPC); plus validation, progress words, EBUSY,
 * calibration. Needs an NVIDIA GPU; fails with a clear message without one.
 */
import assert from "node:assert/strict";
import {
  CompletionRing,
  CopyBatch,
  CopyEngine,
  type CopyPath,
  Engine,
  type GpuPath,
  loadLibrary,
  NativeError,
  SharedMemory,
} from "../../ffi/mod.ts";
import { noCuda } from "./_cuda.ts";
import {
  allocRegions,
  fillRegions,
  type LayoutKind,
  makeGeometry,
  pickBlocks,
  runRoundTrip,
} from "../native/kv_layout.ts";
import { mulberry32 as rng } from "../_seeded.ts";
import { crossProcessRoundTrip } from "../native/cross_process.ts";
import { threadNamesOf } from "../native/process.ts";
import { PathPolicy } from "../../lib/copy_path.ts";
import { measureCalibration } from "../../lib/copy_calibration.ts";

const pf = loadLibrary();

Deno.test("a CUDA device is present and the copy kernel is loaded", () => {
  assert.equal(noCuda, undefined, `the GPU suite needs a CUDA device: ${noCuda}`);
  const e = Engine.open({ backend: "cuda" });
  try {
    assert.equal(e.backend, "cuda");
    assert.ok(e.features.kernel, "the fatbin was not embedded (build with nvcc present)");
    assert.ok(e.features.ipc);
    assert.ok(e.smCount > 0);
    assert.ok(e.kernelGrid > 0 && e.kernelGrid <= e.smCount);
    e.setKernelGrid(4);
    assert.equal(e.kernelGrid, 4);
    e.setKernelGrid(0);
    assert.throws(() => e.setKernelGrid(e.smCount * 64), /expected 0/);
    const auto = Engine.open({ backend: "auto" });
    assert.equal(auto.backend, "cuda");
    auto.close();
  } finally {
    e.close();
  }
});

Deno.test("the cuda engine's threads carry their names (top, perf and /proc say whose CPU)", async () => {
  const names = ["pf-cu-done", "pf-cu-submit", "pf-cu-lane"];
  const r = await threadNamesOf("cuda", Object.fromEntries(names.map((n) => [n, 1])));
  for (const n of names) {
    assert.ok(r.open[n] >= 1, `no thread named ${n}: ${JSON.stringify(r)}`);
    assert.equal(r.closed[n], 0, `${n} left after close`);
  }
});

const CASES: Array<[LayoutKind, number, number, number, number, boolean]> = [
  ["kv_split", 256, 4, 32768, 200, false],
  ["kv_interleaved", 64, 3, 16384, 64, true],
  ["mla", 300, 5, 1152, 250, false], // 1152 = 576 x bf16: not a multiple of 16 x 2^k
  ["cross_layer", 64, 6, 4096, 40, true],
  ["kv_split", 16, 2, 100, 12, false], // odd sizes: byte path of the kernel
];

const RUNS: Array<[GpuPath, "simt" | "tma" | undefined]> = [
  ["kernel", "simt"],
  ["kernel", "tma"],
  ["dma_batch", undefined],
  ["dma", undefined],
  ["mixed", undefined],
];

for (const [path, variant] of RUNS) {
  Deno.test({
    name: `cuda ${path}${
      variant ? ` (${variant} kernel)` : ""
    }: gather then scatter is byte-exact for every layout`,
    ignore: noCuda !== undefined,
    fn: async () => {
      if (variant) Deno.env.set("PEGAFLOW_KERNEL", variant);
      const ce = CopyEngine.open({ backend: "cuda", poolBytes: 256 << 20 });
      Deno.env.delete("PEGAFLOW_KERNEL");
      try {
        if (variant === "tma") {
          assert.equal(ce.engine.kernelVariant, "tma", "the bulk-copy kernel did not load");
        }
        if (path === "dma_batch" && !ce.engine.features.dmaBatch) {
          const b = new CopyBatch(1, 1).reset("d2h", "dma_batch");
          const r = ce.engine.allocRegion(4096);
          b.group(r, 0).seg(0, 0, 64);
          assert.throws(() => ce.submit(b), /PF_EUNSUPPORTED/);
          r.close();
          return;
        }
        for (const [kind, blocks, layers, seg, n, sorted] of CASES) {
          const g = makeGeometry(kind, blocks, layers, seg);
          const src = allocRegions(ce.engine, g);
          const dst = allocRegions(ce.engine, g);
          try {
            fillRegions(g, src);
            for (const r of dst) r.write(0, new Uint8Array(r.bytes)); // cuMemAlloc does not zero
            const rand = rng(blocks + n);
            await runRoundTrip(
              ce,
              g,
              src,
              dst,
              pickBlocks(rand, blocks, n, sorted),
              pickBlocks(rand, blocks, n, sorted),
              {
                path,
              },
            );
          } finally {
            for (const r of [...src, ...dst]) r.close();
          }
        }
      } finally {
        await ce.close();
      }
    },
  });
}

for (
  const [kind, path] of [["kv_split", "kernel"], ["mla", "dma"], ["cross_layer", "dma_batch"], [
    "kv_interleaved",
    "mixed",
  ]] as const
) {
  Deno.test({
    name: `cuda IPC: regions exported by another process round-trip byte-exact (${kind}, ${path})`,
    ignore: noCuda !== undefined,
    fn: async () => {
      const probe = Engine.open({ backend: "cuda" });
      const batchOk = probe.features.dmaBatch;
      probe.close();
      await crossProcessRoundTrip(
        {
          backend: "cuda",
          kind,
          numBlocks: 128,
          numLayers: 4,
          segBytes: kind === "mla" ? 1152 : 16384,
          numSegsCross: 2,
        },
        128 << 20,
        path === "dma_batch" && !batchOk ? "dma" : path,
      );
    },
  });
}

Deno.test({
  name: "cuda: bad segments are refused before anything is copied",
  ignore: noCuda !== undefined,
  fn: async () => {
    const ce = CopyEngine.open({ backend: "cuda", poolBytes: 1 << 20 });
    const region = ce.engine.allocRegion(1 << 16);
    try {
      ce.pool.view(0, 1 << 20).fill(0x33);
      region.write(0, new Uint8Array(1 << 16).fill(0x77));
      const b = new CopyBatch(2, 8).reset("d2h", "kernel");
      b.group(region, 0).seg(0, 0, 4096).group(region, 9).seg(1 << 16, 4096, 16);
      assert.throws(
        () => ce.submit(b),
        (e: unknown) =>
          e instanceof NativeError && e.codeName === "PF_ERANGE" &&
          /group 1 \(layer 9\) segment 0/.test(e.message),
      );
      assert.ok(ce.pool.view(0, 8192).every((x) => x === 0x33));
      assert.throws(() => ce.engine.importRegion(new Uint8Array(64).fill(7), 4096), /PF_EHANDLE/);
    } finally {
      region.close();
      await ce.close();
    }
  },
});

Deno.test({
  name: "cuda: progress words count groups; closing under a queued copy is EBUSY",
  ignore: noCuda !== undefined,
  fn: async () => {
    const name = `/pegaflow-gpu-progress-${Deno.pid}`;
    const shm = SharedMemory.open(name, 64, { create: true, unlink: true });
    const engine = Engine.open({ backend: "cuda" });
    const pool = engine.createPool(64 << 20);
    const region = engine.allocRegion(64 << 20);
    const ring = new CompletionRing(16);
    try {
      const b = new CopyBatch(20, 20).reset("h2d", "kernel", { shm, offset: 8 });
      for (let g = 0; g < 20; g++) b.group(region, g).seg(g << 20, g << 20, 1 << 20);
      const desc = b.finish();
      assert.equal(
        pf.pf_copy_submit(engine.handle, pool.handle, ring.handle, desc, BigInt(desc.length), 5n),
        0,
      );
      // Nobody reads the 16-record ring yet: the batch cannot finish.
      assert.throws(() => region.close(), /PF_EBUSY/);
      assert.throws(() => pool.close(), /PF_EBUSY/);
      assert.throws(() => shm.close(), /PF_EBUSY/);
      const done = new Promise<number>((resolve) => {
        const sub = ring.completions$.subscribe((c) => {
          if (c.tag === 5 && c.kind === 2) {
            queueMicrotask(() => sub.unsubscribe());
            resolve(c.status);
          }
        });
      });
      assert.equal(await done, 0);
      const w = new Uint32Array(shm.view().buffer);
      assert.equal(w[2], 20);
      assert.equal(w[3], 1);
    } finally {
      region.close();
      pool.close();
      await ring.shutdown();
      ring.destroy();
      engine.close();
      shm.close();
    }
  },
});

Deno.test({
  name: "cuda: a batch that names no GPU path (host) is refused, nothing copied",
  ignore: noCuda !== undefined,
  fn: async () => {
    const ce = CopyEngine.open({ backend: "cuda", poolBytes: 1 << 20 });
    const region = ce.engine.allocRegion(1 << 16);
    try {
      const b = new CopyBatch(1, 1).reset("d2h", "host");
      b.group(region, 0).seg(0, 0, 4096);
      assert.throws(
        () => ce.submit(b),
        (e: unknown) =>
          e instanceof NativeError && e.codeName === "PF_EINVAL" &&
          /path 0 \(host\)/.test(e.message),
      );
    } finally {
      region.close();
      await ce.close();
    }
  },
});

Deno.test({
  name: "cuda: the calibrated policy's path for each batch is the path its completion reports",
  ignore: noCuda !== undefined,
  fn: async () => {
    const ce = CopyEngine.open({ backend: "cuda", poolBytes: 64 << 20 });
    const region = ce.engine.allocRegion(8 << 20);
    try {
      const policy = new PathPolicy(measureCalibration(ce.engine, ce.pool, 64 << 20));
      for (const dir of ["d2h", "h2d"] as const) {
        for (const seg of [8192, 32768, 512 << 10]) {
          const n = (4 << 20) / seg;
          const b = new CopyBatch(1, n).reset(dir);
          b.group(region, 0);
          // A stride of twice the size: nothing merges, the mean stays `seg`.
          for (let i = 0; i < n; i++) b.seg(i * 2 * seg, i * seg, seg);
          const chosen = policy.choose(dir, b.bytes / b.numSegs);
          b.setPath(chosen);
          const r = await ce.submit(b).done;
          assert.equal(r.status, 0, r.error ?? "");
          assert.equal(r.path, chosen, `${dir} ${seg} B segments`);
        }
      }
    } finally {
      region.close();
      await ce.close();
    }
  },
});

Deno.test({
  name: "cuda: calibration measures every available path in both directions",
  ignore: noCuda !== undefined,
  fn: () => {
    const engine = Engine.open({ backend: "cuda" });
    const pool = engine.createPool(64 << 20);
    try {
      for (const dir of ["d2h", "h2d"] as const) {
        const t = engine.calibrate(pool, dir, [32768, 1 << 20], 64 << 20);
        assert.ok(t.peak > 1, `peak ${t.peak} GB/s`);
        assert.ok(t.gbps.kernel.every((x) => x > 0.5), `kernel ${t.gbps.kernel}`);
        assert.ok(t.gbps.dma.every((x) => x > 0.5), `dma ${t.gbps.dma}`);
        assert.ok(t.gbps.mixed.every((x) => x > 0.5), `mixed ${t.gbps.mixed}`);
        if (engine.features.dmaBatch) {
          assert.ok(t.gbps.dma_batch.every((x) => x > 0.5), `dma_batch ${t.gbps.dma_batch}`);
        }
      }
    } finally {
      pool.close();
      engine.close();
    }
  },
});

Deno.test({
  name: "cuda: a huge-page pool registers, or the error names nr_hugepages",
  ignore: noCuda !== undefined,
  fn: () => {
    const engine = Engine.open({ backend: "cuda" });
    try {
      const reserved = Number(Deno.readTextFileSync("/proc/sys/vm/nr_hugepages").trim());
      if (reserved >= 2) {
        const pool = engine.createPool(4 << 20, { hugepages: true, pretouch: true });
        const info = pool.info();
        assert.ok(info.hugepages && info.locked && info.pretouched);
        pool.close();
      } else {
        assert.throws(() => engine.createPool(4 << 20, { hugepages: true }), /nr_hugepages/);
      }
    } finally {
      engine.close();
    }
  },
});

Deno.test({
  name: "cuda: many concurrent batches on every path each land their own bytes",
  ignore: noCuda !== undefined,
  fn: async () => {
    const SEG = 32768, GROUPS = 4, SEGS = 64, BATCHES = 32;
    const ce = CopyEngine.open({ backend: "cuda", poolBytes: BATCHES * GROUPS * SEGS * SEG });
    const region = ce.engine.allocRegion(4096 * SEG);
    try {
      const src = new Uint8Array(4096 * SEG);
      for (let i = 0; i < src.length; i += 4) {
        src[i] = (i * 2654435761) >>> 24;
        src[i + 1] = i >>> 8;
      }
      region.write(0, src);
      const paths: CopyPath[] = ce.engine.features.dmaBatch
        ? ["kernel", "dma_batch", "mixed", "dma"]
        : ["kernel", "mixed", "dma"];
      const subs = Array.from({ length: BATCHES }, (_, k) => {
        const b = new CopyBatch(GROUPS, GROUPS * SEGS).reset("d2h", paths[k % paths.length]);
        for (let g = 0; g < GROUPS; g++) {
          b.group(region, g);
          for (let s = 0; s < SEGS; s++) {
            const i = (k * GROUPS + g) * SEGS + s;
            b.seg(((i * 37) % 4096) * SEG, i * SEG, SEG);
          }
        }
        return ce.submit(b);
      });
      const results = await Promise.all(subs.map((s) => s.done));
      results.forEach((r, k) => {
        assert.equal(r.status, 0, `batch ${k}`);
        assert.equal(r.bytes, GROUPS * SEGS * SEG);
        assert.equal(r.path, paths[k % paths.length]);
      });
      const pool = ce.pool.view(0, BATCHES * GROUPS * SEGS * SEG);
      for (let i = 0; i < BATCHES * GROUPS * SEGS; i++) {
        const from = ((i * 37) % 4096) * SEG;
        for (let j = 0; j < SEG; j += 1020) {
          if (pool[i * SEG + j] !== src[from + j]) {
            throw new Error(`segment ${i} byte ${j}: ${pool[i * SEG + j]} != ${src[from + j]}`);
          }
        }
      }
    } finally {
      region.close();
      await ce.close();
    }
  },
});
