import assert from "node:assert/strict";
import { SsdOpenError } from "../../lib/ssd/tier.ts";
import { lockCacheFile } from "../../lib/ssd/file_lock.ts";
import { FP, harness } from "./_harness.ts";
import { canMount, withTmpfs } from "./_tmpfs.ts";

const MiB = 1 << 20;
const BLOCK = 256 * 1024;

Deno.test({
  name:
    "disk full: writes fail with ENOSPC, counted and logged with the path; earlier blocks still served",
  ignore: !canMount,
  async fn() {
    await withTmpfs("small", "size=8m", async (h, mnt) => {
      const tier = await h.openTier({
        paths: [mnt],
        capacityBytes: 64 * MiB,
        segmentBytes: MiB,
      });
      try {
        assert.ok(tier.stats().capacityBytes <= 8 * MiB, "capacity capped to the free space");
        assert.ok(h.logs.some((l) => l.includes("capped")), h.logs.join("\n"));
        const early = ["ns/e0", "ns/e1"];
        h.write(
          tier,
          early.map((k, i) => (h.fill(k, i * BLOCK, BLOCK), h.block(k, i * BLOCK, BLOCK))),
        );
        await tier.flushWrites();
        // Someone else fills the filesystem.
        const filler = await Deno.open(`${mnt}/filler`, { write: true, create: true });
        const chunk = new Uint8Array(MiB);
        try {
          for (;;) await filler.write(chunk);
        } catch (e) {
          assert.ok(e instanceof Error && /space/i.test(e.message), String(e));
        }
        filler.close();
        const late = Array.from({ length: 8 }, (_, i) => `ns/l${i}`);
        h.write(
          tier,
          late.map((
            k,
            i,
          ) => (h.fill(k, (4 + i) * BLOCK, BLOCK), h.block(k, (4 + i) * BLOCK, BLOCK))),
        );
        await tier.flushWrites();
        const s = tier.stats();
        assert.equal(s.writeFailures, 8);
        assert.ok(
          h.logs.some((l) =>
            l.includes("No space left on device") && l.includes(mnt) && l.includes("offset")
          ),
          h.logs.join("\n"),
        );
        assert.equal(tier.lookupPrefix(late, FP), 0, "nothing failed is indexed");
        // The tier keeps working: the early blocks are still served.
        const alloc = h.allocator(32 * MiB);
        assert.equal(tier.prefetch("r", early, alloc, FP).state, "loading");
        await tier.prefetchSettled("r");
        const a = tier.prefetch("r", early, alloc, FP);
        assert.equal(a.state, "ready");
        assert.deepEqual([...alloc.committed.keys()], early);
      } finally {
        await tier.close();
      }
    });
  },
});

Deno.test({
  name: "a read-only path is refused with the path and the reason; another path keeps the tier up",
  ignore: !canMount,
  async fn() {
    await withTmpfs("ro", "ro,size=4m", async (h, ro) => {
      await assert.rejects(
        h.openTier({
          paths: [ro],
          capacityBytes: 64 * MiB,
          segmentBytes: MiB,
        }),
        (e: unknown) =>
          e instanceof SsdOpenError && e.message.includes(ro) && /read-only/i.test(e.message),
      );
      const ok = `${h.dir}/ok`;
      await Deno.mkdir(ok);
      const tier = await h.openTier({
        paths: [ro, ok],
        capacityBytes: 16 * MiB,
        segmentBytes: MiB,
      });
      try {
        assert.equal(tier.files.length, 1);
        assert.ok(tier.files[0].path.startsWith(ok));
        h.fill("ns/x", 0, BLOCK);
        h.write(tier, [h.block("ns/x", 0, BLOCK)]);
        await tier.flushWrites();
        assert.equal(tier.lookupPrefix(["ns/x"], FP), 1);
      } finally {
        await tier.close();
      }
    });
  },
});

