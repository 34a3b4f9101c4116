/**
 * Sizing the cache files to the filesystems under them: the files are
 * sparse, so what a filesystem promised at start is only taken as records
 * land. Every figure here is checked on a real, small tmpfs by filling the
 * whole ring and counting write failures (ENOSPC shows up only then).
 */
import assert from "node:assert/strict";
import { recordBytes } from "../../lib/ssd/format.ts";
import type { SsdTier } from "../../lib/ssd/tier.ts";
import { type IoBatch, SsdIo } from "../../lib/ssd/io.ts";
import { IoOp } from "../../ffi/uring.ts";
import { PF_STATUS } from "../../ffi/native.ts";
import { FP, type Harness, harness } from "./_harness.ts";
import { canMount, withTmpfs } from "./_tmpfs.ts";

const MiB = 1 << 20;
/** 252 KiB of payload + the 4 KiB header page: four records fill a 1 MiB segment exactly. */
const BLOCK = 252 * 1024;
const PER_SEGMENT = MiB / recordBytes(BLOCK);

/** Writes `keys` (4 per batch, one batch at a time) from one pool range. */
async function writeKeys(h: Harness, tier: SsdTier, keys: string[]): Promise<void> {
  for (let i = 0; i < keys.length; i += PER_SEGMENT) {
    h.write(tier, keys.slice(i, i + PER_SEGMENT).map((k) => h.block(k, 0, BLOCK)));
    await tier.flushWrites();
  }
}

/** As many keys as the tier's ring holds (no segment reused). */
function ringFull(tier: SsdTier, prefix: string): string[] {
  const n = (tier.stats().capacityBytes / MiB) * PER_SEGMENT;
  return Array.from({ length: n }, (_, i) => `ns/${prefix}${i}`);
}

Deno.test({
  name:
    "two cache paths on one filesystem share its free space: together they never overcommit it, and the whole ring can be written",
  ignore: !canMount,
  async fn() {
    await withTmpfs("small", "size=8m", async (h, mnt) => {
      const [a, b] = [`${mnt}/a`, `${mnt}/b`];
      await Deno.mkdir(a);
      await Deno.mkdir(b);
      const tier = await h.openTier({ paths: [a, b], capacityBytes: 64 * MiB, segmentBytes: MiB });
      try {
        assert.equal(tier.files.length, 2);
        const capacity = tier.stats().capacityBytes;
        assert.ok(capacity <= 8 * MiB - 2 * 4096, `capacity ${capacity} fits the 8 MiB filesystem`);
        const capped = h.logs.filter((l) => l.includes("capped"));
        for (const p of [a, b]) {
          assert.ok(
            capped.some((l) => l.includes(p) && l.includes(`"shared_with"`)),
            capped.join(),
          );
        }
        h.fill("pattern", 0, BLOCK);
        const keys = ringFull(tier, "k");
        await writeKeys(h, tier, keys);
        const s = tier.stats();
        assert.equal(s.writeFailures, 0, h.logs.filter((l) => l.includes("failed")).join("\n"));
        assert.equal(s.writeBlocks, keys.length);
        assert.equal(tier.lookupPrefix(keys, FP), keys.length);
      } finally {
        await tier.close();
      }
    });
  },
});

Deno.test({
  name:
    "a restart counts what a cache file holds, not its sparse size, as room: the capacity stays what the filesystem can hold",
  ignore: !canMount,
  async fn() {
    await withTmpfs("small", "size=8m", async (h, mnt) => {
      const opts = { paths: [mnt], capacityBytes: 64 * MiB, segmentBytes: MiB };
      let tier = await h.openTier(opts);
      const first = tier.stats().capacityBytes;
      h.fill("pattern", 0, BLOCK);
      const early = ringFull(tier, "e").slice(0, 2 * PER_SEGMENT);
      try {
        await writeKeys(h, tier, early);
        assert.equal(tier.stats().writeFailures, 0);
      } finally {
        await tier.close();
      }
      tier = await h.openTier(opts);
      try {
        assert.equal(tier.stats().capacityBytes, first, "the same capacity after the restart");
        assert.equal(tier.lookupPrefix(early, FP), early.length, "the records came back");
        // The rest of the ring can be written: nothing was promised that the disk lacks.
        const late = ringFull(tier, "l").slice(early.length);
        await writeKeys(h, tier, late);
        assert.equal(
          tier.stats().writeFailures,
          0,
          h.logs.filter((l) => l.includes("failed")).join("\n"),
        );
        assert.equal(tier.lookupPrefix(late, FP), late.length);
      } finally {
        await tier.close();
      }
    });
  },
});

