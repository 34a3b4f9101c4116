/**
 * Review of the durable drop (drops.ts, pads.ts): what the drop's `fdatasync` does to the
 * counters and to what a give-up names, the ids of a drop after close, and the ring's first
 * record on a fresh file.
 *
 * - A drop's fdatasync that fails leaves its pads not durable: they were counted as written
 *   (`pegaflow_ssd_drop_pads_total`) and not as failures; now each is a failure.
 * - A drop's fdatasync that hangs held `flushWrites()` and `close()` to their deadline, which then
 *   said "no io op in the kernel" (and so did `stillOpen()`): now they name the fdatasync and
 *   the file.
 * - A prefetch read in flight when its block was dropped: a read that landed before the pad
 *   delivered the dropped bytes (committed: only the store's discard stood between them and a
 *   query), one that landed after it counted a checksum failure and warned "failed
 *   verification" (the alarm of a failing disk) naming "block  (the segment was reused)". Now
 *   both are a quiet miss, logged with the ids.
 * - A drop after close logged the block, not the file and offset of the record left unpadded.
 * - On a fresh file, a first record refused (larger than a segment) used the seq the head was
 *   opened at: every record of the first segment had an epoch no record's seq matched, and a
 *   restart lost them all (a drop's pad among them).
 */
import assert from "node:assert/strict";
import { IoOp, Uring } from "../../ffi/uring.ts";
import { type IoBatch, SsdIo } from "../../lib/ssd/io.ts";
import { SsdStalledError, type SsdTier } from "../../lib/ssd/tier.ts";
import { FP, type Harness, harness, TEST_NAMESPACE, within } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 128 * 1024;
const key = (s: string) => `${TEST_NAMESPACE}/${s}`;

/** Writes `names` (one block each, pool slot i) and waits for them. */
async function written(h: Harness, tier: SsdTier, names: string[]): Promise<string[]> {
  const keys = names.map(key);
  h.write(tier, keys.map((k, i) => (h.fill(k, i * BLOCK, BLOCK), h.block(k, i * BLOCK, BLOCK))));
  await within(tier.flushWrites(), 5_000, "the writes");
  return keys;
}

/** Replaces `Uring.prototype.sync` with `fake` until the returned call restores it. */
function fakeSync(fake: (real: (file: number) => Promise<void>, file: number) => Promise<void>) {
  const real = Uring.prototype.sync;
  Uring.prototype.sync = function (this: Uring, file: number) {
    return fake((f) => real.call(this, f), file);
  };
  return () => (Uring.prototype.sync = real);
}

Deno.test("a drop whose fdatasync fails counts its pads as failures, logged with the ids", async () => {
  const h = await harness();
  const tier = await h.openTier({ capacityBytes: 64 * MiB, segmentBytes: 4 * MiB });
  let restore = () => {};
  try {
    const [a, b] = await written(h, tier, ["sync-a", "sync-b"]);
    const at = tier.locate(a)!;
    restore = fakeSync(() => Promise.reject(new Error("pf_file_sync: PF_EIO (test)")));
    assert.equal(tier.drop([a, b]), 2);
    await within(tier.flushWrites(), 5_000, "the drop");
    restore();
    const s = tier.stats();
    assert.deepEqual([s.dropPads, s.dropPadFailures], [0, 2], "pads not synced are not durable");
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes("SSD drop not synced") &&
        l.includes(`"block":"${a}"`) && l.includes(`"namespace":"${TEST_NAMESPACE}"`) &&
        l.includes(`"path":"${at.path}"`) && l.includes(`"offset":${at.fileOffset}`) &&
        l.includes('"blocks":2') && l.includes("PF_EIO (test)")
      ),
      h.logs.join("\n"),
    );
    // The next drop syncs again and counts as written.
    const [c] = await written(h, tier, ["sync-c"]);
    assert.equal(tier.drop([c]), 1);
    await within(tier.flushWrites(), 5_000, "the next drop");
    assert.deepEqual([tier.stats().dropPads, tier.stats().dropPadFailures], [1, 2]);
  } finally {
    restore();
    await tier.close();
    await h.close();
  }
});

Deno.test("a drop whose fdatasync hangs: flush and close give up naming the fdatasync and the file; once it returns the close finishes", async () => {
  const h = await harness();
  const deadline = 300;
  const tier = await h.openTier({
    capacityBytes: 64 * MiB,
    segmentBytes: 4 * MiB,
    closeTimeoutMs: deadline,
  });
  let open = () => {};
  const gate = new Promise<void>((r) => (open = r));
  let restore = () => {};
  try {
    const [a] = await written(h, tier, ["hung-a"]);
    const path = tier.locate(a)!.path;
    let held = 0;
    restore = fakeSync(async (real, file) => {
      held++;
      await gate;
      return real(file);
    });
    assert.equal(tier.drop([a]), 1);
    const e = await within(tier.flushWrites().then(() => undefined, (e) => e), 5_000, "flush");
    assert.ok(e instanceof SsdStalledError, String(e));
    assert.equal(held, 1, "the drop's fdatasync is the call that hangs");
    const names = (text: string | undefined) =>
      !!text && text.includes("fdatasync") && text.includes(path);
    assert.ok(names(e.message), e.message);
    assert.ok(names(tier.stillOpen()), String(tier.stillOpen()));
    // close gives up at its deadline too, naming it; the engine stays open until it returns.
    await within(tier.close(), 5_000, "close");
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes("SSD close gave up") && names(l) &&
        l.includes(`"path":"${path}"`)
      ),
      h.logs.join("\n"),
    );
    assert.ok(tier.stillOpen(), "the engine waits for the fdatasync");
    open();
    await within(tier.engineClosed, 5_000, "the close, once the fdatasync returned");
    assert.equal(tier.stillOpen(), undefined);
    assert.equal(tier.stats().dropPads, 1);
  } finally {
    restore();
    open();
    await tier.close();
    await tier.engineClosed;
    await h.close();
  }
});

