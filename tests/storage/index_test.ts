import { deepStrictEqual as assertEquals, strictEqual, throws } from "node:assert/strict";
import { Block, BlockIndex } from "../../lib/storage/block.ts";
import { hashBucket, hashMatches } from "../../lib/storage/keys.ts";
import { InvalidArgumentError } from "../../lib/storage/errors.ts";

const LAYOUT = { layers: 1, tpSize: 1, collapseTp: false, segments: 1, segmentBytes: 4096 };
const block = (ns: string, hex: string, bucket: number) =>
  new Block(`${ns}:${hex}`, ns, hex, LAYOUT, 0, bucket);

Deno.test("hash buckets are V8 small integers (0 .. 2^30 - 1) and still spread", () => {
  // A bucket of 2^30 or more would be a heap number: an allocation and a slower Map probe per lookup.
  const seen = new Set<number>();
  let high = 0;
  for (let i = 0; i < 4096; i++) {
    const h = crypto.getRandomValues(new Uint8Array(16));
    const b = hashBucket(h, 0x5eed);
    strictEqual(Number.isInteger(b) && b >= 0 && b < 2 ** 30, true, `bucket ${b}`);
    if (b >= 2 ** 29) high++;
    seen.add(b);
  }
  strictEqual(seen.size > 4080, true, `${seen.size} distinct buckets of 4096`);
  strictEqual(high > 1700 && high < 2400, true, `${high} of 4096 in the upper half`);
});

Deno.test("hash buckets agree for bytes and hex, differ by namespace seed, and reject bad hashes", () => {
  const bytes = new Uint8Array([0xde, 0xad, 0xbe, 0xef]);
  strictEqual(hashBucket(bytes, 7), hashBucket("deadbeef", 7));
  strictEqual(hashBucket(bytes, 7) === hashBucket(bytes, 8), false);
  strictEqual(hashMatches(bytes, "deadbeef"), true);
  strictEqual(hashMatches(bytes, "deadbeee"), false);
  strictEqual(hashMatches(bytes, "deadbe"), false);
  for (const bad of ["", "abc", "DEADBEEF", "zz", new Uint8Array(0), new Uint8Array(65)]) {
    throws(() => hashBucket(bad, 0), InvalidArgumentError);
  }
});

Deno.test("blocks whose hashes share a bucket are told apart and removed one by one", () => {
  const idx = new BlockIndex();
  const [a, b, c] = ["aa", "bb", "cc"].map((hex) => block("ns", hex, 42)); // forced collision
  const other = block("ns2", "aa", 42); // same hash and bucket, other namespace
  for (const x of [a, b, c, other]) idx.addInflight(x);
  strictEqual(idx.find("ns", "bb", 42), b);
  strictEqual(idx.find("ns", new Uint8Array([0xaa]), 42), a);
  strictEqual(idx.find("ns2", "aa", 42), other);
  strictEqual(idx.find("ns", "dd", 42), undefined);
  throws(() => idx.addInflight(block("ns", "bb", 42)), /already indexed/);
  idx.remove(b); // middle of the chain
  strictEqual(idx.find("ns", "bb", 42), undefined);
  strictEqual(idx.find("ns", "cc", 42), c);
  idx.seal(c);
  idx.remove(c); // head
  idx.remove(c); // again: a no-op
  assertEquals([idx.size, idx.sealedCount, idx.inflightCount], [2, 0, 2]);
  assertEquals([...idx.all()].map((x) => x.key).sort(), ["ns2:aa", "ns:aa"]);
  strictEqual(idx.has(a), true);
  strictEqual(idx.has(b), false);
});

Deno.test("a block record is recycled only when it holds nothing", () => {
  const b = block("ns", "aa", 1);
  b.slots[0] = 2;
  b.offsets[0] = 4096;
  throws(() => b.recycle("ns:bb", "bb", 5, 2), /still in use/);
  b.slots[0] = 0;
  b.offsets[0] = -1;
  b.pins = 1;
  throws(() => b.recycle("ns:bb", "bb", 5, 2), /still in use/);
  b.pins = 0;
  b.state = "sealed";
  b.recycle("ns:bb", "bb", 5, 2);
  assertEquals([b.key, b.hash, b.createdAt, b.bucket, b.state], ["ns:bb", "bb", 5, 2, "inflight"]);
});
