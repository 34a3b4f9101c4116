/**
 * Layout identity in SSD records, the on-disk format version, and the
 * rebuild's progress log (real io_uring on files in a temp dir).
 */
import assert from "node:assert/strict";
import { crc32c, FORMAT_VERSION } from "../../lib/ssd/format.ts";
import { layoutIdentity } from "../../lib/storage/layout.ts";
import type { SsdTier } from "../../lib/ssd/tier.ts";
import { FP, type Harness, harness, TEST_LAYOUT, TEST_NAMESPACE } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 128 * 1024;
/** Same bytes per block as TEST_LAYOUT, cut in two segments. */
const OTHER = layoutIdentity({
  tpSize: 1,
  ppSize: 1,
  collapseTp: false,
  layers: [{ name: "test.layer", segBytes: BLOCK / 2, numSegments: 2 }],
});

function open(h: Harness, extra: { recoveryProgressMs?: number } = {}) {
  return h.openTier({ capacityBytes: 64 * MiB, segmentBytes: 4 * MiB, ...extra });
}

async function write(h: Harness, tier: SsdTier, keys: string[], layout = TEST_LAYOUT) {
  h.write(
    tier,
    keys.map((k, i) => {
      h.fill(k, i * BLOCK, BLOCK);
      return h.block(k, i * BLOCK, BLOCK, () => true, layout);
    }),
  );
  await tier.flushWrites();
}

Deno.test("a block written by one layout is a miss for another layout of its namespace, before and after a restart", async () => {
  const h = await harness();
  try {
    const keys = Array.from({ length: 6 }, (_, i) => `${TEST_NAMESPACE}:${i}`);
    let tier = await open(h);
    try {
      await write(h, tier, keys);
      assert.notEqual(OTHER.fingerprint, FP);
      const alloc = h.allocator(32 * MiB);
      assert.equal(tier.lookupPrefix(keys, OTHER.fingerprint), 0);
      assert.deepEqual(tier.prefetch("other", keys, alloc, OTHER.fingerprint), {
        state: "miss",
        reason: "other-layout",
      });
      assert.equal(alloc.given, 0, "no pool space, no read, no bytes");
      assert.equal(tier.stats().layoutMismatches, 1);
    } finally {
      await tier.close();
    }
    tier = await open(h);
    try {
      assert.equal(tier.recovery.blocks, 6);
      assert.deepEqual(tier.storedLayouts(TEST_NAMESPACE), [
        { fingerprint: FP, summary: TEST_LAYOUT.summary, blocks: 6 },
      ]);
      const alloc = h.allocator(32 * MiB);
      assert.deepEqual(tier.prefetch("other", keys, alloc, OTHER.fingerprint), {
        state: "miss",
        reason: "other-layout",
      });
      assert.equal(alloc.given, 0);
      // The writer's layout still reads them byte-exact.
      assert.equal(tier.prefetch("same", keys, alloc, FP).state, "loading");
      await tier.prefetchSettled("same");
      assert.deepEqual([...alloc.committed.keys()], keys);
      for (const [k, [e]] of alloc.committed) assert.ok(h.holds(k, e.offset, e.bytes), k);
      // The same key saved by another layout is written too, not deduplicated away.
      await write(h, tier, keys.slice(0, 2), OTHER);
      assert.equal(tier.lookupPrefix(keys, OTHER.fingerprint), 2);
      assert.deepEqual(
        tier.storedLayouts(TEST_NAMESPACE).map((l) => [l.fingerprint, l.blocks]).sort(),
        [[FP, 4], [OTHER.fingerprint, 2]].sort(),
      );
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("a cache file of the previous on-disk format is started empty with a log naming its version, never misread", async () => {
  const h = await harness();
  try {
    const keys = Array.from({ length: 4 }, (_, i) => `ns-old/${i}`);
    let tier = await open(h);
    const path = tier.files[0].path;
    try {
      await write(h, tier, keys);
    } finally {
      await tier.close();
    }
    // Rewrite the superblock as the previous version wrote it (version 1, valid CRC).
    const f = await Deno.open(path, { read: true, write: true });
    const sb = new Uint8Array(4096);
    await f.read(sb);
    const v = new DataView(sb.buffer);
    v.setUint16(4, FORMAT_VERSION - 1, true);
    v.setUint32(60, crc32c(sb.subarray(0, 60)), true);
    await f.seek(0, Deno.SeekMode.Start);
    await f.write(sb);
    f.close();
    tier = await open(h);
    try {
      assert.equal(tier.recovery.blocks, 0);
      assert.equal(tier.lookupPrefix(keys, FP), 0);
      assert.ok(
        h.logs.some((l) =>
          l.includes(path) && l.includes(`format version ${FORMAT_VERSION - 1}`) &&
          l.includes(`this build reads ${FORMAT_VERSION}`) && l.includes("starting this file empty")
        ),
        h.logs.join("\n"),
      );
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("the index rebuild logs its progress: segments and bytes scanned, records indexed, time elapsed", async () => {
  const h = await harness();
  try {
    const keys = Array.from({ length: 40 }, (_, i) => `ns-progress/${i}`);
    let tier = await open(h);
    try {
      await write(h, tier, keys.slice(0, 20));
      await write(h, tier, keys.slice(20));
    } finally {
      await tier.close();
    }
    h.logs.length = 0;
    tier = await open(h, { recoveryProgressMs: 0 });
    try {
      assert.equal(tier.recovery.blocks, 40);
      const progress = h.logs.filter((l) => l.includes("SSD index rebuild"));
      const line =
        /SSD index rebuild( done)?: (\d+)\/(\d+) segments, (\d+)\/(\d+) bytes scanned, (\d+) records indexed from (\d+) header reads, \d+ ms elapsed/;
      assert.ok(progress.length >= 3, progress.join("\n")); // a line per round, then done
      assert.ok(progress.every((l) => line.test(l)), progress.join("\n"));
      const last = line.exec(progress[progress.length - 1])!;
      assert.equal(last[1], " done");
      assert.equal(last[2], last[3], "every segment scanned");
      assert.equal(Number(last[6]), 40);
      const counts = progress.map((l) => Number(line.exec(l)![6]));
      assert.deepEqual(counts, [...counts].sort((a, b) => a - b), "records only grow");
      assert.ok(h.logs.some((l) => l.includes("rebuilding the SSD index")), h.logs.join("\n"));
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});
