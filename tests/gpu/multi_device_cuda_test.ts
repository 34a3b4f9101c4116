/**
 * GPU suite, several devices (`deno task test:gpu`): one pool created by one
 * engine serves the batches of every engine (each takes its own device view
 * of it), completions of all of them arrive on one ring, and a device marked
 * failed fails only its own batches, with a text naming it. On a one-GPU
 * machine the "other" engine is a second engine on device 0 (its own streams,
 * lanes and threads; the same primary context), which still runs the
 * non-owner path (pool_view) end to end; with two GPUs or more every visible
 * device is served, as `--devices` does by default. Needs an NVIDIA GPU.
 */
import assert from "node:assert/strict";
import {
  CompletionRing,
  CopyBatch,
  CopyEngine,
  deviceCount,
  deviceNumaNode,
  Engine,
  type GpuPath,
  loadLibrary,
  NativeError,
  PF_STATUS,
  type Pool,
  type Region,
} from "../../ffi/mod.ts";
import { runServerToEnd, startServer, uid } from "../server/harness.ts";
import { LLAMA_3_1_8B, SimEngine } from "../../lib/client/sim_engine.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";

const pf = loadLibrary();
const MB = 1 << 20;

function gpus(): number {
  try {
    return deviceCount("cuda");
  } catch {
    return 0;
  }
}
const GPUS = gpus();
const noCuda = GPUS === 0;

function pattern(bytes: number, seed: number): Uint8Array {
  const d = new Uint8Array(bytes);
  for (let i = 0; i < bytes; i++) d[i] = (i * 31 + seed * 7 + (i >> 12)) & 0xff;
  return d;
}

/** Submits `b` on `engine` through `pool` and `ring` (raw: any engine, any pool); resolves the BATCH record. */
function submitRaw(
  engine: Engine,
  pool: Pool,
  ring: CompletionRing,
  b: CopyBatch,
  tag: number,
): Promise<{ status: number; error: string }> {
  const done = new Promise<{ status: number; error: string }>((resolve) => {
    const sub = ring.completions$.subscribe((c) => {
      if (c.tag === tag && c.kind === 2) {
        queueMicrotask(() => sub.unsubscribe());
        const buf = new Uint8Array(512);
        const n = pf.pf_ring_take_error(ring.handle, BigInt(tag), buf, buf.length);
        const error = n > 0 ? new TextDecoder().decode(buf.subarray(0, Math.min(n, 511))) : "";
        resolve({ status: c.status, error });
      }
    });
  });
  const desc = b.finish();
  const rc = pf.pf_copy_submit(
    engine.handle,
    pool.handle,
    ring.handle,
    desc,
    BigInt(desc.length),
    BigInt(tag),
  );
  if (rc !== 0) throw new NativeError("pf_copy_submit", rc, `refused with ${rc}`);
  return done;
}

Deno.test({
  name: "cuda: the library counts the GPUs the driver sees and names each one's NUMA node",
  ignore: noCuda,
  fn: () => {
    assert.ok(GPUS >= 1);
    assert.equal(deviceCount("auto"), GPUS);
    assert.equal(deviceCount("host"), 0);
    for (let d = 0; d < GPUS; d++) {
      const node = deviceNumaNode("cuda", d);
      assert.ok(Number.isInteger(node) && node >= -1, `device ${d}: node ${node}`);
    }
    assert.throws(
      () => deviceNumaNode("cuda", GPUS),
      (e: unknown) =>
        e instanceof NativeError && e.code === PF_STATUS.PF_ENODEV &&
        new RegExp(`device ${GPUS}; this machine has ${GPUS} CUDA devices`).test(e.message),
    );
  },
});

