/**
 * Several host-backend devices in one process (ffi level): an engine per
 * device, one pool (owned by the first) that every engine copies through,
 * one ring for all completions; pf_engine_fail fails one engine's copies
 * with a text naming its device and leaves the others copying byte-exact;
 * a pool split per NUMA node binds each part's pages (numa_maps).
 */
import assert from "node:assert/strict";
import {
  CopyBatch,
  CopyEngine,
  deviceCount,
  deviceNumaNode,
  Engine,
  NativeError,
  PF_STATUS,
} from "../../ffi/mod.ts";
import { onlineNodes } from "../../lib/numa.ts";

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

/** The NUMA policy of the mapping that starts at `addr` (from /proc/self/numa_maps), e.g. "bind:0". */
function numaPolicyAt(addr: bigint): string | undefined {
  const hex = addr.toString(16);
  for (const line of Deno.readTextFileSync("/proc/self/numa_maps").split("\n")) {
    const [start, policy] = line.split(" ");
    if (start === hex) return policy;
  }
  return undefined;
}

Deno.test("a split pool binds each part's pages to its node before pre-touch; an unbound part keeps the default policy", () => {
  const online = onlineNodes();
  const e = Engine.open({ backend: "host" });
  const MB = 1 << 20;
  const pool = e.createPool(8 * MB, {
    pretouch: true,
    parts: [{ bytes: 4 * MB, node: online[0] }, { bytes: 4 * MB, node: -1 }],
  });
  try {
    const base = BigInt(Deno.UnsafePointer.value(Deno.UnsafePointer.of(pool.view(0, 1))!));
    assert.equal(numaPolicyAt(base), `bind:${online[0]}`);
    assert.equal(numaPolicyAt(base + BigInt(4 * MB)), "default");
    pool.view(0, 8 * MB).fill(5); // every byte of both parts is usable
  } finally {
    pool.close();
    e.close();
  }
});

Deno.test("split pool parts are checked: the sum, the page multiple, and a node the host lacks", () => {
  const e = Engine.open({ backend: "host" });
  const MB = 1 << 20;
  const refused = (parts: { bytes: number; node: number }[], re: RegExp) =>
    assert.throws(
      () => e.createPool(8 * MB, { parts }),
      (err: unknown) =>
        err instanceof NativeError && err.code === PF_STATUS.PF_EINVAL && re.test(err.message),
    );
  try {
    refused(
      [{ bytes: 4 * MB, node: -1 }, { bytes: 2 * MB, node: -1 }],
      /parts sum to 6291456 bytes; the pool is 8388608/,
    );
    refused(
      [{ bytes: 4 * MB + 100, node: -1 }, { bytes: 4 * MB - 100, node: -1 }],
      /part 0 is 4194404 bytes, not a multiple/,
    );
    refused(
      [{ bytes: 4 * MB, node: 0 }, { bytes: 4 * MB, node: 1000 }],
      /part 1 .*mbind to NUMA node 1000 failed/,
    );
  } finally {
    e.close();
  }
});

Deno.test("the host backend has no physical devices to count and no NUMA node to name", () => {
  assert.equal(deviceCount("host"), 0);
  assert.equal(deviceNumaNode("host", 3), -1);
  assert.throws(() => deviceNumaNode("host", -1), /device -1 is negative/);
});
