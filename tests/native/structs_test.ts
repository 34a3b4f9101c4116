/** The ABI's output structs decode to named fields that match what the library did. */
import assert from "node:assert/strict";
import { CopyBatch, CopyEngine, Engine, EXPECTED_ABI_VERSION } from "../../ffi/mod.ts";
import {
  decodeEngineProps,
  decodeFileProps,
  decodeFsUsage,
  decodePoolProps,
  decodeRegionProps,
  decodeUringStats,
  decodeXferPeerStatus,
  decodeXferStats,
  ENGINE_PROPS_BYTES,
} from "../../ffi/structs.ts";
import { fsSpace } from "../../ffi/uring.ts";

Deno.test("pf_engine_info names the host backend, its device and the ABI it implements", () => {
  const e = Engine.open({ backend: "host" });
  try {
    const p = e.props();
    assert.equal(p.backend, "host");
    assert.equal(p.deviceName, "host");
    assert.equal(p.abiVersion, EXPECTED_ABI_VERSION);
    assert.equal(p.driverVersion, 0);
    assert.equal(p.smCount, 0);
    assert.equal(p.kernelGrid, 0);
    assert.deepEqual([p.hasKernel, p.hasDmaBatch, p.hasIpc], [false, false, false]);
    assert.equal(e.deviceName, "host");
  } finally {
    e.close();
  }
});

Deno.test("pool and region info report what was applied and what is in flight", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 3 << 20, pretouch: true });
  const region = ce.engine.allocRegion(1 << 20);
  try {
    const pool = ce.pool.info();
    assert.equal(pool.bytes, 3 << 20);
    assert.equal(pool.pretouched, true);
    assert.equal(pool.hugepages, false);
    assert.equal(pool.hugePageBytes, 0);
    const r = region.info();
    assert.equal(r.bytes, 1 << 20);
    assert.equal(r.imported, false);
    assert.ok(r.addr > 0n);
    const b = new CopyBatch(1, 1).reset("d2h").group(region, 0).seg(0, 0, 1 << 20);
    const sub = ce.submit(b);
    await sub.done;
    assert.equal(region.info().inflight, 0);
  } finally {
    region.close();
    await ce.close();
  }
});

Deno.test("pf_fs_space reports a filesystem's size in named fields", () => {
  const s = fsSpace(Deno.cwd());
  assert.ok(s.totalBytes > 0 && s.availableBytes <= s.totalBytes && s.blockBytes > 0);
});

Deno.test("every decoder refuses a buffer shorter than its struct, naming the struct", () => {
  const short = new Uint8Array(8);
  for (
    const [decode, name] of [
      [decodeEngineProps, "pf_engine_props"],
      [decodePoolProps, "pf_pool_props"],
      [decodeRegionProps, "pf_region_props"],
      [decodeUringStats, "pf_uring_stats"],
      [decodeFileProps, "pf_file_props"],
      [decodeFsUsage, "pf_fs_usage"],
      [decodeXferStats, "pf_xfer_stats"],
      [decodeXferPeerStatus, "pf_xfer_peer_status"],
    ] as const
  ) {
    assert.throws(() => decode(short), new RegExp(`${name}: buffer of 8 bytes`));
  }
});

Deno.test("an engine struct with a backend code outside pf_backend is refused", () => {
  const buf = new Uint8Array(ENGINE_PROPS_BYTES);
  new DataView(buf.buffer).setUint32(0, 7, true);
  assert.throws(() => decodeEngineProps(buf), /backend 7; expected 1 or 2/);
});