for (const path of ["kernel", "dma_batch", "dma", "mixed"] as GpuPath[]) {
  Deno.test({
    name:
      `cuda ${path}: a pool created by one engine serves another engine's batches byte-exact, both ways`,
    ignore: noCuda,
    fn: async () => {
      // Device 1 where there is one; else a second engine on device 0.
      const owner = Engine.open({ backend: "cuda", device: 0 });
      const other = Engine.open({ backend: "cuda", device: GPUS > 1 ? 1 : 0 });
      const pool = owner.createPool(64 * MB, { pretouch: true });
      const ring = new CompletionRing(256);
      const regions: Region[] = [];
      try {
        if (path === "dma_batch" && !other.features.dmaBatch) return;
        const src = other.allocRegion(8 * MB);
        const dst = other.allocRegion(8 * MB);
        regions.push(src, dst);
        src.write(0, pattern(8 * MB, 3));
        dst.write(0, new Uint8Array(8 * MB));
        // 32 KB segments strided in the region, packed in the pool (no merging).
        const save = new CopyBatch(4, 128).reset("d2h", path);
        for (let g = 0; g < 4; g++) {
          save.group(src, g);
          for (let i = 0; i < 32; i++) {
            const k = g * 32 + i;
            save.seg(k * 64 * 1024, k * 32 * 1024, 32 * 1024);
          }
        }
        const s = await submitRaw(other, pool, ring, save, 1);
        assert.equal(s.status, 0, s.error);
        const want = src.read(0, 8 * MB);
        for (let k = 0; k < 128; k += 17) {
          assert.deepEqual(
            pool.view(k * 32 * 1024, 32 * 1024),
            want.subarray(k * 64 * 1024, k * 64 * 1024 + 32 * 1024),
            `segment ${k} in the pool`,
          );
        }
        const load = new CopyBatch(4, 128).reset("h2d", path);
        for (let g = 0; g < 4; g++) {
          load.group(dst, g);
          for (let i = 0; i < 32; i++) {
            const k = g * 32 + i;
            load.seg(k * 64 * 1024, k * 32 * 1024, 32 * 1024);
          }
        }
        const l = await submitRaw(other, pool, ring, load, 2);
        assert.equal(l.status, 0, l.error);
        const got = dst.read(0, 8 * MB);
        for (let k = 0; k < 128; k++) {
          const at = k * 64 * 1024;
          assert.deepEqual(got.subarray(at, at + 32 * 1024), want.subarray(at, at + 32 * 1024));
        }
      } finally {
        for (const r of regions) r.close();
        await ring.shutdown();
        ring.destroy();
        pool.close();
        other.close();
        owner.close();
      }
    },
  });
}

Deno.test({
  name: "cuda: an engine calibrates through a pool another engine created",
  ignore: noCuda,
  fn: () => {
    const owner = Engine.open({ backend: "cuda", device: 0 });
    const other = Engine.open({ backend: "cuda", device: GPUS > 1 ? 1 : 0 });
    const pool = owner.createPool(64 * MB, { pretouch: true });
    try {
      const t = other.calibrate(pool, "d2h", [32 * 1024, 512 * 1024], 32 * MB);
      assert.ok(t.peak > 0, `peak ${t.peak}`);
      assert.ok(t.gbps.dma[0] > 0 && t.gbps.dma[1] > 0);
    } finally {
      pool.close();
      other.close();
      owner.close();
    }
  },
});

Deno.test({
  name:
    "cuda: a device marked failed fails only its own batches, naming the device; the other engine copies on",
  ignore: noCuda,
  fn: async () => {
    const devices = Array.from({ length: GPUS }, (_, i) => i);
    const failedDev = devices[devices.length - 1];
    // Every visible device in one CopyEngine (what `--devices` serves by default).
    const ce = GPUS > 1
      ? CopyEngine.open({
        backend: "cuda",
        device: 0,
        moreDevices: devices.slice(1),
        poolBytes: 32 * MB,
      })
      : undefined;
    const solo = ce ? undefined : {
      owner: Engine.open({ backend: "cuda", device: 0 }),
      other: Engine.open({ backend: "cuda", device: 0 }),
    };
    const pool = ce ? ce.pool : solo!.owner.createPool(32 * MB);
    const ring = ce ? ce.ring : new CompletionRing(64);
    const engineOf = (d: number, which: "failed" | "healthy") =>
      ce ? ce.engines.get(d)! : which === "failed" ? solo!.other : solo!.owner;
    const bad = engineOf(failedDev, "failed");
    const good = engineOf(0, "healthy");
    const rBad = bad.allocRegion(4 * MB);
    const rGood = good.allocRegion(4 * MB);
    try {
      rBad.write(0, pattern(4 * MB, 1));
      rGood.write(0, pattern(4 * MB, 2));
      bad.fail(PF_STATUS.PF_EIO);
      const b1 = new CopyBatch(1, 1).reset("d2h", "dma");
      b1.group(rBad, 7).seg(0, 0, 4 * MB);
      const f = ce ? await ce.submit(b1, failedDev).done : await submitRaw(bad, pool, ring, b1, 11);
      assert.equal(f.status, PF_STATUS.PF_EIO);
      assert.match(f.error ?? "", new RegExp(`layer 7\\): device ${bad.device} failed`));
      const b2 = new CopyBatch(1, 1).reset("d2h", "dma");
      b2.group(rGood, 0).seg(0, 4 * MB, 4 * MB);
      const ok = ce ? await ce.submit(b2, 0).done : await submitRaw(good, pool, ring, b2, 12);
      assert.equal(ok.status, 0, ok.error ?? "");
      assert.deepEqual(pool.view(4 * MB, 4 * MB), pattern(4 * MB, 2));
    } finally {
      rBad.close();
      rGood.close();
      if (ce) await ce.close();
      else {
        await ring.shutdown();
        ring.destroy();
        pool.close();
        solo!.other.close();
        solo!.owner.close();
      }
    }
  },
});

