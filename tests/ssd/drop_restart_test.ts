/**
 * A drop (a Save's discard: the block's bytes are wrong) outlives a restart. Before, `drop`
 * forgot the keys in the in-memory index only: the records stayed on disk with valid headers,
 * and the next start's index rebuild indexed them again and served the garbage. Now a pad
 * (format.ts) is written over each dropped record's header page, so the scan steps over it; a
 * write of a dropped key still in flight is padded when it lands, and one still queued is not
 * written; a later save of the key with good bytes is a new record, and that one comes back.
 */
import assert from "node:assert/strict";
import type { SsdTier } from "../../lib/ssd/tier.ts";
import { type IoBatch, SsdIo } from "../../lib/ssd/io.ts";
import { IoOp, Uring } from "../../ffi/uring.ts";
import { PF_STATUS } from "../../ffi/native.ts";
import { FP, type Harness, harness, TEST_NAMESPACE, within } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 128 * 1024;
const key = (s: string | number) => `${TEST_NAMESPACE}/${s}`;

function open(h: Harness, extra: { writeInflight?: number } = {}) {
  return h.openTier({ capacityBytes: 64 * MiB, segmentBytes: 4 * MiB, ...extra });
}

/** Runs `body` on a tier opened on `h`'s files, and closes it (also when `body` throws). */
async function withTier<T>(
  h: Harness,
  body: (tier: SsdTier) => Promise<T>,
  extra: { writeInflight?: number } = {},
): Promise<T> {
  const tier = await open(h, extra);
  try {
    return await body(tier);
  } finally {
    await tier.close();
  }
}

/**
 * Offers `keys` for writing, each block's bytes at pool slot `slot + i` filled from
 * `${key}${tag}` (so a re-save's bytes differ from the first save's).
 */
function offer(h: Harness, tier: SsdTier, keys: string[], tag = "", slot = 0) {
  return h.write(
    tier,
    keys.map((k, i) => {
      h.fill(k + tag, (slot + i) * BLOCK, BLOCK);
      return h.block(k, (slot + i) * BLOCK, BLOCK);
    }),
  );
}

/** Reads `keys` back from SSD: the keys committed, and whether each holds `${key}${tag}`. */
async function fetch(h: Harness, tier: SsdTier, req: string, keys: string[], tag = "") {
  const alloc = h.allocator(32 * MiB);
  if (tier.prefetch(req, keys, alloc, FP).state !== "loading") return { keys: [], exact: true };
  await within(tier.prefetchSettled(req), 5_000, `prefetch ${req}`);
  assert.equal(tier.prefetch(req, keys, alloc, FP).state, "ready");
  const exact = [...alloc.committed].every(([k, [e]]) => h.holds(k + tag, e.offset, e.bytes));
  return { keys: [...alloc.committed.keys()], exact };
}

/** Counts the io batches and fdatasyncs the tier issues while `body` runs. */
async function counting<T>(body: () => Promise<T>) {
  const run = SsdIo.prototype.run, sync = Uring.prototype.sync;
  const seen = { batches: 0, syncs: 0 };
  SsdIo.prototype.run = function (this: SsdIo, b: IoBatch) {
    seen.batches++;
    return run.call(this, b);
  };
  Uring.prototype.sync = function (this: Uring, file: number) {
    seen.syncs++;
    return sync.call(this, file);
  };
  try {
    return { value: await body(), ...seen };
  } finally {
    SsdIo.prototype.run = run;
    Uring.prototype.sync = sync;
  }
}