Deno.test("a path whose parent does not exist is refused naming it", async () => {
  const h = await harness();
  try {
    const bad = `${h.dir}/missing/dir/cache.bin`;
    await assert.rejects(
      h.openTier({
        paths: [bad],
        capacityBytes: 16 * MiB,
        segmentBytes: MiB,
      }),
      (e: unknown) => e instanceof SsdOpenError && e.message.includes(bad),
    );
  } finally {
    await h.close();
  }
});

Deno.test("an unusable path gets no share of the capacity: the usable ones hold all of it, and the log names the path", async () => {
  const h = await harness();
  try {
    const bad = `${h.dir}/missing/dir/cache.bin`;
    const ok = `${h.dir}/ok`;
    await Deno.mkdir(ok);
    const tier = await h.openTier({
      paths: [bad, ok],
      capacityBytes: 16 * MiB,
      segmentBytes: MiB,
    });
    try {
      assert.equal(tier.files.length, 1);
      // 16 MiB less the superblock page: 15 segments of 1 MiB (not the 7 of an even split).
      assert.equal(tier.stats().capacityBytes, 15 * MiB);
      assert.equal((await Deno.stat(tier.files[0].path)).size, 4096 + 15 * MiB);
      assert.ok(
        h.logs.some((l) =>
          l.includes('"level":"error"') && l.includes("not usable") && l.includes(bad)
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

Deno.test({
  name:
    "a path whose filesystem has no room for a segment gets no share: the other path holds the whole capacity",
  ignore: !canMount,
  async fn() {
    await withTmpfs("tiny", "size=512k", async (h, tiny) => {
      const ok = `${h.dir}/ok`;
      await Deno.mkdir(ok);
      const tier = await h.openTier({
        paths: [tiny, ok],
        capacityBytes: 16 * MiB,
        segmentBytes: MiB,
      });
      try {
        assert.equal(tier.files.length, 1);
        assert.ok(tier.files[0].path.startsWith(ok));
        assert.equal(tier.stats().capacityBytes, 15 * MiB);
        assert.ok(
          h.logs.some((l) =>
            l.includes("not usable") && l.includes(tiny) && l.includes("holds no 1048576-byte")
          ),
          h.logs.join("\n"),
        );
        assert.ok(h.logs.some((l) => l.includes("split over the usable paths only")));
      } finally {
        await tier.close();
      }
    });
  },
});

Deno.test("a path under a regular file is skipped naming it like any unusable path; the other path keeps the tier up", async () => {
  const h = await harness();
  try {
    const file = `${h.dir}/a-file`;
    await Deno.writeTextFile(file, "not a directory");
    const bad = `${file}/cache.bin`;
    await assert.rejects(
      h.openTier({ paths: [bad], capacityBytes: 16 * MiB, segmentBytes: MiB }),
      (e: unknown) => e instanceof SsdOpenError && e.message.includes(bad),
    );
    const ok = `${h.dir}/ok`;
    await Deno.mkdir(ok);
    const tier = await h.openTier({ paths: [bad, ok], capacityBytes: 16 * MiB, segmentBytes: MiB });
    try {
      assert.equal(tier.files.length, 1);
      assert.ok(tier.files[0].path.startsWith(ok));
      assert.ok(
        h.logs.some((l) => l.includes("not usable") && l.includes(bad)),
        h.logs.join("\n"),
      );
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("a close whose fdatasync fails still frees the ring and every file's lock, and says why", async () => {
  const h = await harness();
  try {
    const tier = await h.openTier({ capacityBytes: 8 * MiB, segmentBytes: MiB });
    const path = tier.files[0].path;
    const real = tier.files[0].handle;
    tier.files[0].handle = real + 1000; // a handle the ring does not know: its sync fails
    await assert.rejects(tier.close(), /pf_file_sync/);
    // The lock went with the close: the path can be locked again (the same process included).
    const again = await lockCacheFile(path, 0);
    await again.close();
  } finally {
    await h.close();
  }
});
