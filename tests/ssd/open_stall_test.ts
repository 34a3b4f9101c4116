/**
 * A disk that hangs while the SSD tier opens (superblock io, the index
 * rebuild). The seam holds back the SSD's completion records on their way
 * from the ring to the tier, as tests/ssd/stall_test.ts does. `open()` must
 * give up at the stall deadline with an `SsdOpenError` (so the server starts
 * without the tier) naming the path and offset that hung, must not close the
 * engine under the kernel, and must close the engine and release the file's
 * lock once the kernel completes the io.
 */
import assert from "node:assert/strict";
import { SsdOpenError, SsdOpenStalledError, type SsdTierOptions } from "../../lib/ssd/tier.ts";
import { FP, type Harness, harness, holdingRing, TEST_NAMESPACE, within } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 64 * 1024;

/** A tier of 8 MiB in 1 MiB segments on `ring` (the harness's, or one that holds io back). */
function open(h: Harness, ring: SsdTierOptions["ring"], o: Partial<SsdTierOptions> = {}) {
  return h.openTier({ ring, capacityBytes: 8 * MiB, segmentBytes: MiB, ...o });
}

const key = (s: string) => `${TEST_NAMESPACE}/${s}`;

Deno.test("a disk that hangs during the index rebuild: open gives up at the stall deadline naming the path and offset, and the engine and lock close once the kernel completes the io", async () => {
  const h = await harness();
  try {
    const first = await open(h, h.ring);
    h.fill(key("a"), 0, BLOCK);
    h.write(first, [h.block(key("a"), 0, BLOCK)]);
    await within(first.flushWrites(), 5_000, "the first write");
    const path = first.files[0].path;
    await first.close();
    // Hold every SSD completion from the moment the rebuild starts.
    const rebuilding = () => h.logs.some((l) => l.includes("rebuilding the SSD index"));
    const { ring, held } = holdingRing(h.ring, rebuilding);
    const opened = open(h, ring, { ioStallMs: 200 });
    const err = await within(opened.catch((e) => e), 5_000, "open on a hung disk");
    assert.ok(err instanceof SsdOpenError, String(err));
    assert.ok(err instanceof SsdOpenStalledError);
    assert.match(err.message, /stalled/);
    assert.ok(err.message.includes(path), err.message);
    assert.match(err.message, /read of .* at offset \d+/);
    assert.ok(err.stillOpen(), "the engine waits for the kernel");
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes("SSD open stalled") &&
        l.includes(`"path":"${path}"`) && l.includes('"offset":') && l.includes('"op":"read"')
      ),
      h.logs.join("\n"),
    );
    // The kernel completes: the engine and the lock go, a new tier opens and finds the block.
    held.release();
    await within(err.engineClosed, 5_000, "the abandoned engine closing");
    assert.equal(err.stillOpen(), undefined);
    assert.ok(h.logs.some((l) => l.includes("SSD open abandoned")), h.logs.join("\n"));
    const again = await open(h, h.ring);
    try {
      assert.equal(again.lookupPrefix([key("a")], FP), 1);
    } finally {
      await again.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("a disk that hangs on the last round of the index rebuild: once open gave up, the rebuild's end builds no tier and logs nothing recovered", async () => {
  const h = await harness();
  try {
    // No records: the rebuild is one round of header reads (all chains end on empty space).
    await (await open(h, h.ring)).close();
    const before = h.logs.length;
    const rebuilding = () => h.logs.slice(before).some((l) => l.includes("rebuilding the SSD"));
    const { ring, held } = holdingRing(h.ring, rebuilding);
    const err = await within(
      open(h, ring, { ioStallMs: 200 }).catch((e) => e),
      5_000,
      "open on a hung disk",
    );
    assert.ok(err instanceof SsdOpenStalledError, String(err));
    assert.match(err.message, /read of .* at offset \d+/);
    const logged = h.logs.length;
    held.release();
    await within(err.engineClosed, 5_000, "the abandoned engine closing");
    const after = h.logs.slice(logged);
    // Before, the round's completion ended the rebuild: "done", a tier built and "recovered".
    for (const said of ["SSD index rebuild done", "SSD index recovered"]) {
      assert.ok(!after.some((l) => l.includes(said)), `"${said}" after the give-up:\n${after}`);
    }
    assert.ok(after.some((l) => l.includes("SSD open abandoned")), after.join("\n"));
    await (await open(h, h.ring)).close();
  } finally {
    await h.close();
  }
});

Deno.test("a disk that hangs on the superblock write of a new cache file: open gives up at the stall deadline", async () => {
  const h = await harness();
  try {
    const { ring, held } = holdingRing(h.ring, () => true);
    const err = await within(
      open(h, ring, { ioStallMs: 200 }).catch((e) => e),
      5_000,
      "open on a hung disk",
    );
    assert.ok(err instanceof SsdOpenStalledError, String(err));
    assert.match(err.message, /write of .*pegaflow-ssd\.cache at offset 0/);
    const logged = h.logs.length;
    held.release();
    await within(err.engineClosed, 5_000, "the abandoned engine closing");
    // Nothing of the open went on once it gave up: before, the write's completion let it
    // rebuild the (empty) index, build a tier and log it recovered after it had given up.
    const after = h.logs.slice(logged);
    for (const said of ["rebuilding the SSD index", "SSD index rebuild", "SSD index recovered"]) {
      assert.ok(!after.some((l) => l.includes(said)), `"${said}" after the give-up:\n${after}`);
    }
    assert.ok(after.some((l) => l.includes("SSD open abandoned")), after.join("\n"));
    const again = await open(h, h.ring);
    await again.close();
  } finally {
    await h.close();
  }
});

Deno.test("a disk that hangs on the superblock read of an existing cache file: once open gave up, nothing of it goes on (no statvfs, no ftruncate, no path dropped as unusable), and what it opened closes once the io completes", async () => {
  const h = await harness();
  try {
    const first = await open(h, h.ring);
    const path = first.files[0].path;
    await first.close();
    const size = (await Deno.stat(path)).size;
    // Asked for twice the capacity: an open that went on would grow the file (ftruncate).
    const { ring, held } = holdingRing(h.ring, () => true);
    const err = await within(
      open(h, ring, { ioStallMs: 200, capacityBytes: 16 * MiB }).catch((e) => e),
      5_000,
      "open on a hung disk",
    );
    assert.ok(err instanceof SsdOpenStalledError, String(err));
    assert.match(err.message, /read of .*pegaflow-ssd\.cache at offset 0/);
    const logged = h.logs.length;
    held.release();
    await within(err.engineClosed, 5_000, "the abandoned engine closing");
    assert.equal(err.stillOpen(), undefined);
    assert.equal((await Deno.stat(path)).size, size, "the abandoned open sized the file");
    const after = h.logs.slice(logged);
    for (
      const said of [
        "not usable",
        "capacity capped",
        "capacity split",
        "rebuilding the SSD index",
        "SSD index recovered",
      ]
    ) {
      assert.ok(!after.some((l) => l.includes(said)), `"${said}" after the give-up:\n${after}`);
    }
    assert.ok(after.some((l) => l.includes("SSD open abandoned")), after.join("\n"));
    // The lock is free and the file's records are kept: the next open uses it as it was.
    const again = await open(h, h.ring);
    try {
      assert.equal(again.files[0].path, path);
    } finally {
      await again.close();
    }
  } finally {
    await h.close();
  }
});
