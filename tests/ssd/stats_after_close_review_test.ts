/**
 * `SsdTier.stats()` after `close()`: the final figures, not a throw from the
 * io_uring handle that close gave back (a /metrics scrape during shutdown
 * reads them; found by tests/ssd/model_review_test.ts).
 */
import assert from "node:assert/strict";
import { harness, TEST_NAMESPACE, within } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 64 * 1024;

Deno.test("stats() after close() answers the tier's final figures", async () => {
  const h = await harness();
  try {
    const tier = await h.openTier({ capacityBytes: 8 * MiB, segmentBytes: MiB });
    const key = `${TEST_NAMESPACE}/a`;
    h.fill(key, 0, BLOCK);
    h.write(tier, [h.block(key, 0, BLOCK)]);
    await within(tier.flushWrites(), 5_000, "the write");
    const before = tier.stats();
    await within(tier.close(), 5_000, "close");
    const after = tier.stats();
    assert.equal(after.writeBlocks, 1);
    assert.equal(after.writeBytes, BLOCK);
    assert.equal(after.alignmentFallbacks, before.alignmentFallbacks);
    assert.equal(after.writeInflight, 0);
  } finally {
    await h.close();
  }
});
