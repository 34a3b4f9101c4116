import assert from "node:assert/strict";
import { FP, harness } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 128 * 1024;

// Two --ssd-cache-path values that are one file (a symlink, a hard link) are one cache
// file, as the same path named twice is: the tier must not lock it twice and refuse to
// start blaming its own pid, nor split the capacity over two "files" that overwrite each
// other's segments.
for (const how of ["symlink", "hard link"] as const) {
  Deno.test(`two cache paths that are one file through a ${how} open as one file`, async () => {
    const h = await harness();
    try {
      const real = `${h.dir}/real.cache`;
      const alias = `${h.dir}/alias.cache`;
      Deno.writeFileSync(real, new Uint8Array(0));
      if (how === "symlink") Deno.symlinkSync(real, alias);
      else Deno.linkSync(real, alias);
      const opts = { capacityBytes: 32 * MiB, segmentBytes: 4 * MiB };
      const t0 = performance.now();
      const tier = await h.openTier({ ...opts, paths: [real, alias] });
      const keys = ["ns:a0", "ns:a1", "ns:a2"];
      try {
        assert.ok(performance.now() - t0 < 400, "no wait on the process's own lock");
        assert.deepEqual(tier.files.map((f) => f.path), [real]);
        assert.equal(tier.stats().capacityBytes, 7 * 4 * MiB); // the whole share, one file
        h.write(
          tier,
          keys.map((k, i) => {
            h.fill(k, i * BLOCK, BLOCK);
            return h.block(k, i * BLOCK, BLOCK);
          }),
        );
        await tier.flushWrites();
      } finally {
        await tier.close();
      }
      // Named the other way round, the alias is the one kept; the records are all there.
      const again = await h.openTier({ ...opts, paths: [alias, real] });
      try {
        assert.deepEqual(again.files.map((f) => f.path), [alias]);
        assert.equal(again.lookupPrefix(keys, FP), keys.length);
      } finally {
        await again.close();
      }
    } finally {
      await h.close();
    }
  });
}