Deno.test({
  name:
    "cuda server: --devices defaults to every visible GPU; a rank on each device saves and a DP rank on another loads byte-exact",
  ignore: noCuda,
  fn: async () => {
    const srv = await startServer([
      "--backend",
      "cuda",
      "--pool-size",
      "1gb",
      "--transfer-path",
      "dma",
    ]);
    const ns = uid("ns");
    const model = { ...LLAMA_3_1_8B, numLayers: 4 };
    const sims = Array.from({ length: GPUS }, (_, d) =>
      SimEngine.create({
        client: srv.client,
        instanceId: uid(`gpu${d}`),
        namespace: ns,
        model,
        numBlocks: 64,
        backend: "cuda",
        device: d,
      }));
    try {
      const health = await srv.client.health();
      assert.equal(health.backend, "cuda");
      for (const s of sims) await s.register();
      const hashes = chainedBlockHashes(syntheticTokens(91, 16 * 40), 16);
      const src = Array.from({ length: 40 }, (_, i) => i);
      sims[0].fill(src, hashes);
      assert.equal((await sims[0].save(src, hashes)).blocksSaved, 40);
      const last = sims[sims.length - 1];
      const q = await last.query(hashes, uid("req"));
      assert.ok(q.kind === "ready" && q.hits === 40);
      if (q.kind !== "ready") return;
      const dst = Array.from({ length: 40 }, (_, i) => 63 - i);
      last.clear(dst);
      assert.equal((await last.load(q.leaseId, dst)).state, 1);
      const v = last.verify(dst, hashes);
      assert.equal(v.badSegments, 0, v.first ?? "");
      for (const s of sims) await srv.client.unregisterContext(s.instanceId);
    } finally {
      for (const s of sims) s.close();
      await srv.stop();
    }
  },
});

Deno.test({
  name: "cuda server: a --devices id the machine does not have is refused, naming the count",
  ignore: noCuda,
  fn: async () => {
    const r = await runServerToEnd([
      "--backend",
      "cuda",
      "--pool-size",
      "64mb",
      "--devices",
      `0,${GPUS}`,
    ]);
    assert.equal(r.code, 1);
    assert.match(
      r.stderr,
      new RegExp(`device ${GPUS} does not exist; this machine has ${GPUS} CUDA device`),
    );
  },
});

Deno.test({
  name:
    "cuda server: a failed device fails its own ranks' saves naming it; the server (and any other GPU) keeps serving",
  ignore: noCuda,
  fn: async () => {
    const failed = GPUS - 1;
    const srv = await startServer(
      ["--backend", "cuda", "--pool-size", "1gb", "--transfer-path", "dma"],
      { PEGAFLOW_TEST_FAIL_DEVICES: String(failed) },
    );
    const ns = uid("ns");
    const model = { ...LLAMA_3_1_8B, numLayers: 4 };
    const sim = (d: number) =>
      SimEngine.create({
        client: srv.client,
        instanceId: uid(`gpu${d}`),
        namespace: ns,
        model,
        numBlocks: 32,
        backend: "cuda",
        device: d,
      });
    const bad = sim(failed);
    const good = GPUS > 1 ? sim(0) : undefined;
    try {
      await bad.register();
      const hashes = chainedBlockHashes(syntheticTokens(93, 16 * 8), 16);
      const src = Array.from({ length: 8 }, (_, i) => i);
      bad.fill(src, hashes);
      await assert.rejects(bad.save(src, hashes), new RegExp(`device ${failed} failed`));
      assert.equal(
        await srv.metric(
          "pegaflow_save_failures_total",
          `{reason="copy_failed",device="${failed}"}`,
        ),
        1,
      );
      assert.equal((await srv.client.health()).backend, "cuda");
      if (good) {
        await good.register();
        good.fill(src, hashes);
        assert.equal((await good.save(src, hashes)).blocksSaved, 8);
        const q = await good.query(hashes, uid("req"));
        assert.ok(q.kind === "ready" && q.hits === 8);
        if (q.kind !== "ready") return;
        const dst = Array.from({ length: 8 }, (_, i) => 31 - i);
        good.clear(dst);
        assert.equal((await good.load(q.leaseId, dst)).state, 1);
        const v = good.verify(dst, hashes);
        assert.equal(v.badSegments, 0, v.first ?? "");
      }
    } finally {
      bad.close();
      good?.close();
      await srv.stop();
    }
  },
});