Deno.test("dropped blocks are misses after a restart, the others are served byte-exact", async () => {
  const h = await harness();
  try {
    const keys = Array.from({ length: 12 }, (_, i) => key(`d${i}`));
    // The segment's first record, two in a row, the last: 4 records, in one segment with the
    // kept ones between and after.
    const gone = [keys[0], keys[4], keys[5], keys[11]];
    const kept = keys.filter((k) => !gone.includes(k));
    await withTier(h, async (tier) => {
      offer(h, tier, keys);
      await tier.flushWrites();
      // With a key never written and another namespace's key.
      const c = await counting(async () => {
        const n = tier.drop([...gone, key("never-written"), "other-ns/d1"]);
        await tier.flushWrites();
        return n;
      });
      assert.equal(c.value, 4, "the blocks the index held");
      assert.equal(c.batches, 1, "one io batch for the drop's pads");
      assert.equal(c.syncs, 1, "one fdatasync for the one file the pads went to");
      assert.equal(tier.stats().dropPads, 4);
      const none = await counting(() => (tier.drop([key("never-written")]), tier.flushWrites()));
      assert.deepEqual([none.batches, none.syncs], [0, 0], "nothing held: no io");
    });
    const closed = await withTier(h, async (tier) => {
      assert.equal(tier.recovery.blocks, kept.length, "the dropped records were indexed again");
      assert.equal(tier.recovery.stoppedOnBadHeader, 0, "the scan stepped over each pad");
      for (const k of gone) assert.equal(tier.locate(k), undefined, `${k} came back`);
      const r = await fetch(h, tier, "kept", kept);
      assert.deepEqual(r.keys, kept);
      assert.ok(r.exact, "every kept block byte-exact");
      // A drop from the rebuilt index (its segment's epoch from the scan) persists too.
      assert.equal(tier.drop([keys[1]]), 1);
      return tier;
    });
    // After close the engine is gone: forgotten in memory, not padded, and said so.
    assert.equal(closed.drop([keys[2]]), 1);
    assert.ok(
      h.logs.some((l) =>
        l.includes("SSD drop after close: not padded") && l.includes(`"block":"${keys[2]}"`)
      ),
      h.logs.join("\n"),
    );
    await withTier(h, (tier) => {
      assert.equal(tier.recovery.blocks, kept.length - 1);
      assert.equal(tier.locate(keys[1]), undefined);
      assert.ok(tier.locate(keys[2]), "a drop after close wrote nothing");
      return Promise.resolve();
    });
  } finally {
    await h.close();
  }
});

Deno.test("a dropped block re-saved with good bytes survives a restart; dropped again, it does not", async () => {
  const h = await harness();
  try {
    const k = key("again");
    await withTier(h, async (tier) => {
      offer(h, tier, [k], "#bad");
      await tier.flushWrites();
      assert.equal(tier.drop([k]), 1);
      assert.equal(offer(h, tier, [k], "#good", 1).status, "queued", "the re-save is written");
      await tier.flushWrites();
    });
    await withTier(h, async (tier) => {
      assert.equal(tier.recovery.blocks, 1);
      const r = await fetch(h, tier, "good", [k], "#good");
      assert.deepEqual(r.keys, [k]);
      assert.ok(r.exact, "the good bytes, not the dropped ones");
      assert.equal(tier.drop([k]), 1);
      offer(h, tier, [key("other")]);
      await tier.flushWrites();
    });
    await withTier(h, (tier) => {
      assert.equal(tier.locate(k), undefined, "dropped twice, one of its records came back");
      assert.ok(tier.locate(key("other")));
      return Promise.resolve();
    });
  } finally {
    await h.close();
  }
});

Deno.test("a drop racing write-behind: in flight, padded when it lands; queued, never written; a re-save meanwhile is written", async () => {
  const h = await harness();
  try {
    const [flying, queued, resaved] = [key("flying"), key("queued"), key("resaved")];
    await withTier(h, async (tier) => {
      // The free writer places the first batch at once; the second waits in the queue.
      offer(h, tier, [flying, resaved], "#bad");
      assert.equal(tier.stats().writeInflight, 1, "the write runs");
      assert.equal(offer(h, tier, [queued], "", 2).status, "queued");
      assert.equal(tier.stats().writeQueueDepth, 1, "the second batch waits");
      assert.equal(tier.drop([flying, queued, resaved]), 0, "none indexed yet");
      // A save of good bytes while the dropped write still runs: not a duplicate of it.
      const again = offer(h, tier, [resaved], "#good", 3);
      assert.deepEqual([again.status, again.duplicates], ["queued", 0]);
      await within(tier.flushWrites(), 5_000, "the writes");
      const s = tier.stats();
      assert.equal(s.writeBlocks, 1, "only the re-save is indexed (the queued drop not written)");
      assert.equal(s.dropPads, 2, "the two records that landed dropped are padded");
      assert.deepEqual([tier.locate(flying), tier.locate(queued)], [undefined, undefined]);
    }, { writeInflight: 1 });
    await withTier(h, async (tier) => {
      assert.equal(tier.recovery.blocks, 1);
      assert.deepEqual([tier.locate(flying), tier.locate(queued)], [undefined, undefined]);
      const r = await fetch(h, tier, "resaved", [resaved], "#good");
      assert.deepEqual(r.keys, [resaved]);
      assert.ok(r.exact, "the re-save's bytes");
    });
  } finally {
    await h.close();
  }
});

