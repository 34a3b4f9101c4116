import assert from "node:assert/strict";
import fc from "fast-check";
import {
  crc32c,
  decodeHeader,
  decodeSuperblock,
  encodeHeader,
  encodePadHeader,
  encodeSuperblock,
  isPad,
  MAX_KEY_BYTES,
  PAGE_BYTES,
  recordBytes,
} from "../../lib/ssd/format.ts";

Deno.test("CRC32C matches the standard check value", () => {
  assert.equal(crc32c(new TextEncoder().encode("123456789")), 0xe3069283);
  assert.equal(crc32c(new Uint8Array(0)), 0);
});

Deno.test("a record header round-trips, and any single flipped bit in it is caught", () => {
  fc.assert(
    fc.property(
      fc.string({ minLength: 1, maxLength: 200 }),
      fc.nat({ max: 2 ** 40 }),
      fc.nat({ max: 2 ** 30 }),
      fc.nat({ max: 0xffffffff }),
      fc.nat(),
      fc.string({ minLength: 1, maxLength: 80 }),
      fc.stringMatching(/^[0-9a-f]{32}$/),
      (key, seq, payloadBytes, crc, flip, namespace, layout) => {
        const page = new Uint8Array(PAGE_BYTES);
        const h = {
          key,
          seq,
          epoch: seq,
          payloadBytes,
          payloadCrc: crc,
          recordBytes: recordBytes(payloadBytes),
          writtenAtMs: 1700000000000,
          generation: 123456789,
          namespace,
          layout,
          layoutSummary: "tp_size 1, pp_size 1, 4 layers × 2 segments × 32768 B",
        };
        encodeHeader(page, h);
        assert.deepEqual(decodeHeader(page), h);
        const te = new TextEncoder();
        const used = 96 + te.encode(key).length + te.encode(namespace).length +
          te.encode(h.layoutSummary).length;
        const bit = flip % (used * 8);
        page[bit >> 3] ^= 1 << (bit & 7);
        assert.equal(typeof decodeHeader(page), "string");
      },
    ),
    { numRuns: 200 },
  );
});

Deno.test("keys that cannot fit a header are refused with the key named", () => {
  const page = new Uint8Array(PAGE_BYTES);
  const h = {
    key: "",
    seq: 1,
    epoch: 1,
    payloadBytes: 1,
    payloadCrc: 0,
    recordBytes: 8192,
    writtenAtMs: 0,
    namespace: "ns",
    layout: "0".repeat(32),
    layoutSummary: "",
    generation: 1,
  };
  assert.throws(() => encodeHeader(page, h), /1\.\.3232/);
  assert.throws(
    () => encodeHeader(page, { ...h, key: "k".repeat(MAX_KEY_BYTES + 1) }),
    /block key "kkk/,
  );
});

Deno.test("a superblock round-trips; a damaged one says why", () => {
  const page = new Uint8Array(PAGE_BYTES);
  const sb = { generation: 42, segmentBytes: 64 << 20, segmentCount: 100, createdAtMs: 5 };
  encodeSuperblock(page, sb);
  assert.deepEqual(decodeSuperblock(page), sb);
  page[9] ^= 1;
  assert.equal(decodeSuperblock(page), "superblock checksum mismatch");
  assert.match(String(decodeSuperblock(new Uint8Array(PAGE_BYTES))), /no superblock/);
});

Deno.test("a pad header (a failed record's space) decodes as a pad spanning that record, flips caught", () => {
  const page = new Uint8Array(PAGE_BYTES);
  const pad = {
    seq: 7,
    epoch: 5,
    recordBytes: recordBytes(100_000),
    writtenAtMs: 1,
    generation: 9,
  };
  encodePadHeader(page, pad);
  const h = decodeHeader(page);
  assert.ok(typeof h !== "string" && isPad(h), String(h));
  assert.deepEqual(
    { seq: h.seq, epoch: h.epoch, recordBytes: h.recordBytes, payloadBytes: h.payloadBytes },
    { seq: 7, epoch: 5, recordBytes: recordBytes(100_000), payloadBytes: 0 },
  );
  for (let bit = 0; bit < 96 * 8; bit++) {
    const flipped = page.slice();
    flipped[bit >> 3] ^= 1 << (bit & 7);
    assert.equal(typeof decodeHeader(flipped), "string", `bit ${bit}`);
  }
  assert.throws(() => encodePadHeader(page, { ...pad, recordBytes: 100 }), /whole number of pages/);
});
