import assert from "node:assert/strict";
import { FileFlag, PegaflowIoError, poolCrc32c, Uring } from "../../ffi/uring.ts";
import { crc32c } from "../../lib/ssd/format.ts";
import { SsdIo } from "../../lib/ssd/io.ts";
import { harness } from "./_harness.ts";

Deno.test("io engine: aligned and unaligned ops are byte-exact; CRC from C equals the TS CRC", async () => {
  const h = await harness(8 << 20);
  const u = Uring.open(h.pool.handle, h.ring.handle, 32, 8);
  const io = new SsdIo(u, h.pool.handle, h.ring.completions$);
  try {
    const f = u.openFile(`${h.dir}/f.bin`, FileFlag.CREATE | FileFlag.DIRECT);
    const src = h.pool.view(0, 1 << 20);
    crypto.getRandomValues(src.subarray(0, 65536));
    for (let i = 65536; i < src.length; i += 65536) src.copyWithin(i, 0, 65536);
    const w = io.newBatch();
    w.write(f, 0, false, [{ offset: 0, bytes: 1 << 20 }]); // aligned: O_DIRECT
    w.write(f, (1 << 20) + 7, false, [{ offset: 3, bytes: 1001 }]); // unaligned: buffered fallback
    const wr = await io.run(w);
    wr.release();
    assert.deepEqual([...wr.status], [0, 0]);
    const r = io.newBatch();
    r.read(f, 0, false, [{ offset: 2 << 20, bytes: 1 << 20 }], true);
    r.read(f, (1 << 20) + 7, false, [{ offset: 4 << 20, bytes: 1001 }], true);
    const rr = await io.run(r);
    rr.release();
    assert.deepEqual([...rr.status], [0, 0]);
    assert.deepEqual(h.pool.view(2 << 20, 1 << 20), src);
    assert.deepEqual(h.pool.view(4 << 20, 1001), h.pool.view(3, 1001));
    assert.equal(rr.aux[0], crc32c(src));
    assert.equal(rr.aux[1], crc32c(h.pool.view(3, 1001)));
    const crcs = new Uint32Array(2);
    await poolCrc32c(h.pool.handle, w.encode(null), crcs);
    assert.deepEqual([...crcs], [rr.aux[0], rr.aux[1]]);
    const info = u.info();
    assert.ok(info.alignmentFallbacks >= 2, JSON.stringify(info));
    assert.equal(info.inflight, 0);
    // Reading past the end of the file is an I/O error on that op, not a crash.
    const eof = io.newBatch();
    eof.read(f, 64 << 20, false, [{ offset: 0, bytes: 4096 }], false);
    const er = await io.run(eof);
    er.release();
    assert.equal(er.status[0], -8);
    assert.match(er.errorText(0), /data/i);
  } finally {
    io.dispose();
    await u.close();
    await h.close();
  }
});

Deno.test("io engine: malformed batches are refused whole, naming the op", async () => {
  const h = await harness(1 << 20);
  const u = Uring.open(h.pool.handle, h.ring.handle, 16, 4);
  const io = new SsdIo(u, h.pool.handle, h.ring.completions$);
  try {
    const f = u.openFile(`${h.dir}/g.bin`, FileFlag.CREATE);
    const outside = io.newBatch();
    outside.write(f, 0, false, [{ offset: 0, bytes: 4096 }]);
    outside.write(f, 0, false, [{ offset: (1 << 20) - 100, bytes: 4096 }]);
    await assert.rejects(
      io.run(outside),
      (e: unknown) => e instanceof PegaflowIoError && /extent 1/.test(e.message),
    );
    const badFile = io.newBatch();
    badFile.read(f + 12345, 0, false, [{ offset: 0, bytes: 4096 }], false);
    await assert.rejects(io.run(badFile), /not a live file handle/);
    u.closeFile(f);
    const ro = u.openFile(`${h.dir}/g.bin`, FileFlag.RDONLY);
    const write = io.newBatch();
    write.write(ro, 0, false, [{ offset: 0, bytes: 4096 }]);
    await assert.rejects(io.run(write), /read-only/);
    assert.throws(() => Uring.open(h.pool.handle, h.ring.handle, 3, 4), /power of two/);
    assert.throws(() => u.openFile(`${h.dir}/nope/x`, 0), /No such file/);
    assert.equal(io.inflightBatches, 0, "refused batches leave nothing pending");
  } finally {
    io.dispose();
    await u.close();
    await h.close();
  }
});

Deno.test("an open io engine holds its pool and ring: destroying either is refused (EBUSY) until it closes", async () => {
  const h = await harness(1 << 20);
  const u = Uring.open(h.pool.handle, h.ring.handle, 16, 4);
  try {
    // It reads and writes the pool and posts to the ring: freeing them under it was a use after free.
    assert.throws(() => h.pool.close(), /PF_EBUSY/);
    assert.throws(() => h.ring.destroy(), /PF_EBUSY/);
  } finally {
    await u.close();
  }
  await h.close(); // both go once it closed
});

Deno.test("calls that run off the JS thread fail with the library's own text, not a bare code", async () => {
  const h = await harness(1 << 20);
  const u = Uring.open(h.pool.handle, h.ring.handle, 16, 4);
  try {
    const f = u.openFile(`${h.dir}/sync.bin`, FileFlag.CREATE);
    u.closeFile(f);
    // A closed file's handle: the text says which call and why.
    await assert.rejects(u.sync(f), (e: unknown) => {
      assert.ok(e instanceof PegaflowIoError, String(e));
      assert.match(e.message, /pf_file_sync failed \(-\d+\): pf_file_sync: .*handle/);
      return true;
    });
  } finally {
    await u.close();
  }
  await h.close();
});
