/**
 * Bad input is refused with a clear error and copies nothing: null, unknown
 * and stale handles, segments outside the region or pool, zero sizes,
 * overflowing offsets, malformed descriptors, bad shm names, missing huge
 * pages, a cuda engine without a GPU.
 */
import assert from "node:assert/strict";
import { filter, firstValueFrom } from "rxjs";
import {
  COMPLETION_KIND,
  CopyBatch,
  CopyEngine,
  Engine,
  lastError,
  loadLibrary,
  NativeError,
  type Region,
  SharedMemory,
} from "../../ffi/mod.ts";

const pf = loadLibrary();
const POOL = 1 << 20;

/** Runs fn with a fresh host CopyEngine and one 64 KiB region, cleaning up. */
async function withEngine(
  fn: (ce: CopyEngine, region: Region) => Promise<void> | void,
): Promise<void> {
  const ce = CopyEngine.open({ backend: "host", poolBytes: POOL, workers: 2 });
  const region = ce.engine.allocRegion(64 << 10);
  try {
    await fn(ce, region);
  } finally {
    region.close();
    await ce.close();
  }
}

function assertNative(fn: () => unknown, codeName: string, message?: RegExp): NativeError {
  let caught: unknown;
  try {
    fn();
  } catch (e) {
    caught = e;
  }
  assert.ok(caught instanceof NativeError, `expected a NativeError ${codeName}, got ${caught}`);
  assert.equal(caught.codeName, codeName, caught.message);
  if (message) assert.match(caught.message, message);
  return caught;
}

Deno.test("a batch with one bad segment copies nothing and names group, layer, segment and sizes", async () => {
  await withEngine((ce, region) => {
    region.write(0, new Uint8Array(64 << 10).fill(0xab));
    ce.pool.view(0, POOL).fill(0x11);
    const b = new CopyBatch(4, 200).reset("d2h");
    b.group(region, 3);
    for (let i = 0; i < 100; i++) b.seg(i * 64, i * 64, 64);
    b.group(region, 7);
    for (let i = 0; i < 5; i++) b.seg(i * 64, 8192 + i * 64, 64);
    b.seg((64 << 10) - 32, 9000, 64); // runs 32 bytes past the region's end
    const err = assertNative(() => ce.submit(b), "PF_ERANGE");
    assert.match(err.message, /group 1 \(layer 7\) segment 5 \(batch segment 105\)/);
    assert.match(err.message, /region_off 65504 \+ bytes 64 exceeds region \d+ size 65536/);
    assert.ok(ce.pool.view(0, POOL).every((x) => x === 0x11), "pool bytes changed");
    assert.equal(region.info().inflight, 0);
    assert.equal(ce.inflight, 0);
  });
});

Deno.test("segments outside the pool, zero-sized, or with overflowing offsets are refused", async () => {
  await withEngine((ce, region) => {
    const b = new CopyBatch(1, 4);
    b.reset("h2d").group(region, 0).seg(0, POOL - 8, 16);
    assertNative(
      () => ce.submit(b),
      "PF_ERANGE",
      /pool_off 1048568 \+ bytes 16 exceeds pool \d+ size 1048576/,
    );
    b.reset("d2h").group(region, 0).seg(0, 0, 0);
    assertNative(() => ce.submit(b), "PF_EINVAL", /segment 0 .*bytes is 0/);
    // region_off near 2^64 so that region_off + bytes wraps around.
    b.reset("d2h").group(region, 0).seg(0, 0, 64);
    const desc = b.finish();
    const u = new Uint32Array(desc.buffer, desc.byteOffset, desc.length >> 2);
    const segWord = u[6] >> 2;
    u[segWord] = 0xfffff000;
    u[segWord + 1] = 0xffffffff;
    u[segWord + 4] = 0x2000;
    const rc = pf.pf_copy_submit(
      ce.engine.handle,
      ce.pool.handle,
      ce.ring.handle,
      desc,
      BigInt(desc.length),
      1n,
    );
    assert.equal(rc, -3); // PF_ERANGE, not a wrapped "fits"
    // Same for the pool side.
    u[segWord] = 0;
    u[segWord + 1] = 0;
    u[segWord + 2] = 0xffffff00;
    u[segWord + 3] = 0xffffffff;
    assert.equal(
      pf.pf_copy_submit(
        ce.engine.handle,
        ce.pool.handle,
        ce.ring.handle,
        desc,
        BigInt(desc.length),
        2n,
      ),
      -3,
    );
  });
});

