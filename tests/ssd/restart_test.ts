import assert from "node:assert/strict";
import { SsdTier } from "../../lib/ssd/tier.ts";
import { SsdIo } from "../../lib/ssd/io.ts";
import { PF_STATUS } from "../../ffi/native.ts";
import { FP, type Harness, harness } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 128 * 1024;
const PF_EIO = PF_STATUS.PF_EIO;
/** Linux errno of an I/O error. */
const EIO = 5;

function open(h: Harness, dir = h.dir, reset = false) {
  return h.openTier({
    paths: [dir],
    capacityBytes: 64 * MiB,
    segmentBytes: 4 * MiB,
    reset,
  });
}

async function writeBlocks(h: Harness, tier: SsdTier, keys: string[]) {
  h.write(
    tier,
    keys.map((k, i) => {
      h.fill(k, i * BLOCK, BLOCK);
      return h.block(k, i * BLOCK, BLOCK);
    }),
  );
  await tier.flushWrites();
  h.pool.view(0, keys.length * BLOCK).fill(0);
}

async function fetchAll(h: Harness, tier: SsdTier, reqId: string, keys: string[]) {
  const alloc = h.allocator(32 * MiB);
  const first = tier.prefetch(reqId, keys, alloc, FP);
  if (first.state !== "loading") return { keys: [] as string[], exact: true, first };
  await tier.prefetchSettled(reqId);
  const a = tier.prefetch(reqId, keys, alloc, FP);
  assert.equal(a.state, "ready");
  const exact = [...alloc.committed].every(([key, [e]]) => h.holds(key, e.offset, e.bytes));
  return { keys: [...alloc.committed.keys()], exact, first };
}

