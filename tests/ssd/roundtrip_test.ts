import assert from "node:assert/strict";
import { FP, harness } from "./_harness.ts";

const BLOCK = 256 * 1024;
const MiB = 1 << 20;

Deno.test("blocks written behind come back byte-exact after RAM dropped them", async () => {
  const h = await harness();
  const tier = await h.openTier({
    capacityBytes: 64 * MiB,
    segmentBytes: 4 * MiB,
  });
  try {
    const keys = Array.from({ length: 16 }, (_, i) => `ns1/block-${i}`);
    const blocks = keys.map((k, i) => {
      h.fill(k, i * BLOCK, BLOCK);
      return h.block(k, i * BLOCK, BLOCK);
    });
    assert.equal(h.write(tier, blocks).status, "queued");
    await tier.flushWrites();
    assert.equal(tier.stats().writeBlocks, 16);
    assert.ok(blocks.every((b) => b.pins === 0), "every pin released after the write");
    // RAM forgets them.
    h.pool.view(0, 16 * BLOCK).fill(0);
    assert.equal(tier.lookupPrefix([...keys, "ns1/absent"], FP), 16);
    const alloc = h.allocator(32 * MiB);
    assert.deepEqual(tier.prefetch("req-1", keys, alloc, FP), { state: "loading" });
    assert.deepEqual(tier.prefetch("req-1", keys, alloc, FP), { state: "loading" });
    await tier.prefetchSettled("req-1");
    const a = tier.prefetch("req-1", keys, alloc, FP);
    assert.deepEqual(a, { state: "ready" });
    assert.deepEqual([...alloc.committed.keys()], keys, "committed in order as they landed");
    for (const [key, [e]] of alloc.committed) {
      assert.ok(h.holds(key, e.offset, e.bytes), `block ${key} byte-exact`);
    }
    const s = tier.stats();
    assert.equal(s.readBlocks, 16);
    assert.equal(s.checksumFailures, 0);
    assert.equal(s.prefetchReservedBlocks, 0, "landed blocks no longer count against the budget");
    assert.equal(tier.hasPrefetch("req-1"), false, "a ready answer ends the request");
  } finally {
    await tier.close();
    await h.close();
  }
});