Deno.test("a drop outlives a crash: a process that drops and exits without closing", async () => {
  const h = await harness();
  try {
    const out = await new Deno.Command(Deno.execPath(), {
      args: [
        "run",
        "-A",
        new URL("./_dropper.ts", import.meta.url).pathname,
        h.dir,
        "8",
        String(BLOCK),
        "0,3,7",
      ],
      stdout: "piped",
      stderr: "piped",
    }).output();
    assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
    const said = JSON.parse(new TextDecoder().decode(out.stdout));
    assert.deepEqual([said.written, said.dropped], [8, 3]);
    await withTier(h, async (tier) => {
      const keys = Array.from({ length: 8 }, (_, i) => `ns-drop-crash/${i}`);
      const kept = keys.filter((_, i) => ![0, 3, 7].includes(i));
      assert.equal(tier.recovery.blocks, 5);
      for (const i of [0, 3, 7]) assert.equal(tier.locate(keys[i]), undefined);
      const r = await fetch(h, tier, "after-crash", kept);
      assert.deepEqual(r.keys, kept);
      assert.ok(r.exact);
    });
  } finally {
    await h.close();
  }
});

Deno.test("a drop's pad that cannot be written is counted and logged with the block, file and offset", async () => {
  const h = await harness();
  const tier = await open(h);
  const run = SsdIo.prototype.run;
  try {
    const k = key("eio");
    offer(h, tier, [k]);
    await tier.flushWrites();
    const at = tier.locate(k)!;
    // The disk refuses every header-only write (a pad) with EIO.
    SsdIo.prototype.run = async function (this: SsdIo, batch: IoBatch) {
      const res = await run.call(this, batch);
      if (batch.numExt.every((n) => n === 0) && batch.kinds.every((x) => x === IoOp.WRITE)) {
        for (let i = 0; i < res.status.length; i++) {
          [res.status[i], res.aux[i]] = [PF_STATUS.PF_EIO, 5];
        }
      }
      return res;
    };
    assert.equal(tier.drop([k]), 1);
    await within(tier.flushWrites(), 5_000, "the drop");
    const s = tier.stats();
    assert.deepEqual([s.dropPads, s.dropPadFailures], [0, 1]);
    assert.equal(tier.locate(k), undefined, "forgotten in memory all the same");
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes("dropped block") &&
        l.includes(`"block":"${k}"`) && l.includes(`"namespace":"${TEST_NAMESPACE}"`) &&
        l.includes(`"path":"${at.path}"`) && l.includes(`"offset":${at.fileOffset}`) &&
        l.includes("Input/output error")
      ),
      h.logs.join("\n"),
    );
  } finally {
    SsdIo.prototype.run = run;
    await tier.close();
    await h.close();
  }
});

Deno.test("a drop's pad holds its segment: the ring does not refill it before the pad landed", async () => {
  const h = await harness();
  // Two segments of 15 records of 64 KiB (+ its header page) each.
  const opts = { capacityBytes: 2 * MiB + 4096, segmentBytes: MiB };
  const small = 64 * 1024;
  const keys = Array.from({ length: 30 }, (_, i) => key(`ring${i}`));
  const put = (tier: SsdTier, ks: string[], slot: number) =>
    h.write(
      tier,
      ks.map((
        k,
        i,
      ) => (h.fill(k, (slot + i) * small, small), h.block(k, (slot + i) * small, small))),
    );
  const run = SsdIo.prototype.run;
  let open = () => {};
  const gate = new Promise<void>((r) => (open = r));
  try {
    let tier = await h.openTier(opts);
    try {
      put(tier, keys, 0);
      await tier.flushWrites();
      assert.equal(tier.stats().indexBlocks, 30, "both segments full");
      // The drop's pad (a header-only write) waits at the gate, as on a slow disk.
      SsdIo.prototype.run = async function (this: SsdIo, batch: IoBatch) {
        if (batch.numExt.every((n) => n === 0) && batch.kinds.every((x) => x === IoOp.WRITE)) {
          await gate;
        }
        return run.call(this, batch);
      };
      assert.equal(tier.drop([keys[3]]), 1);
      // The next record would refill segment 0, where the pad is still to land.
      put(tier, [key("wrap")], 40);
      await new Promise((r) => setTimeout(r, 50));
      assert.equal(tier.stats().writeSkippedNoSpace, 1, "the ring refilled the pad's segment");
      open();
      await within(tier.flushWrites(), 5_000, "the pad");
      assert.equal(tier.stats().dropPads, 1);
    } finally {
      SsdIo.prototype.run = run;
      open();
      await tier.close();
    }
    tier = await h.openTier(opts);
    try {
      assert.equal(tier.recovery.blocks, 29);
      assert.equal(tier.recovery.stoppedOnBadHeader, 0);
      assert.equal(tier.locate(keys[3]), undefined);
      // The ring wraps past the pad as over any record.
      put(tier, [key("wrap")], 40);
      await tier.flushWrites();
      assert.ok(tier.locate(key("wrap")), "the ring wraps once the pad landed");
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});