Deno.test("a path whose superblock cannot be written gives its share to the other path", async () => {
  const h = await harness();
  const run = SsdIo.prototype.run;
  try {
    const [a, b] = [`${h.dir}/a`, `${h.dir}/b`];
    await Deno.mkdir(a);
    await Deno.mkdir(b);
    // The disk under the first path fails its superblock write (EIO), as a bad sector would.
    let failing: number | undefined;
    SsdIo.prototype.run = async function (this: SsdIo, batch: IoBatch) {
      const res = await run.call(this, batch);
      const superblock = batch.size === 1 && batch.kinds[0] === IoOp.WRITE &&
        batch.fileOffsets[0] === 0;
      if (superblock && (failing ??= batch.files[0]) === batch.files[0]) {
        [res.status[0], res.aux[0]] = [PF_STATUS.PF_EIO, 5];
      }
      return res;
    };
    const tier = await h.openTier({ paths: [a, b], capacityBytes: 16 * MiB, segmentBytes: MiB });
    SsdIo.prototype.run = run;
    try {
      assert.equal(tier.files.length, 1);
      assert.ok(tier.files[0].path.startsWith(b), tier.files[0].path);
      // 16 MiB less the superblock page: 15 segments of 1 MiB (not the 7 of an even split).
      assert.equal(tier.stats().capacityBytes, 15 * MiB);
      assert.equal((await Deno.stat(tier.files[0].path)).size, 4096 + 15 * MiB);
      assert.ok(
        h.logs.some((l) =>
          l.includes("not usable") && l.includes(`${a}/pegaflow-ssd.cache`) &&
          l.includes("superblock") && l.includes("Input/output error")
        ),
        h.logs.join("\n"),
      );
      h.fill("pattern", 0, BLOCK);
      await writeKeys(h, tier, ["ns/s0", "ns/s1"]);
      assert.equal(tier.lookupPrefix(["ns/s0", "ns/s1"], FP), 2);
    } finally {
      await tier.close();
    }
    // The next start reads the survivor's superblock as it was written last: its records stay.
    const again = await h.openTier({ paths: [b], capacityBytes: 16 * MiB, segmentBytes: MiB });
    try {
      assert.equal(again.lookupPrefix(["ns/s0", "ns/s1"], FP), 2);
    } finally {
      await again.close();
    }
  } finally {
    SsdIo.prototype.run = run;
    await h.close();
  }
});

Deno.test({
  name:
    "a cache path that is a symlink is sized to the filesystem its file lies on, not the link's",
  ignore: !canMount,
  async fn() {
    await withTmpfs("small", "size=8m", async (h, mnt) => {
      const link = `${h.dir}/cache.link`;
      await Deno.writeFile(`${mnt}/cache.bin`, new Uint8Array(0));
      await Deno.symlink(`${mnt}/cache.bin`, link);
      const tier = await h.openTier({ paths: [link], capacityBytes: 64 * MiB, segmentBytes: MiB });
      try {
        const capacity = tier.stats().capacityBytes;
        assert.ok(capacity <= 8 * MiB - 4096, `capacity ${capacity} fits the 8 MiB filesystem`);
        h.fill("pattern", 0, BLOCK);
        const keys = ringFull(tier, "s");
        await writeKeys(h, tier, keys);
        assert.equal(tier.stats().writeFailures, 0);
        assert.equal(tier.lookupPrefix(keys, FP), keys.length);
      } finally {
        await tier.close();
      }
    });
  },
});
