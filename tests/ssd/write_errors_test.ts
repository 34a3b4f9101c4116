/**
 * Write-behind when a whole io batch fails (the engine refuses it before
 * anything is written): each of its blocks is counted and logged with its
 * ids, the batch's pin is released only once every write of the batch
 * ended, the segment space is given back, and later writes go on.
 */
import assert from "node:assert/strict";
import type { SsdTier } from "../../lib/ssd/tier.ts";
import { type IoBatch, SsdIo } from "../../lib/ssd/io.ts";
import { PAGE_BYTES } from "../../lib/ssd/format.ts";
import { IoOp } from "../../ffi/uring.ts";
import { PF_STATUS } from "../../ffi/native.ts";
import { Registry } from "prom-client";
import { registerSsdMetrics } from "../../lib/ssd/metrics.ts";
import { FP, type Harness, harness, TEST_NAMESPACE, type TestBlock, within } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 64 * 1024;

/**
 * 4 header pages over 1 writer + 1 reader: 2 blocks per io batch. The 3 segments of 1 MiB
 * (the superblock takes a page) hold 45 records of 64 KiB.
 */
const TWO_BLOCK_BATCHES = {
  capacityBytes: 4 * MiB,
  segmentBytes: MiB,
  hdrPages: 4,
  writeInflight: 1,
  prefetchInflight: 1,
};

/** Keys under `prefix`, and a block of `BLOCK` bytes at pool offset `at` filled from its key. */
function filled(h: Harness, prefix: string) {
  const key = (s: string) => `${TEST_NAMESPACE}/${prefix}-${s}`;
  const block = (s: string, at: number) => (h.fill(key(s), at, BLOCK), h.block(key(s), at, BLOCK));
  return { key, block };
}

Deno.test("a refused write batch is counted and logged per block, its pin outlives the batch's other writes, and writing goes on", async () => {
  const h = await harness(); // a 64 MiB pool
  // 45 records a ring (TWO_BLOCK_BATCHES): the writes after the failure wrap it.
  const tier = await h.openTier(TWO_BLOCK_BATCHES);
  try {
    const key = (s: string) => `${TEST_NAMESPACE}/${s}`;
    // The first block's bytes lie outside the pool: its io batch (with "a") is refused whole.
    const blocks = [h.block(key("bad"), 80 * MiB, BLOCK)];
    for (const [i, s] of ["a", "b", "c"].entries()) {
      h.fill(key(s), i * BLOCK, BLOCK);
      blocks.push(h.block(key(s), i * BLOCK, BLOCK));
    }
    const batch = h.batch(blocks);
    let writtenAtRelease: boolean[] | undefined;
    tier.enqueueWrite({
      blocks,
      pin(fresh: readonly TestBlock[]) {
        const pinned = batch.pin(fresh);
        return {
          extents: pinned.extents,
          release() {
            writtenAtRelease = ["b", "c"].map((s) => tier.locate(key(s)) !== undefined);
            pinned.release();
          },
        };
      },
    });
    await within(tier.flushWrites(), 5_000, "the failed batch");
    assert.deepEqual(writtenAtRelease, [true, true], "the pin outlived every write of its batch");
    for (const b of blocks) assert.equal(b.pins, 0, `${b.key} unpinned`);
    let s = tier.stats();
    assert.equal(s.writeBlocks, 2, "the other io batch was written");
    assert.equal(s.writeFailures, 2, "each block of the refused batch is counted");
    assert.equal(tier.lookupPrefix([key("bad")], FP) + tier.lookupPrefix([key("a")], FP), 0);
    for (const k of [key("bad"), key("a")]) {
      assert.ok(
        h.logs.some((l) =>
          l.includes('"level":"error"') && l.includes(`"block":"${k}"`) &&
          l.includes(`"namespace":"${TEST_NAMESPACE}"`) && l.includes('"path"') &&
          l.includes('"offset"') && l.includes("is empty or outside the pool")
        ),
        h.logs.join("\n"),
      );
    }
    // Writing goes on, and the failed records' segment is reused when the ring wraps.
    const more = Array.from(
      { length: 70 },
      (_, i) => h.block(key(`m${i}`), (8 + i) * BLOCK, BLOCK),
    );
    for (let i = 0; i < more.length; i += 10) h.write(tier, more.slice(i, i + 10));
    await within(tier.flushWrites(), 10_000, "the writes after the failure");
    s = tier.stats();
    assert.equal(s.writeBlocks, 72);
    assert.equal(s.writeSkippedNoSpace, 0, "no segment was left busy by the failed batch");
    assert.ok(s.segmentsReused >= 3, `the ring wrapped (${s.segmentsReused} segment moves)`);
  } finally {
    await tier.close();
    await h.close();
  }
});