Deno.test("null, unknown, stale and wrong-kind handles are refused", async () => {
  await withEngine((ce, region) => {
    const b = new CopyBatch(1, 1);
    b.reset("d2h").group(0, 0).seg(0, 0, 64);
    assertNative(
      () => ce.submit(b),
      "PF_EHANDLE",
      /group 0 \(layer 0\): region 0 is not a live region handle/,
    );
    b.reset("d2h").group(0x7fff1234, 9).seg(0, 0, 64);
    assertNative(() => ce.submit(b), "PF_EHANDLE", /layer 9/);
    // Wrong kind: the pool's handle where a region belongs.
    b.reset("d2h").group(ce.pool.handle, 0).seg(0, 0, 64);
    assertNative(() => ce.submit(b), "PF_EHANDLE");
    // Stale: a closed region's handle.
    const gone = ce.engine.allocRegion(4096);
    const staleId = gone.id;
    gone.close();
    b.reset("d2h").group(staleId, 2).seg(0, 0, 64);
    assertNative(() => ce.submit(b), "PF_EHANDLE", /region \d+ is not a live region handle/);
    // Engine / pool / ring handles.
    b.reset("d2h").group(region, 0).seg(0, 0, 64);
    const desc = b.finish();
    assert.equal(
      pf.pf_copy_submit(0, ce.pool.handle, ce.ring.handle, desc, BigInt(desc.length), 1n),
      -2,
    );
    assert.equal(
      pf.pf_copy_submit(ce.engine.handle, 0, ce.ring.handle, desc, BigInt(desc.length), 1n),
      -2,
    );
    assert.equal(
      pf.pf_copy_submit(ce.engine.handle, ce.pool.handle, 99, desc, BigInt(desc.length), 1n),
      -2,
    );
    assert.equal(pf.pf_region_close(staleId), -2);
    assert.equal(pf.pf_pool_destroy(12345), -2);
    assert.equal(pf.pf_engine_close(0), -2);
    assert.equal(pf.pf_ring_destroy(0xffffffff), -2);
  });
});

Deno.test("malformed descriptors are refused", async () => {
  await withEngine(async (ce, region) => {
    const submit = (d: Uint8Array, len = d.length) =>
      pf.pf_copy_submit(ce.engine.handle, ce.pool.handle, ce.ring.handle, d, BigInt(len), 7n);
    const b = new CopyBatch(2, 4);
    b.reset("d2h").group(region, 0).seg(0, 0, 64).seg(64, 64, 64);
    const desc = b.finish();
    const u = new Uint32Array(desc.buffer, desc.byteOffset, desc.length >> 2);
    assert.equal(submit(desc, 16), -1); // shorter than the header
    assert.equal(submit(desc, desc.length - 8), -1); // segments cut off
    u[0] = 0; // no groups
    assert.equal(submit(desc), -1);
    u[0] = 1;
    u[1] = 3; // header claims more segments than the groups cover
    assert.equal(submit(desc), -1);
    u[1] = 2;
    u[2] = 5; // bad direction
    assert.equal(submit(desc), -1);
    u[2] = 0;
    u[3] = 9; // bad path
    assert.equal(submit(desc), -1);
    u[3] = 0;
    u[7] = 4; // a flag bit the library does not know
    assert.equal(submit(desc), -1);
    assert.match(lastError(), /header\.flags 0x4 has unknown bits/);
    u[7] = 0;
    u[6] = 12; // segs_off not 8-aligned
    assert.equal(submit(desc), -1);
    u[6] = 40; // segs_off inside groups
    assert.equal(submit(desc), -1);
    u[6] = 32 + 16 * 2;
    const ended = firstValueFrom(
      ce.other$.pipe(filter((c) => c.tag === 7 && c.kind === COMPLETION_KIND.BATCH)),
    );
    assert.equal(submit(desc), 0, "the repaired descriptor is accepted");
    assert.equal((await ended).status, 0);
  });
});

Deno.test("groups that do not tile the segment array are refused", async () => {
  await withEngine((ce, region) => {
    const b = new CopyBatch(2, 4);
    b.reset("d2h").group(region, 0).seg(0, 0, 64).group(region, 1).seg(64, 64, 64);
    const desc = b.finish();
    const u = new Uint32Array(desc.buffer, desc.byteOffset, desc.length >> 2);
    u[8 + 4 + 2] = 0; // group 1 first_seg 0 instead of 1
    const rc = pf.pf_copy_submit(
      ce.engine.handle,
      ce.pool.handle,
      ce.ring.handle,
      desc,
      BigInt(desc.length),
      1n,
    );
    assert.equal(rc, -1);
    const msg = new NativeError("x", rc, "").codeName;
    assert.equal(msg, "PF_EINVAL");
  });
});

Deno.test("CopyBatch refuses to overflow its preallocated capacity", () => {
  const b = new CopyBatch(1, 2).reset("d2h");
  assert.throws(() => b.seg(0, 0, 1), /call group\(\) first/);
  b.group(1, 0).seg(0, 0, 1).seg(1, 1, 1);
  assert.throws(() => b.seg(2, 2, 1), /at most 2 segments/);
  assert.throws(() => b.group(1, 5), /layer 5: batch holds at most 1 groups/);
  assert.throws(() => new CopyBatch(0, 1), RangeError);
});

