/**
 * The prefetch's error paths on the RAM side: a commit or a free of the
 * caller's pool space that throws. Each allocation is settled once (commit
 * or free, never both), none is freed while a read may still land in it,
 * the read ends (its request answers, its budget and keys are given back),
 * and the tier keeps serving.
 */
import assert from "node:assert/strict";
import type { PrefetchAllocator } from "../../lib/ssd/prefetch.ts";
import type { SsdTier } from "../../lib/ssd/tier.ts";
import {
  FP,
  type Harness,
  harness,
  TEST_NAMESPACE,
  type TestAllocator,
  within,
} from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 64 * 1024;
const keys = Array.from({ length: 6 }, (_, i) => `${TEST_NAMESPACE}/p${i}`);

/** 4 header pages over 1 writer + 1 reader: 2 blocks per io batch, so 6 blocks are 3 batches. */
function open(h: Harness): Promise<SsdTier> {
  return h.openTier({
    capacityBytes: 32 * MiB,
    segmentBytes: MiB,
    hdrPages: 4,
    writeInflight: 1,
    prefetchInflight: 1,
  });
}

async function writeKeys(h: Harness, tier: SsdTier): Promise<void> {
  h.write(tier, keys.map((k, i) => (h.fill(k, i * BLOCK, BLOCK), h.block(k, i * BLOCK, BLOCK))));
  await tier.flushWrites();
  assert.equal(tier.stats().writeBlocks, keys.length);
}

/** Pool space freed by the tier, which its next owner fills at once with its own bytes. */
interface Reused {
  key: string;
  offset: number;
  bytes: number;
}

/**
 * `h.allocator(base)` whose commit of `commitThrows` seals the block and
 * then throws (a hook after the seal fails), and whose free of `freeThrows`
 * throws (the store refuses). Space freed is handed to a next owner at once.
 */
function faulty(
  h: Harness,
  base: number,
  faults: { commitThrows?: string; freeThrows?: string },
): { allocate: PrefetchAllocator; inner: TestAllocator; reused: Reused[] } {
  const inner = h.allocator(base);
  const reused: Reused[] = [];
  const allocate: PrefetchAllocator = (wanted) =>
    inner(wanted).map((a, i) => {
      const key = wanted[i].key;
      return {
        extents: a.extents,
        commit: () => {
          a.commit();
          if (key === faults.commitThrows) throw new Error(`the block index refused ${key}`);
        },
        free: () => {
          if (key === faults.freeThrows) throw new Error(`the store refused to free ${key}`);
          a.free();
          const [e] = a.extents;
          h.fill(`next-owner/${key}`, e.offset, e.bytes);
          reused.push({ key, offset: e.offset, bytes: e.bytes });
        },
      };
    });
  return { allocate, inner, reused };
}

/**
 * Runs `body`, then closes the tier (`tier()`: the one open now) and the
 * harness. A close that hangs fails the test without hiding `body`'s error.
 */
async function closing(h: Harness, tier: () => SsdTier, body: () => Promise<void>) {
  let error: unknown;
  try {
    await body();
  } catch (e) {
    error = e;
  }
  try {
    await within(tier().close(), 5_000, "tier.close");
    await h.close();
  } catch (e) {
    error ??= e;
  }
  if (error !== undefined) throw error;
}

/** The tier still reads: `want` is prefetched again, committed byte-exact. */
async function readsAgain(h: Harness, tier: SsdTier, reqId: string, want: string[]) {
  const alloc = h.allocator(16 * MiB);
  assert.equal(tier.prefetch(reqId, want, alloc, FP).state, "loading");
  await within(tier.prefetchSettled(reqId), 5_000, `prefetch ${reqId}`);
  assert.deepEqual([...alloc.committed.keys()], want);
  for (const [key, [e]] of alloc.committed) assert.ok(h.holds(key, e.offset, e.bytes), key);
}

