/**
 * The path a batch carries crosses the ABI and comes back in its completion:
 * the library never chooses one (host backend: it copies with memcpy and
 * reports the path it was given).
 */
import assert from "node:assert/strict";
import { CopyBatch, CopyEngine, type CopyPath, NativeError, PATH_NAMES } from "../../ffi/mod.ts";
import { PathPolicy } from "../../lib/copy_path.ts";

Deno.test("host: every path a batch carries is the path its completion reports, bytes landed", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20 });
  const region = ce.engine.allocRegion(1 << 16);
  try {
    const src = new Uint8Array(1 << 16).map((_, i) => (i * 31) & 0xff);
    region.write(0, src);
    for (const [k, path] of PATH_NAMES.entries()) {
      const b = new CopyBatch(1, 4).reset("d2h", path);
      b.group(region, 0).seg(0, k * 8192, 4096).seg(8192, k * 8192 + 4096, 4096);
      const r = await ce.submit(b).done;
      assert.equal(r.status, 0, r.error ?? "");
      assert.equal(r.path, path);
      assert.deepEqual(ce.pool.view(k * 8192, 4096), src.subarray(0, 4096));
      assert.deepEqual(ce.pool.view(k * 8192 + 4096, 4096), src.subarray(8192, 12288));
    }
  } finally {
    region.close();
    await ce.close();
  }
});

Deno.test("host: the path the policy chose after the segments were written is the one reported", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20 });
  const region = ce.engine.allocRegion(1 << 16);
  try {
    const policy = new PathPolicy({}, { backend: "host" });
    const b = new CopyBatch(1, 8).reset("h2d", "kernel");
    b.group(region, 3);
    for (let i = 0; i < 8; i++) b.seg(i * 8192, i * 4096, 4096);
    const chosen = policy.choose(b.direction, b.bytes / b.numSegs);
    b.setPath(chosen);
    const r = await ce.submit(b).done;
    assert.equal(r.status, 0, r.error ?? "");
    assert.equal(chosen, "host");
    assert.equal(r.path, "host");
  } finally {
    region.close();
    await ce.close();
  }
});

Deno.test("a path the ABI does not know is refused by name, before anything is copied", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 16 });
  const region = ce.engine.allocRegion(1 << 12);
  try {
    assert.throws(
      () => new CopyBatch(1, 1).reset("d2h", "auto" as CopyPath),
      /path "auto"; expected host, kernel, dma_batch, dma or mixed/,
    );
    assert.throws(() => new CopyBatch(1, 1).setPath("fast" as CopyPath), /path "fast"/);
    // A descriptor written by another client with a bad path word.
    const b = new CopyBatch(1, 1).reset("d2h", "host");
    b.group(region, 0).seg(0, 0, 64);
    b.finish();
    new Uint32Array(b.buffer.buffer)[3] = 9; // pf_batch_header.path
    ce.pool.view(0, 64).fill(7);
    assert.throws(
      () => ce.submit(b),
      (e: unknown) =>
        e instanceof NativeError && e.codeName === "PF_EINVAL" &&
        /path 9 \(expected 0 host, 1 kernel, 2 dma_batch, 3 dma, 4 mixed\)/.test(e.message),
    );
    assert.deepEqual(ce.pool.view(0, 64), new Uint8Array(64).fill(7));
  } finally {
    region.close();
    await ce.close();
  }
});
