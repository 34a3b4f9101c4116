import assert from "node:assert/strict";
import fc from "fast-check";
import { SsdTier } from "../../lib/ssd/tier.ts";
import { FP, harness } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 64 * 1024;
const N = 12;

Deno.test("whatever bytes of the cache file are damaged, nothing wrong is ever served", async () => {
  const h = await harness(32 * MiB);
  const opts = {
    pool: h.pool.handle,
    ring: h.ring,
    paths: [h.dir],
    capacityBytes: 16 * MiB,
    segmentBytes: MiB,
    log: h.log,
  };
  const keys = Array.from({ length: N }, (_, i) => `ns/p${i}`);
  try {
    {
      const tier = await SsdTier.open({ ...opts, reset: true });
      h.write(
        tier,
        keys.map((k, i) => (h.fill(k, i * BLOCK, BLOCK), h.block(k, i * BLOCK, BLOCK))),
      );
      await tier.flushWrites();
      await tier.close();
    }
    const path = `${h.dir}/pegaflow-ssd.cache`;
    const pristine = await Deno.readFile(path);
    const written = 4096 + N * (4096 + BLOCK) + MiB; // superblock, records, and beyond
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.tuple(fc.nat({ max: written - 1 }), fc.integer({ min: 1, max: 255 })), {
          minLength: 1,
          maxLength: 8,
        }),
        async (flips) => {
          const damaged = pristine.slice();
          for (const [pos, x] of flips) damaged[pos] ^= x;
          await Deno.writeFile(path, damaged);
          const tier = await SsdTier.open(opts);
          try {
            const alloc = h.allocator(16 * MiB);
            const n = tier.lookupPrefix(keys, FP);
            if (n === 0) return;
            assert.equal(tier.prefetch("q", keys, alloc, FP).state, "loading");
            await tier.prefetchSettled("q");
            const a = tier.prefetch("q", keys, alloc, FP);
            assert.equal(a.state, "ready");
            const served = [...alloc.committed.keys()];
            assert.deepEqual(served, keys.slice(0, served.length), "a prefix, in order");
            for (const [key, [e]] of alloc.committed) {
              assert.ok(h.holds(key, e.offset, e.bytes), `served block ${key} is byte-exact`);
            }
            assert.equal(
              alloc.freed + served.length,
              alloc.given,
              "every undelivered allocation freed",
            );
          } finally {
            await tier.close();
          }
        },
      ),
      { numRuns: 25 },
    );
  } finally {
    await h.close();
  }
});
