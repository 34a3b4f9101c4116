import assert from "node:assert/strict";
import { crc32c, decodeHeader, PAGE_BYTES } from "../../lib/ssd/format.ts";
import { FP, type Harness, harness } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 128 * 1024;

async function write(h: Harness, tier: Awaited<ReturnType<Harness["openTier"]>>, keys: string[]) {
  h.write(
    tier,
    keys.map((k, i) => {
      h.fill(k, i * BLOCK, BLOCK);
      return h.block(k, i * BLOCK, BLOCK);
    }),
  );
  await tier.flushWrites();
}

// A header whose sequence number does not fit a JS number exactly (u64 past 2^53) must not
// be indexed: the next write would continue at "max + 1" = the same float, encoded as 2^64
// (wrapped to 0), and every record written after it would be dropped at the next start.
Deno.test("a header with a sequence number past 2^53 is refused; later writes survive a restart", async () => {
  const h = await harness();
  let tier: Awaited<ReturnType<Harness["openTier"]>> | undefined;
  try {
    const opts = { capacityBytes: 32 * MiB, segmentBytes: 4 * MiB };
    const path = `${h.dir}/pegaflow-ssd.cache`;
    tier = await h.openTier(opts);
    await write(h, tier, ["ns:k0"]);
    assert.equal(tier.locate("ns:k0")?.fileOffset, PAGE_BYTES);
    await tier.close();

    // seq = epoch = 2^64 - 1 in the first record, header checksum made valid again.
    const f = Deno.openSync(path, { read: true, write: true });
    const page = new Uint8Array(PAGE_BYTES);
    f.seekSync(PAGE_BYTES, Deno.SeekMode.Start);
    assert.equal(f.readSync(page), PAGE_BYTES);
    const v = new DataView(page.buffer);
    v.setBigUint64(8, 2n ** 64n - 1n, true);
    v.setBigUint64(16, 2n ** 64n - 1n, true);
    const end = 96 + v.getUint16(6, true) + v.getUint16(80, true) + v.getUint16(82, true);
    v.setUint32(36, 0, true);
    v.setUint32(36, crc32c(page.subarray(0, end)), true);
    assert.equal(decodeHeader(page), "lengths");
    f.seekSync(PAGE_BYTES, Deno.SeekMode.Start);
    f.writeSync(page);
    f.close();

    tier = await h.openTier(opts);
    assert.equal(tier.locate("ns:k0"), undefined, "the crafted record is not indexed");
    assert.equal(tier.recovery.stoppedOnBadHeader, 1);
    const later = ["ns:k1", "ns:k2", "ns:k3"];
    await write(h, tier, later);
    const seqs = later.map((k) => tier!.locate(k)!.seq);
    assert.ok(seqs.every((s) => Number.isSafeInteger(s)), `${seqs}`);
    assert.equal(new Set(seqs).size, later.length, `sequence numbers repeat: ${seqs}`);
    await tier.close();

    tier = await h.openTier(opts);
    assert.equal(tier.lookupPrefix(later, FP), later.length, "records written later recovered");
  } finally {
    await tier?.close();
    await h.close();
  }
});
