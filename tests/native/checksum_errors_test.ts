/**
 * poolCrc32c and poolChecksums run off the JS thread, where pf_last_error's
 * text stays. Their errors used to be fixed strings: a closed pool was
 * reported as "an extent is empty or outside the pool", a bad extent as
 * "malformed descriptor or pool handle". Now they carry the library's own
 * text: the function, the handle, the extent and the pool's size.
 */
import assert from "node:assert/strict";
import { Engine } from "../../ffi/mod.ts";
import {
  IO_BATCH_HEADER_BYTES,
  IO_DESC_BYTES,
  poolChecksums,
  poolCrc32c,
} from "../../ffi/uring.ts";

const POOL = 1 << 20;

/** One op over the given pool extents (file handle 0: a checksum names no file). */
function ioDesc(exts: [number, number][]): Uint8Array {
  const buf = new Uint8Array(IO_BATCH_HEADER_BYTES + IO_DESC_BYTES + 16 * exts.length);
  const v = new DataView(buf.buffer);
  v.setUint32(0, 1, true); // num_ops
  v.setUint32(4, exts.length, true); // num_exts
  const o = IO_BATCH_HEADER_BYTES;
  v.setUint32(o + 24, 0, true); // first_ext
  v.setUint32(o + 28, exts.length, true); // num_ext
  exts.forEach(([off, bytes], i) => {
    v.setBigUint64(o + IO_DESC_BYTES + 16 * i, BigInt(off), true);
    v.setBigUint64(o + IO_DESC_BYTES + 16 * i + 8, BigInt(bytes), true);
  });
  return buf;
}

Deno.test("checksum errors carry the library's text, not a guess", async () => {
  const engine = Engine.open({ backend: "host", workers: 1 });
  const pool = engine.createPool(POOL);
  const h = pool.handle;
  try {
    // Valid calls still answer.
    const out = new Uint32Array(1);
    await poolCrc32c(h, ioDesc([[0, 4096]]), out);
    assert.deepEqual([...await poolChecksums(h, [[{ offset: 0, bytes: 4096 }]])], [...out]);

    await assert.rejects(
      poolChecksums(h, [[{ offset: 0, bytes: 64 }, { offset: POOL, bytes: 64 }]]),
      /pf_pool_checksums: extent 1 \[1048576, \+64\) is empty or outside the pool \(1048576 bytes\)/,
    );
    await assert.rejects(
      poolCrc32c(h, ioDesc([[0, 64], [POOL - 32, 64]]), new Uint32Array(1)),
      /pf_pool_crc32c: extent 1 \[1048544, \+64\) is empty or outside the pool \(1048576 bytes\)/,
    );
    await assert.rejects(
      poolCrc32c(h, ioDesc([[0, 64]]).subarray(0, 40), new Uint32Array(1)),
      /pf_pool_crc32c: descriptor of 40 bytes, 1 ops and 1 extents need 64/,
    );
  } finally {
    pool.close();
    engine.close();
  }
  // A closed pool is named as such (before: "an extent is empty or outside the pool").
  const stale = new RegExp(`${h} is not a live pool handle`);
  await assert.rejects(poolChecksums(h, [[{ offset: 0, bytes: 64 }]]), stale);
  await assert.rejects(poolCrc32c(h, ioDesc([[0, 64]]), new Uint32Array(1)), stale);
});