Deno.test("a new process rebuilds the index from disk and serves the prefix byte-exact", async () => {
  const h = await harness();
  try {
    const cmd = new Deno.Command(Deno.execPath(), {
      args: [
        "run",
        "-A",
        new URL("./_writer.ts", import.meta.url).pathname,
        h.dir,
        "24",
        String(BLOCK),
      ],
      stdout: "piped",
      stderr: "piped",
    });
    const out = await cmd.output();
    assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
    assert.deepEqual(JSON.parse(new TextDecoder().decode(out.stdout)), {
      written: 24,
      failures: 0,
    });
    const tier = await open(h);
    try {
      const keys = Array.from({ length: 24 }, (_, i) => `ns-restart/${i}`);
      assert.equal(tier.recovery.blocks, 24);
      assert.equal(tier.stats().recoveredBlocks, 24);
      assert.equal(tier.lookupPrefix(keys, FP), 24);
      const r = await fetchAll(h, tier, "after-restart", keys);
      assert.deepEqual(r.keys, keys);
      assert.ok(r.exact, "every recovered block byte-exact");
      // New writes continue after the recovered ones and survive another restart.
      await writeBlocks(h, tier, ["ns-restart/new"]);
      assert.ok(tier.locate("ns-restart/new")!.seq > tier.locate("ns-restart/23")!.seq);
    } finally {
      await tier.close();
    }
    const again = await open(h);
    try {
      assert.equal(again.recovery.blocks, 25);
    } finally {
      await again.close();
    }
    const reset = await open(h, h.dir, true);
    try {
      assert.equal(reset.recovery.blocks, 0, "--ssd-reset starts empty");
    } finally {
      await reset.close();
    }
    const afterReset = await open(h);
    try {
      assert.equal(afterReset.recovery.blocks, 0, "records from before a reset never come back");
    } finally {
      await afterReset.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("a flipped byte makes that block a miss; the prefix before it is served", async () => {
  const h = await harness();
  try {
    const keys = Array.from({ length: 10 }, (_, i) => `ns-corrupt/${i}`);
    let tier = await open(h);
    await writeBlocks(h, tier, keys);
    const loc = tier.locate(keys[5])!;
    await tier.close();
    const f = await Deno.open(loc.path, { read: true, write: true });
    const pos = loc.fileOffset + 4096 + 777;
    const b = new Uint8Array(1);
    await f.seek(pos, Deno.SeekMode.Start);
    await f.read(b);
    b[0] ^= 0x40;
    await f.seek(pos, Deno.SeekMode.Start);
    await f.write(b);
    f.close();
    tier = await open(h);
    try {
      assert.equal(
        tier.recovery.blocks,
        10,
        "headers are intact: the scan cannot see payload damage",
      );
      const r = await fetchAll(h, tier, "q", keys);
      assert.deepEqual(r.keys, keys.slice(0, 5));
      assert.ok(r.exact);
      assert.equal(tier.stats().checksumFailures, 1);
      assert.ok(h.logs.some((l) => l.includes(keys[5]) && l.includes("CRC32C")), h.logs.join("\n"));
      assert.equal(tier.lookupPrefix(keys, FP), 5, "the bad block left the index");
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("a record cut short by truncation is dropped at start", async () => {
  const h = await harness();
  try {
    const keys = Array.from({ length: 8 }, (_, i) => `ns-torn/${i}`);
    let tier = await open(h);
    await writeBlocks(h, tier, keys);
    const last = tier.locate(keys[7])!;
    await tier.close();
    await Deno.truncate(last.path, last.fileOffset + 4096 + 1000);
    tier = await open(h);
    try {
      assert.equal(tier.recovery.blocks, 7);
      assert.equal(tier.recovery.truncated, 1);
      assert.equal(tier.lookupPrefix(keys, FP), 7);
      const r = await fetchAll(h, tier, "q", keys);
      assert.deepEqual(r.keys, keys.slice(0, 7));
      assert.ok(r.exact);
      // The space of the torn record is reused by the next write.
      await writeBlocks(h, tier, ["ns-torn/next"]);
      assert.equal(tier.locate("ns-torn/next")!.fileOffset, last.fileOffset);
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("a torn header (garbage where the last record starts) ends the chain at start", async () => {
  const h = await harness();
  try {
    const keys = Array.from({ length: 4 }, (_, i) => `ns-torn-hdr/${i}`);
    let tier = await open(h);
    await writeBlocks(h, tier, keys);
    const last = tier.locate(keys[3])!;
    await tier.close();
    const f = await Deno.open(last.path, { read: true, write: true });
    await f.seek(last.fileOffset + 40, Deno.SeekMode.Start);
    await f.write(new Uint8Array([1, 2, 3, 4]));
    f.close();
    tier = await open(h);
    try {
      assert.equal(tier.recovery.blocks, 3);
      assert.equal(tier.recovery.stoppedOnBadHeader, 1);
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("a header read that fails with an I/O error ends that chain, counted and logged with the path", async () => {
  const h = await harness();
  try {
    const keys = Array.from({ length: 4 }, (_, i) => `ns-eio/${i}`);
    let tier = await open(h);
    await writeBlocks(h, tier, keys);
    const path = tier.locate(keys[0])!.path;
    await tier.close();
    // The disk fails the scan's second round of header reads (the second record of each
    // segment) with EIO, as a bad sector would: injected where the reaper reports it.
    const run = SsdIo.prototype.run;
    const mark = h.logs.length;
    let round = 0;
    SsdIo.prototype.run = async function (this: SsdIo, batch) {
      const res = await run.call(this, batch);
      const scanning = h.logs.slice(mark).some((l) => l.includes("rebuilding the SSD index"));
      if (scanning && ++round === 2) {
        for (let i = 0; i < res.status.length; i++) [res.status[i], res.aux[i]] = [PF_EIO, EIO];
      }
      return res;
    };
    try {
      tier = await open(h);
    } finally {
      SsdIo.prototype.run = run;
    }
    try {
      assert.equal(tier.recovery.blocks, 1);
      assert.equal(tier.recovery.readErrors, 1);
      assert.equal(tier.recovery.stoppedOnBadHeader, 0);
      assert.equal(tier.lookupPrefix(keys, FP), 1);
      const warned = h.logs.find((l) => l.includes("SSD header reads failed"));
      assert.ok(warned?.includes(path) && warned.includes("Input/output error"), h.logs.join("\n"));
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("after a torn header, new records take seqs above every record on disk, and old ones past the tear stay out", async () => {
  const h = await harness();
  try {
    const keys = Array.from({ length: 5 }, (_, i) => `ns-seq/${i}`);
    let tier = await open(h);
    await writeBlocks(h, tier, keys);
    const seqs = keys.map((k) => tier.locate(k)!.seq);
    const torn = tier.locate(keys[2])!;
    await tier.close();
    const f = await Deno.open(torn.path, { read: true, write: true });
    await f.seek(torn.fileOffset + 40, Deno.SeekMode.Start);
    await f.write(new Uint8Array([1, 2, 3, 4]));
    f.close();
    tier = await open(h);
    try {
      assert.equal(tier.recovery.blocks, 2);
      // Written where the torn record was, same size: the old records 3 and 4 follow it on disk.
      await writeBlocks(h, tier, ["ns-seq/new"]);
      const fresh = tier.locate("ns-seq/new")!;
      assert.equal(fresh.fileOffset, torn.fileOffset);
      assert.ok(fresh.seq > Math.max(...seqs), `seq ${fresh.seq} repeats one on disk (${seqs})`);
    } finally {
      await tier.close();
    }
    tier = await open(h);
    try {
      assert.equal(tier.lookupPrefix(["ns-seq/new"], FP), 1);
      // Records of an older write past the tear are not taken back into the chain.
      assert.equal(tier.locate(keys[3]), undefined);
      assert.equal(tier.locate(keys[4]), undefined);
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});

Deno.test("a clean restart drops no records: chains that end on unwritten space or an older fill are not counted as torn", async () => {
  const h = await harness();
  try {
    // Two 4 MiB segments of 128 KiB blocks, 31 records each (and a slack page): 72 blocks
    // wrap the ring, so segment 0's new fill ends on a record of its older fill, and
    // segment 1 ends on its never-written slack page.
    const opts = { paths: [h.dir], capacityBytes: 8 * MiB + 4096, segmentBytes: 4 * MiB };
    const keys = Array.from({ length: 72 }, (_, i) => `ns-clean/${i}`);
    let tier = await h.openTier(opts);
    for (let i = 0; i < keys.length; i += 8) await writeBlocks(h, tier, keys.slice(i, i + 8));
    assert.equal(tier.stats().segmentsReused, 1, "the ring wrapped onto segment 0 once");
    const held = tier.stats().indexBlocks;
    await tier.close();
    tier = await h.openTier(opts);
    try {
      assert.equal(tier.recovery.blocks, held);
      assert.equal(tier.recovery.stoppedOnBadHeader, 0);
      assert.equal(tier.stats().recoveryTornRecords, 0);
      assert.ok(
        h.logs.some((l) => l.includes('"chains_ended_on_bad_header":0')),
        h.logs.join("\n"),
      );
    } finally {
      await tier.close();
    }
  } finally {
    await h.close();
  }
});