Deno.test("a write batch whose pin throws is counted and logged per batch with its ids, and the next batch is written", async () => {
  const h = await harness();
  const tier = await h.openTier({ capacityBytes: 8 * MiB, segmentBytes: MiB });
  try {
    const blocks = ["x", "y"].map((s, i) => h.block(`${TEST_NAMESPACE}/${s}`, i * BLOCK, BLOCK));
    tier.enqueueWrite({
      blocks,
      pin() {
        throw new Error("the store refused the transfer lock");
      },
    });
    await within(tier.flushWrites(), 5_000, "the unpinned batch");
    assert.equal(tier.stats().writeFailures, 2);
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes(`"block":"${TEST_NAMESPACE}/x"`) &&
        l.includes(`"namespace":"${TEST_NAMESPACE}"`) && l.includes('"blocks":2') &&
        l.includes("the store refused the transfer lock")
      ),
      h.logs.join("\n"),
    );
    // The keys were not left queued: the same blocks are written when offered again.
    assert.equal(h.write(tier, blocks).status, "queued");
    await within(tier.flushWrites(), 5_000, "the batch offered again");
    assert.equal(tier.stats().writeBlocks, 2);
  } finally {
    await tier.close();
    await h.close();
  }
});

Deno.test("a failed record write seals its segment: blocks written after it land in the next one and survive a restart", async () => {
  const h = await harness();
  const opts = TWO_BLOCK_BATCHES;
  const { key, block } = filled(h, "seal");
  let tier: SsdTier | undefined;
  try {
    tier = await h.openTier(opts);
    h.write(tier, [block("a", 0)]);
    await within(tier.flushWrites(), 5_000, "a");
    // Its bytes lie outside the pool: the record is never written, a hole in the segment.
    h.write(tier, [h.block(key("bad"), 80 * MiB, BLOCK)]);
    await within(tier.flushWrites(), 5_000, "the failed write");
    assert.equal(tier.stats().writeFailures, 1);
    h.write(tier, [block("b", BLOCK), block("c", 2 * BLOCK)]);
    await within(tier.flushWrites(), 5_000, "the writes after it");
    const segment = (t: SsdTier, s: string) => Math.floor(t.locate(key(s))!.fileOffset / MiB);
    assert.notEqual(segment(tier, "b"), segment(tier, "a"), "b was placed past the hole");
    await tier.close();
    // b and c lie in the next segment, past no gap.
    tier = await h.openTier(opts);
    assert.equal(tier.lookupPrefix([key("a")], FP), 1);
    assert.equal(
      tier.lookupPrefix([key("b"), key("c")], FP),
      2,
      "b and c were lost at the restart",
    );
  } finally {
    await tier?.close(); // idempotent
    await h.close();
  }
});

Deno.test("records of a batch placed after a failed write in its segment are served before and after a restart; the failed ones never", async () => {
  const h = await harness();
  // 2 blocks per io batch (TWO_BLOCK_BATCHES): the batch below is written as two io batches
  // placed one after the other in the same segment.
  const opts = TWO_BLOCK_BATCHES;
  const { key, block } = filled(h, "gap");
  let tier: SsdTier | undefined;
  try {
    tier = await h.openTier(opts);
    // "bad"'s bytes lie outside the pool: its io batch (with "a") is refused whole, a gap
    // at the segment's start; "c" and "d" are written after it in the same segment.
    h.write(tier, [
      block("a", 0),
      h.block(key("bad"), 80 * MiB, BLOCK),
      block("c", BLOCK),
      block("d", 2 * BLOCK),
    ]);
    await within(tier.flushWrites(), 5_000, "the batch with the failed write");
    assert.equal(tier.stats().writeFailures, 2);
    const wrote = ["c", "d"].map(key);
    const failed = ["a", "bad"].map(key);
    assert.equal(tier.lookupPrefix(wrote, FP), 2, "c and d are served before the restart");
    for (const k of failed) assert.equal(tier.lookupPrefix([k], FP), 0, `${k} was not written`);
    const before = wrote.map((k) => tier!.locate(k));
    await tier.close();
    tier = await h.openTier(opts);
    assert.equal(tier.lookupPrefix(wrote, FP), 2, "c and d were lost at the restart");
    assert.deepEqual(wrote.map((k) => tier!.locate(k)), before, "found where they were written");
    for (const k of failed) assert.equal(tier.lookupPrefix([k], FP), 0, `${k} came back`);
    const alloc = h.allocator(32 * MiB);
    assert.equal(tier.prefetch("r", wrote, alloc, FP).state, "loading");
    await within(tier.prefetchSettled("r"), 5_000, "the read after the restart");
    assert.deepEqual([...alloc.committed.keys()], wrote);
    for (const k of wrote) {
      const [e] = alloc.committed.get(k)!;
      assert.ok(h.holds(k, e.offset, BLOCK), `${k} read back byte-exact`);
    }
    // Writing goes on after the restart, and those records come back too.
    h.write(tier, [block("e", 3 * BLOCK)]);
    await within(tier.flushWrites(), 5_000, "a write after the restart");
    await tier.close();
    tier = await h.openTier(opts);
    assert.equal(tier.lookupPrefix([...wrote, key("e")], FP), 3);
  } finally {
    await tier?.close(); // idempotent
    await h.close();
  }
});

