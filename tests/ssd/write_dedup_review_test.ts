/**
 * Write-behind skips a key named twice in one batch: one record, one pin,
 * the second counted as a duplicate (found by tests/ssd/model_review_test.ts).
 */
import assert from "node:assert/strict";
import { recordBytes } from "../../lib/ssd/format.ts";
import { FP, harness, TEST_NAMESPACE, within } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 64 * 1024;

Deno.test("a key twice in one write batch is written once and counted as a duplicate", async () => {
  const h = await harness();
  const tier = await h.openTier({ capacityBytes: 8 * MiB, segmentBytes: MiB });
  try {
    const k = `${TEST_NAMESPACE}/twice`;
    const j = `${TEST_NAMESPACE}/once`;
    h.fill(k, 0, BLOCK);
    h.fill(j, BLOCK, BLOCK);
    const blocks = [h.block(k, 0, BLOCK), h.block(k, 0, BLOCK), h.block(j, BLOCK, BLOCK)];
    let pinned: string[] = [];
    const batch = h.batch(blocks);
    const r = tier.enqueueWrite({
      blocks,
      pin(fresh) {
        pinned = fresh.map((b) => b.key);
        return batch.pin(fresh);
      },
    });
    assert.deepEqual(r, { status: "queued", blocks: 2, duplicates: 1 });
    await within(tier.flushWrites(), 5_000, "the write");
    assert.deepEqual(pinned, [k, j], "each block pinned once");
    const s = tier.stats();
    assert.equal(s.writeBlocks, 2, "one record per key");
    assert.equal(s.writeBytes, 2 * BLOCK);
    assert.equal(tier.lookupPrefix([k, j], FP), 2);
    // No second record of k between the two: j follows k's one record.
    assert.equal(
      tier.locate(j)!.fileOffset,
      tier.locate(k)!.fileOffset + recordBytes(BLOCK),
      "no space taken by a second record of the same key",
    );
    for (const b of blocks) assert.equal(b.pins, 0);
  } finally {
    await tier.close();
    await h.close();
  }
});
