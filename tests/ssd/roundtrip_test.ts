import assert from "node:assert/strict";
import { harness } from "./_harness.ts";

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
    assert.equal(tier.enqueueWrite(blocks).status, "queued");
    await tier.flushWrites();
    assert.equal(tier.stats().writeBlocks, 16);
    assert.ok(blocks.every((b) => b.pins === 0), "every pin released after the write");
    // RAM forgets them.
    h.pool.view(0, 16 * BLOCK).fill(0);
    assert.equal(tier.lookupPrefix([...keys, "ns1/absent"]), 16);
    const alloc = h.allocator(32 * MiB);
    assert.deepEqual(tier.prefetch("req-1", keys, alloc), { state: "loading" });
    assert.deepEqual(tier.prefetch("req-1", keys, alloc), { state: "loading" });
    await tier.prefetchSettled("req-1");
    const a = tier.prefetch("req-1", keys, alloc);
    assert.equal(a.state, "ready");
    if (a.state !== "ready") return;
    assert.deepEqual(a.blocks.map((b) => b.key), keys);
    for (const b of a.blocks) {
      const e = b.allocation.extents[0];
      assert.ok(h.holds(b.key, e.offset, e.bytes), `block ${b.key} byte-exact`);
    }
    const s = tier.stats();
    assert.equal(s.readBlocks, 16);
    assert.equal(s.checksumFailures, 0);
    assert.equal(s.prefetchReservedBlocks, 0, "taking the result releases the budget");
  } finally {
    await tier.close();
    await h.close();
  }
});