Deno.test("a pad that cannot be written over a failed record is logged with its path and offset; the records after it are still served", async () => {
  const h = await harness();
  const opts = TWO_BLOCK_BATCHES;
  const { key, block } = filled(h, "nopad");
  const tier = await h.openTier(opts);
  const run = SsdIo.prototype.run;
  try {
    // The disk refuses every header-only write (a pad) with EIO.
    SsdIo.prototype.run = async function (this: SsdIo, batch: IoBatch) {
      const res = await run.call(this, batch);
      if (batch.numExt.every((n) => n === 0) && batch.kinds.every((k) => k === IoOp.WRITE)) {
        for (let i = 0; i < res.status.length; i++) {
          [res.status[i], res.aux[i]] = [PF_STATUS.PF_EIO, 5];
        }
      }
      return res;
    };
    h.write(tier, [
      block("a", 0),
      h.block(key("bad"), 80 * MiB, BLOCK),
      block("c", BLOCK),
      block("d", 2 * BLOCK),
    ]);
    await within(tier.flushWrites(), 5_000, "the batch with the failed write");
    assert.equal(tier.lookupPrefix([key("c"), key("d")], FP), 2, "c and d are served");
    const path = tier.locate(key("c"))!.path;
    for (
      const [k, offset] of [[key("a"), PAGE_BYTES], [key("bad"), PAGE_BYTES + BLOCK + PAGE_BYTES]]
    ) {
      assert.ok(
        h.logs.some((l) =>
          l.includes("could not be padded") && l.includes(`"block":"${k}"`) &&
          l.includes(`"path":"${path}"`) && l.includes(`"offset":${offset}`) &&
          l.includes("Input/output error")
        ),
        h.logs.join("\n"),
      );
    }
  } finally {
    SsdIo.prototype.run = run;
    await tier.close();
    await h.close();
  }
});

Deno.test("pads written over failed records, and pads that could not be written, are counted and exported on /metrics", async () => {
  const h = await harness();
  const opts = TWO_BLOCK_BATCHES;
  const { key, block } = filled(h, "padcount");
  const tier = await h.openTier(opts);
  const registry = new Registry();
  registerSsdMetrics(registry, () => tier.stats());
  const scrape = async () => {
    await new Promise((r) => setTimeout(r, 5)); // past the per-scrape snapshot
    const text = await registry.metrics();
    const value = (name: string) =>
      Number(text.split("\n").find((l) => l.startsWith(`${name} `))?.split(" ")[1]);
    return [value("pegaflow_ssd_write_pads_total"), value("pegaflow_ssd_write_pad_failures_total")];
  };
  const run = SsdIo.prototype.run;
  try {
    assert.deepEqual(await scrape(), [0, 0]);
    // "bad"'s bytes lie outside the pool: its io batch (with "a") is refused whole, two gaps.
    h.write(tier, [block("a", 0), h.block(key("bad"), 80 * MiB, BLOCK), block("c", BLOCK)]);
    await within(tier.flushWrites(), 5_000, "the first failed batch");
    let s = tier.stats();
    assert.deepEqual([s.writeFailures, s.writePads, s.writePadFailures], [2, 2, 0]);
    assert.deepEqual(await scrape(), [2, 0]);
    // The disk now refuses every header-only write (a pad) with EIO.
    SsdIo.prototype.run = async function (this: SsdIo, batch: IoBatch) {
      const res = await run.call(this, batch);
      if (batch.numExt.every((n) => n === 0) && batch.kinds.every((k) => k === IoOp.WRITE)) {
        for (let i = 0; i < res.status.length; i++) {
          [res.status[i], res.aux[i]] = [PF_STATUS.PF_EIO, 5];
        }
      }
      return res;
    };
    h.write(tier, [h.block(key("bad2"), 80 * MiB, BLOCK)]);
    await within(tier.flushWrites(), 5_000, "the second failed batch");
    s = tier.stats();
    assert.deepEqual([s.writeFailures, s.writePads, s.writePadFailures], [3, 2, 1]);
    assert.deepEqual(await scrape(), [2, 1]);
  } finally {
    SsdIo.prototype.run = run;
    await tier.close();
    await h.close();
  }
});
