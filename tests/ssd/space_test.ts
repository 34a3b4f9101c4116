import assert from "node:assert/strict";
import { SsdIndex } from "../../lib/ssd/index.ts";
import { SegmentRing } from "../../lib/ssd/space.ts";
import { SsdTier } from "../../lib/ssd/tier.ts";
import { FP, harness } from "./_harness.ts";

const MiB = 1 << 20;

Deno.test("segment ring: interleaves files, reuses the oldest segment and drops its keys first", () => {
  const index = new SsdIndex();
  const ring = new SegmentRing(
    [{ segments: 2 }, { segments: 2 }],
    16384,
    (seg) => index.dropSegment(seg),
  );
  assert.deepEqual(ring.segments.map((s) => [s.file, s.fileOffset]), [[0, 4096], [1, 4096], [
    0,
    20480,
  ], [1, 20480]]);
  ring.resume(1);
  let seq = 1;
  const put = (key: string) => {
    const a = ring.allocate(8192, seq);
    assert.ok(typeof a !== "string");
    a.segment.inflightWrites--;
    index.put(key, {
      segment: a.segment,
      fileOffset: a.fileOffset,
      payloadBytes: 4096,
      payloadCrc: 0,
      seq: seq++,
      namespace: "ns",
      layout: "0".repeat(32),
    });
    return a;
  };
  const first = put("k0");
  put("k1"); // fills segment 0
  const third = put("k2"); // segment 1 (file 1)
  assert.equal(third.segment.file, 1);
  for (let i = 3; i < 8; i++) put(`k${i}`); // segments 1..3 full
  assert.equal(index.size, 8);
  put("k8"); // wraps: segment 0 (k0, k1) is dropped first
  // One overwrite: the moves into segments 1..3, filled for the first time, drop nothing.
  assert.equal(ring.reuses, 1);
  assert.equal(index.has("k0"), false);
  assert.equal(index.has("k1"), false);
  assert.equal(index.has("k8"), true);
  assert.equal(index.get("k8")!.fileOffset, first.fileOffset);
  assert.equal(ring.allocate(16384 + 4096, seq), "record-larger-than-segment");
});

Deno.test("segment ring: a segment with a write in flight is never reused", () => {
  const ring = new SegmentRing([{ segments: 1 }], 8192, () => {});
  ring.resume(1);
  const a = ring.allocate(8192, 1);
  assert.ok(typeof a !== "string");
  assert.equal(ring.allocate(8192, 2), "next-segment-busy");
  a.segment.inflightWrites--;
  assert.ok(typeof ring.allocate(8192, 3) !== "string");
});

Deno.test("two cache paths: writes spread over both, the ring wraps oldest first, a restart recovers both", async () => {
  const h = await harness(32 * MiB);
  const dirs = [`${h.dir}/a`, `${h.dir}/b`];
  for (const d of dirs) await Deno.mkdir(d);
  const BLOCK = 256 * 1024;
  const opts = {
    pool: h.pool.handle,
    ring: h.ring,
    paths: dirs,
    capacityBytes: 8 * MiB + 2 * 4096,
    segmentBytes: MiB,
    log: h.log,
  };
  let tier = await SsdTier.open(opts);
  try {
    assert.equal(tier.files.length, 2);
    assert.equal(tier.stats().capacityBytes, 8 * MiB);
    // 8 segments × 3 records (256 KiB + 4 KiB header, padded) = 24 records fit; write 40.
    const keys = Array.from({ length: 40 }, (_, i) => `ns/w${i}`);
    for (let i = 0; i < keys.length; i++) {
      const off = (i % 16) * BLOCK;
      h.fill(keys[i], off, BLOCK);
      h.write(tier, [h.block(keys[i], off, BLOCK)]);
      await tier.flushWrites();
    }
    const s = tier.stats();
    assert.equal(s.writeBlocks, 40);
    assert.ok(s.segmentsReused > 0);
    assert.equal(tier.lookupPrefix(keys.slice(0, 10), FP), 0, "the oldest blocks were overwritten");
    assert.ok(tier.lookupPrefix(keys.slice(24), FP) === 16, "the newest are all held");
    const paths = new Set(keys.slice(24).map((k) => tier.locate(k)!.path));
    assert.equal(paths.size, 2, "records on both paths");
  } finally {
    await tier.close();
  }
  tier = await SsdTier.open(opts);
  try {
    const held = tier.recovery.blocks;
    assert.ok(held >= 16 && held <= 24, `recovered ${held}`);
    const keys = Array.from({ length: 16 }, (_, i) => `ns/w${24 + i}`);
    assert.equal(tier.lookupPrefix(keys, FP), 16);
    const alloc = h.allocator(16 * MiB);
    assert.equal(tier.prefetch("r", keys, alloc, FP).state, "loading");
    await tier.prefetchSettled("r");
    const a = tier.prefetch("r", keys, alloc, FP);
    assert.equal(a.state, "ready");
    assert.equal(alloc.committed.size, 16);
    for (const [key, [e]] of alloc.committed) assert.ok(h.holds(key, e.offset, e.bytes), key);
  } finally {
    await tier.close();
    await h.close();
  }
});