Deno.test("a drop after close names the record it leaves unpadded: block, namespace, path and offset", async () => {
  const h = await harness();
  try {
    const tier = await h.openTier({ capacityBytes: 64 * MiB, segmentBytes: 4 * MiB });
    const [a] = await written(h, tier, ["late"]);
    const at = tier.locate(a)!;
    await tier.close();
    assert.equal(tier.drop([a]), 1);
    assert.ok(
      h.logs.some((l) =>
        l.includes("SSD drop after close") && l.includes(`"block":"${a}"`) &&
        l.includes(`"namespace":"${TEST_NAMESPACE}"`) && l.includes(`"path":"${at.path}"`) &&
        l.includes(`"offset":${at.fileOffset}`)
      ),
      h.logs.join("\n"),
    );
  } finally {
    await h.close();
  }
});

Deno.test("a fresh file whose first record is refused (larger than a segment): the first segment's records, and a drop's pad there, come back after a restart", async () => {
  const h = await harness();
  const opts = { capacityBytes: 4 * MiB, segmentBytes: MiB };
  try {
    let tier = await h.openTier(opts);
    try {
      const big = key("too-big");
      h.fill(big, 0, 2 * MiB);
      h.write(tier, [h.block(big, 0, 2 * MiB)]);
      await within(tier.flushWrites(), 5_000, "the refused write");
      assert.equal(tier.stats().writeSkippedNoSpace, 1, "larger than a segment");
      const keys = Array.from({ length: 3 }, (_, i) => key(`first-${i}`));
      h.write(
        tier,
        keys.map((
          k,
          i,
        ) => (h.fill(k, 3 * MiB + i * BLOCK, BLOCK), h.block(k, 3 * MiB + i * BLOCK, BLOCK))),
      );
      await within(tier.flushWrites(), 5_000, "the writes");
      assert.equal(tier.drop([keys[0]]), 1, "the segment's first record");
      await within(tier.flushWrites(), 5_000, "the drop");
    } finally {
      await tier.close();
    }
    tier = await h.openTier(opts);
    try {
      assert.equal(tier.recovery.blocks, 2, "the first segment's records were lost");
      assert.equal(tier.locate(key("first-0")), undefined, "the dropped one stays dropped");
      assert.ok(tier.locate(key("first-1")) && tier.locate(key("first-2")));
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});

/** Holds io batches that `which` picks at a gate until `release()`; `held` counts them. */
function holdBatches(which: (b: IoBatch) => boolean) {
  const run = SsdIo.prototype.run;
  let release = () => {};
  const gate = new Promise<void>((r) => (release = r));
  const h = { held: 0, release, restore: () => (SsdIo.prototype.run = run) };
  SsdIo.prototype.run = async function (this: SsdIo, b: IoBatch) {
    if (which(b)) (h.held++, await gate);
    return run.call(this, b);
  };
  return h;
}
const isPadBatch = (b: IoBatch) =>
  b.kinds.every((k) => k === IoOp.WRITE) && b.numExt.every((n) => n === 0);
const isReadBatch = (b: IoBatch) => b.kinds.every((k) => k === IoOp.READ) && b.numExt[0] > 0;

for (const landsFirst of ["the read", "the pad"]) {
  Deno.test(`a drop racing a prefetch read (${landsFirst} lands first): the dropped blocks are a quiet miss, the prefix before them delivered`, async () => {
    const h = await harness();
    const tier = await h.openTier({ capacityBytes: 64 * MiB, segmentBytes: 4 * MiB });
    let hold = { held: 0, release: () => {}, restore: () => {} };
    try {
      const keys = await written(h, tier, ["r0", "r1", "r2", "r3"]);
      hold = holdBatches(landsFirst === "the read" ? isPadBatch : isReadBatch);
      const alloc = h.allocator(32 * MiB);
      assert.equal(tier.prefetch("race", keys, alloc, FP).state, "loading");
      assert.equal(tier.drop([keys[2]]), 1);
      if (landsFirst === "the pad") {
        await within(tier.flushWrites(), 5_000, "the pad"); // landed and synced
        assert.equal(hold.held, 1, "the read waits");
        hold.release();
        await within(tier.prefetchSettled("race"), 5_000, "the read");
      } else {
        await within(tier.prefetchSettled("race"), 5_000, "the read");
        assert.equal(hold.held, 1, "the pad waits");
        hold.release();
        await within(tier.flushWrites(), 5_000, "the pad");
      }
      assert.equal(tier.prefetch("race", keys, alloc, FP).state, "ready");
      assert.deepEqual([...alloc.committed.keys()], keys.slice(0, 2), "delivered up to the drop");
      assert.equal(alloc.freed, 2, "the dropped block's space and the one after it");
      const s = tier.stats();
      assert.deepEqual([s.checksumFailures, s.readFailures], [0, 0], "a drop is no damage");
      assert.ok(!h.logs.some((l) => l.includes("failed verification")), h.logs.join("\n"));
      assert.ok(
        h.logs.some((l) =>
          l.includes("dropped while it was read") && l.includes(`"block":"${keys[2]}"`) &&
          l.includes('"path"') && l.includes('"offset"')
        ),
        h.logs.join("\n"),
      );
      assert.deepEqual(keys.map((k) => !!tier.locate(k)), [true, true, false, true]);
    } finally {
      hold.restore();
      hold.release();
      await tier.close();
      await h.close();
    }
  });
}