Deno.test("region imports with bad handles or sizes are refused", () => {
  const engine = Engine.open({ backend: "host" });
  const region = engine.allocRegion(8192);
  try {
    const enc = (s: string) => {
      const h = new Uint8Array(64);
      h.set(new TextEncoder().encode(s));
      return h;
    };
    assertNative(
      () => engine.importRegion(enc("/pegaflow-no-such-region"), 4096),
      "PF_EHANDLE",
      /no-such-region/,
    );
    assertNative(
      () => engine.importRegion(enc("no-slash"), 4096),
      "PF_EINVAL",
      /must start with '\/'/,
    );
    assertNative(() => engine.importRegion(enc("/bad/name"), 4096), "PF_EINVAL", /character 0x2f/);
    assertNative(
      () => engine.importRegion(new Uint8Array(64).fill(0x41), 4096),
      "PF_EINVAL",
      /NUL-terminated/,
    );
    assertNative(() => engine.importRegion(new Uint8Array(10), 4096), "PF_EINVAL", /expected 64/);
    const padded = enc("/pegaflow-x");
    padded[40] = 9; // garbage after the NUL: not a handle this library wrote
    assertNative(
      () => engine.importRegion(padded, 4096),
      "PF_EINVAL",
      /byte 40 after the name is 0x09/,
    );
    // Declared larger than the real allocation.
    assertNative(
      () => engine.importRegion(region.handle, 8193),
      "PF_ERANGE",
      /declared 8193 bytes; the allocation has 8192/,
    );
    assertNative(() => engine.importRegion(region.handle, 0), "PF_EINVAL");
    // Reads/writes outside the region.
    assertNative(
      () => region.read(8000, 200),
      "PF_ERANGE",
      /offset 8000 \+ bytes 200 exceeds region size 8192/,
    );
    assertNative(() => region.write(8192, new Uint8Array(1)), "PF_ERANGE");
    // A valid import sees the exporter's bytes.
    const imp = engine.importRegion(region.handle, 8192);
    region.write(100, new Uint8Array([1, 2, 3]));
    assert.deepEqual([...imp.read(100, 3)], [1, 2, 3]);
    assert.equal(imp.info().imported, true);
    imp.close();
  } finally {
    region.close();
    engine.close();
  }
});

Deno.test("engine, pool and shm options are validated", () => {
  assert.throws(() => Engine.open({ backend: "gpu" as "auto" }), /backend "gpu"/);
  assert.equal(pf.pf_engine_open(7, 0, 0, new Uint32Array(1)), -1);
  assert.equal(pf.pf_engine_open(2, 0, 1000, new Uint32Array(1)), -1);
  const engine = Engine.open({ backend: "host" });
  try {
    assertNative(() => engine.createPool(0), "PF_EINVAL", /bytes is 0/);
    assert.equal(
      pf.pf_pool_create_split(engine.handle, 4096n, 0x80, 0, null, null, 0, new Uint32Array(1)),
      -1,
    );
    assertNative(() => engine.setKernelGrid(8), "PF_EUNSUPPORTED", /host backend/);
    assertNative(() => SharedMemory.open("nope", 64), "PF_EINVAL");
    assertNative(
      () => SharedMemory.open("/pegaflow-test-missing-shm", 64),
      "PF_EINVAL",
      /No such file/,
    );
    const pool = engine.createPool(1 << 16, { pretouch: true, touchThreads: 2 });
    assert.equal(pool.info().pretouched, true);
    assertNative(() => pool.view(60000, 10000), "PF_ERANGE", /exceeds pool size 65536/);
    pool.close();
  } finally {
    engine.close();
  }
});

Deno.test("huge pages: a clear error naming nr_hugepages when none are reserved", () => {
  const engine = Engine.open({ backend: "host" });
  try {
    const reserved = Number(Deno.readTextFileSync("/proc/sys/vm/nr_hugepages").trim());
    if (reserved === 0) {
      assertNative(
        () => engine.createPool(4 << 20, { hugepages: true }),
        "PF_ENOMEM",
        /\/proc\/sys\/vm\/nr_hugepages is 0/,
      );
    } else {
      const pool = engine.createPool(4 << 20, { hugepages: true });
      assert.equal(pool.info().hugepages, true);
      assert.ok(pool.info().hugePageBytes >= 2 << 20);
      pool.close();
    }
  } finally {
    engine.close();
  }
});

Deno.test("a cuda engine without a usable GPU fails with PF_ENODEV and auto picks host", () => {
  let cuda: Engine | undefined;
  try {
    cuda = Engine.open({ backend: "cuda" });
  } catch (e) {
    assert.ok(e instanceof NativeError);
    assert.equal(e.codeName, "PF_ENODEV", e.message);
    const auto = Engine.open({ backend: "auto" });
    assert.equal(auto.backend, "host");
    auto.close();
    return;
  }
  // A GPU is present here: the cuda engine opened; auto must pick it too.
  const auto = Engine.open({ backend: "auto" });
  assert.equal(auto.backend, "cuda");
  auto.close();
  cuda.close();
});
