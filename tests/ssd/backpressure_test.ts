import assert from "node:assert/strict";
import { FP, harness } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 64 * 1024;

Deno.test("a full write queue drops the newest batch, counts it, and never pins its blocks", async () => {
  const h = await harness();
  const tier = await h.openTier({
    capacityBytes: 32 * MiB,
    segmentBytes: MiB,
    writeQueueDepth: 1,
    writeInflight: 1,
  });
  try {
    const batches = Array.from({ length: 5 }, (_, b) =>
      Array.from({ length: 3 }, (_, i) => {
        const k = `ns/b${b}-${i}`;
        h.fill(k, (b * 3 + i) * BLOCK, BLOCK);
        return h.block(k, (b * 3 + i) * BLOCK, BLOCK);
      }));
    const results = batches.map((b) => h.write(tier, b).status);
    // One batch runs, one waits in the queue of depth 1, the other three are dropped at once.
    assert.deepEqual(results, ["queued", "queued", "dropped", "dropped", "dropped"]);
    let s = tier.stats();
    assert.equal(s.writeQueueFullDrops, 3);
    assert.equal(s.writeQueueFullDroppedBlocks, 9);
    await tier.flushWrites();
    s = tier.stats();
    assert.equal(s.writeBlocks, 6);
    for (const b of batches.slice(2)) for (const blk of b) assert.equal(blk.pins, 0);
    assert.equal(tier.lookupPrefix(batches[2].map((b) => b.key), FP), 0);
    // A dropped batch can simply be offered again later.
    assert.equal(h.write(tier, batches[2]).status, "queued");
    assert.equal(h.write(tier, batches[0]).status, "nothing-to-write", "already on SSD");
    await tier.flushWrites();
    assert.equal(tier.lookupPrefix(batches[2].map((b) => b.key), FP), 3);
  } finally {
    await tier.close();
    await h.close();
  }
});

Deno.test("a block evicted from RAM before its write starts is skipped, not kept alive", async () => {
  const h = await harness();
  const tier = await h.openTier({
    capacityBytes: 32 * MiB,
    segmentBytes: MiB,
  });
  try {
    const resident = new Set(["ns/a", "ns/c"]);
    const blocks = ["ns/a", "ns/b", "ns/c"].map((k, i) => {
      h.fill(k, i * BLOCK, BLOCK);
      return h.block(k, i * BLOCK, BLOCK, () => resident.has(k));
    });
    h.write(tier, blocks);
    await tier.flushWrites();
    assert.equal(tier.stats().writeSkippedEvicted, 1);
    assert.equal(tier.stats().writeBlocks, 2);
    assert.ok(tier.locate("ns/a") && tier.locate("ns/c") && !tier.locate("ns/b"));
    assert.equal(blocks[1].pins, 0);
  } finally {
    await tier.close();
    await h.close();
  }
});

Deno.test("the prefetch budget bounds blocks being read under many concurrent queries; repeats join", async () => {
  const h = await harness();
  const BUDGET = 10;
  const tier = await h.openTier({
    capacityBytes: 32 * MiB,
    segmentBytes: MiB,
    maxPrefetchBlocks: BUDGET,
    prefetchInflight: 2,
    prefetchQueueDepth: 64,
  });
  try {
    const keys = Array.from({ length: 32 }, (_, i) => `ns/p${i}`);
    h.write(tier, keys.map((k, i) => (h.fill(k, i * BLOCK, BLOCK), h.block(k, i * BLOCK, BLOCK))));
    await tier.flushWrites();
    const alloc = h.allocator(8 * MiB);
    const outstanding = () => alloc.given - alloc.freed - alloc.committed.size;
    const answers: string[] = [];
    // 40 queries arrive at once, each for one of 8 disjoint 4-block prefixes.
    for (let q = 0; q < 40; q++) {
      const at = (q * 4) % 32;
      const a = tier.prefetch(`req-${q}`, keys.slice(at, at + 4), alloc, FP);
      answers.push(a.state === "miss" ? `miss:${a.reason}` : a.state);
      assert.ok(tier.stats().prefetchReservedBlocks <= BUDGET);
      assert.ok(
        outstanding() <= BUDGET,
        `pool blocks held by prefetches ${outstanding()} > ${BUDGET}`,
      );
    }
    // Reads of 4 + 4 + 2 (partial) = 10 blocks; every later query of those
    // prefixes joins the read in flight; the other 5 prefixes of each round miss.
    const loading = answers.filter((a) => a === "loading").length;
    assert.equal(loading, 3 + 3 * 4, answers.join(","));
    assert.equal(answers.filter((a) => a === "miss:budget").length, 5 * 5);
    assert.equal(alloc.given, BUDGET, "only the budget's blocks were allocated");
    assert.equal(tier.stats().prefetchPartial, 1);
    assert.equal(tier.stats().prefetchBackpressure, 25);
    for (let q = 0; q < 40; q++) await tier.prefetchSettled(`req-${q}`);
    assert.equal(tier.stats().prefetchReservedBlocks, 0, "landed blocks free the budget");
    assert.equal(alloc.committed.size, BUDGET);
    assert.equal(tier.stats().readBlocks, BUDGET, "each block was read once");
    assert.equal(tier.prefetch("req-8", [], alloc, FP).state, "ready", "a joiner is ready too");
    assert.equal(tier.prefetch("req-new", keys.slice(12, 16), alloc, FP).state, "loading");
    assert.ok(outstanding() <= BUDGET);
  } finally {
    await tier.close();
    await h.close();
  }
});

Deno.test("a prefetch nobody polls again still commits its blocks, and is forgotten after the TTL", async () => {
  const h = await harness();
  const tier = await h.openTier({
    capacityBytes: 32 * MiB,
    segmentBytes: MiB,
    prefetchTtlMs: 1,
  });
  try {
    h.fill("ns/t", 0, BLOCK);
    h.write(tier, [h.block("ns/t", 0, BLOCK)]);
    await tier.flushWrites();
    const alloc = h.allocator(8 * MiB);
    assert.equal(tier.prefetch("abandoned", ["ns/t"], alloc, FP).state, "loading");
    await tier.prefetchSettled("abandoned");
    assert.ok(alloc.committed.has("ns/t"), "committed as it landed, without a poll");
    assert.ok(h.holds("ns/t", alloc.committed.get("ns/t")![0].offset, BLOCK));
    assert.equal(tier.stats().prefetchReservedBlocks, 0);
    await new Promise((r) => setTimeout(r, 5));
    assert.equal(tier.prefetch("other", ["ns/none"], alloc, FP).state, "miss");
    assert.equal(tier.prefetch("next", ["ns/t"], alloc, FP).state, "loading");
    assert.equal(tier.stats().prefetchExpired, 1);
    assert.equal(tier.hasPrefetch("abandoned"), false);
    assert.equal(alloc.freed, 0, "nothing to free: the block is an ordinary cached block");
    await tier.prefetchSettled("next");
  } finally {
    await tier.close();
    await h.close();
  }
});
