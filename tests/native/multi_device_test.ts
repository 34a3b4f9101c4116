/**
 * Several host-backend devices in one process (ffi level): an engine per
 * device, one pool (owned by the first) that every engine copies through,
 * one ring for all completions; pf_engine_fail fails one engine's copies
 * with a text naming its device and leaves the others copying byte-exact.
 */
import assert from "node:assert/strict";
import { CopyBatch, CopyEngine, Engine, NativeError, PF_STATUS } from "../../ffi/mod.ts";

const KB = 1024;

function pattern(bytes: number, seed: number): Uint8Array {
  const d = new Uint8Array(bytes);
  for (let i = 0; i < bytes; i++) d[i] = (i * 13 + seed) & 0xff;
  return d;
}

Deno.test("every device's engine copies through the one pool and ring; a failed device fails only its own batches", async () => {
  const ce = CopyEngine.open({
    backend: "host",
    device: 0,
    moreDevices: [1, 2],
    poolBytes: 1 << 20,
    workers: 2,
  });
  const owners = [0, 1, 2].map(() => ce.engine.allocRegion(64 * KB));
  const regions = [0, 1, 2].map((d) => ce.engines.get(d)!.importRegion(owners[d].handle, 64 * KB));
  try {
    assert.deepEqual([...ce.engines.keys()], [0, 1, 2]);
    for (let d = 0; d < 3; d++) owners[d].write(0, pattern(64 * KB, d));
    // Save each device's region into its own 64 KiB of the pool, on its own engine.
    for (let d = 0; d < 3; d++) {
      const b = new CopyBatch(1, 1).reset("d2h");
      b.group(regions[d], d).seg(0, d * 64 * KB, 64 * KB);
      const r = await ce.submit(b, d).done;
      assert.equal(r.status, 0, r.error ?? "");
      assert.deepEqual(ce.pool.view(d * 64 * KB, 64 * KB), pattern(64 * KB, d));
    }
    ce.engines.get(1)!.fail(PF_STATUS.PF_EIO);
    const b1 = new CopyBatch(1, 1).reset("h2d");
    b1.group(regions[1], 5).seg(0, 0, 64 * KB);
    const failed = await ce.submit(b1, 1).done;
    assert.equal(failed.status, PF_STATUS.PF_EIO);
    assert.match(failed.error ?? "", /layer 5\): device 1 failed/);
    assert.deepEqual(owners[1].read(0, 64 * KB), pattern(64 * KB, 1), "nothing was written");
    // Device 2 still loads device 0's bytes byte-exact.
    const b2 = new CopyBatch(1, 1).reset("h2d");
    b2.group(regions[2], 0).seg(0, 0, 64 * KB);
    const ok = await ce.submit(b2, 2).done;
    assert.equal(ok.status, 0, ok.error ?? "");
    assert.deepEqual(owners[2].read(0, 64 * KB), pattern(64 * KB, 0));
    // A batch must run on the engine its regions were opened on.
    const wrong = new CopyBatch(1, 1).reset("d2h");
    wrong.group(regions[2], 0).seg(0, 0, 4 * KB);
    assert.throws(() => ce.submit(wrong, 0), /region \d+ belongs to another engine/);
    assert.throws(() => ce.submit(wrong, 9), /device 9 is not served \(served: 0,1,2\)/);
  } finally {
    for (const r of regions) r.close();
    for (const o of owners) o.close();
    await ce.close();
  }
});

Deno.test("a repeated device id is refused before any engine opens", () => {
  assert.throws(
    () => CopyEngine.open({ backend: "host", device: 1, moreDevices: [1], poolBytes: 1 << 20 }),
    (e: unknown) => e instanceof NativeError && /devices 1,1 repeat an id/.test(e.message),
  );
});

Deno.test("pf_engine_fail on a closed engine is refused with a handle error", () => {
  const e = Engine.open({ backend: "host" });
  e.close();
  assert.throws(
    () => e.fail(),
    (err: unknown) => err instanceof NativeError && err.code === PF_STATUS.PF_EHANDLE,
  );
});