Deno.test("a commit that throws ends the read: the rest is freed once, after every read of it ended, and the tier keeps serving", async () => {
  const h = await harness();
  const tier = await open(h);
  await closing(h, () => tier, async () => {
    await writeKeys(h, tier);
    const { allocate, inner, reused } = faulty(h, 8 * MiB, { commitThrows: keys[0] });
    assert.equal(tier.prefetch("r1", keys, allocate, FP).state, "loading");
    await within(tier.prefetchSettled("r1"), 5_000, "the prefetch");
    assert.deepEqual([...inner.committed.keys()], [keys[0]], "committed, never freed after");
    assert.equal(inner.freed, 5, "each block after it freed exactly once");
    assert.equal(tier.poll("r1"), "ready");
    assert.equal(tier.stats().prefetchReservedBlocks, 0);
    // Every io batch of the read was released: the 4 header pages serve a write and a read.
    h.fill(`${TEST_NAMESPACE}/later`, 40 * BLOCK, BLOCK);
    h.write(tier, [h.block(`${TEST_NAMESPACE}/later`, 40 * BLOCK, BLOCK)]);
    await within(tier.flushWrites(), 5_000, "a write after the failed commit");
    await readsAgain(h, tier, "r2", keys.slice(1));
    // No read landed in space after it was freed (its next owner's bytes are intact).
    for (const r of reused) {
      assert.ok(h.holds(`next-owner/${r.key}`, r.offset, r.bytes), `late read into ${r.key}`);
    }
    assert.equal(tier.stats().readFailures, 1, "the failed commit is counted");
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes(keys[0]) &&
        l.includes(`"namespace":"${TEST_NAMESPACE}"`) &&
        l.includes("the block index refused")
      ),
      h.logs.join("\n"),
    );
  });
});

Deno.test("a free that throws is logged, and the read still ends: the request answers, its keys and budget are given back", async () => {
  const h = await harness();
  let tier = await open(h);
  await closing(h, () => tier, async () => {
    await writeKeys(h, tier);
    // Damage block 1's payload: its read fails verification, so blocks 1..5 are freed.
    const loc = tier.locate(keys[1])!;
    await tier.close();
    const f = await Deno.open(loc.path, { read: true, write: true });
    const pos = loc.fileOffset + 4096 + 333;
    const b = new Uint8Array(1);
    await f.seek(pos, Deno.SeekMode.Start);
    await f.read(b);
    b[0] ^= 0x10;
    await f.seek(pos, Deno.SeekMode.Start);
    await f.write(b);
    f.close();
    tier = await open(h);
    const { allocate, inner } = faulty(h, 8 * MiB, { freeThrows: keys[3] });
    assert.equal(tier.prefetch("r1", keys, allocate, FP).state, "loading");
    await within(tier.prefetchSettled("r1"), 5_000, "the prefetch whose free threw");
    assert.deepEqual([...inner.committed.keys()], [keys[0]]);
    assert.equal(inner.freed, 4, "every other block after the bad one was freed");
    assert.equal(tier.poll("r1"), "ready");
    const s = tier.stats();
    assert.equal(s.checksumFailures, 1);
    assert.equal(s.prefetchReservedBlocks, 0, "the budget was given back");
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes(keys[3]) &&
        l.includes(`"namespace":"${TEST_NAMESPACE}"`) &&
        l.includes("the store refused to free")
      ),
      h.logs.join("\n"),
    );
    // The keys left the read: a new query reads them instead of joining a read that ended.
    await readsAgain(h, tier, "r2", keys.slice(2));
  });
});

Deno.test("a prefetch refused by a full queue whose free throws answers a miss, frees the rest and logs the block", async () => {
  const h = await harness();
  const tier = await h.openTier({
    capacityBytes: 32 * MiB,
    segmentBytes: MiB,
    prefetchInflight: 1,
    prefetchQueueDepth: 1,
  });
  await closing(h, () => tier, async () => {
    await writeKeys(h, tier);
    // One read runs, one waits in the queue of depth 1: the third is refused.
    assert.equal(tier.prefetch("r1", [keys[0]], h.allocator(8 * MiB), FP).state, "loading");
    assert.equal(tier.prefetch("r2", [keys[1]], h.allocator(9 * MiB), FP).state, "loading");
    const { allocate, inner } = faulty(h, 10 * MiB, { freeThrows: keys[2] });
    const a = tier.prefetch("r3", keys.slice(2), allocate, FP);
    assert.deepEqual(a, { state: "miss", reason: "queue-full" });
    assert.equal(inner.freed, 3, "every other block of the refused read was freed");
    assert.equal(tier.stats().prefetchBackpressure, 1);
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes(`"block":"${keys[2]}"`) &&
        l.includes(`"namespace":"${TEST_NAMESPACE}"`) &&
        l.includes("the store refused to free")
      ),
      h.logs.join("\n"),
    );
    await within(tier.prefetchSettled("r1"), 5_000, "r1");
    await within(tier.prefetchSettled("r2"), 5_000, "r2");
    // The refused keys were never marked as being read: they are read now.
    await readsAgain(h, tier, "r4", keys.slice(2));
  });
});

Deno.test("a prefetch after close answers a miss for closed, not for a full queue", async () => {
  const h = await harness();
  try {
    const tier = await h.openTier({ capacityBytes: 8 * 1024 * 1024, segmentBytes: 1024 * 1024 });
    await tier.close();
    const a = tier.prefetch("after-close", ["ns-test/k0"], h.allocator(0), FP);
    assert.deepEqual(a, { state: "miss", reason: "closed" });
  } finally {
    await h.close();
  }
});
