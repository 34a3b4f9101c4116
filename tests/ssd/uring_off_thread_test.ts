// The library's file calls run off the JS thread (ffi/uring.ts `*OffThread`, what the SSD tier's
// open uses under its deadline): the same results as the calls made on the JS thread, and a failure
// is the same PegaflowIoError, naming the call, the path and the status by name (PF_STATUS).
import assert from "node:assert/strict";
import { PF_STATUS } from "../../ffi/native.ts";
import {
  closeFileOffThread,
  FileFlag,
  fileInfoOffThread,
  fsSpace,
  fsSpaceOffThread,
  openFileOffThread,
  PegaflowIoError,
  Uring,
} from "../../ffi/uring.ts";
import { harness } from "./_harness.ts";

Deno.test("off-thread file calls decode what the JS-thread calls do", async () => {
  const h = await harness(1 << 20);
  const u = Uring.open(h.pool.handle, h.ring.handle, 16, 4);
  try {
    const path = `${h.dir}/off.bin`;
    const f = await openFileOffThread(u.handle, path, FileFlag.CREATE);
    u.truncate(f, 1 << 20);
    assert.deepEqual(await fileInfoOffThread(f, path), u.fileInfo(f));
    assert.equal((await fileInfoOffThread(f)).sizeBytes, 1 << 20);
    const here = fsSpace(h.dir);
    const off = await fsSpaceOffThread(h.dir);
    assert.equal(off.totalBytes, here.totalBytes);
    assert.equal(off.blockBytes, here.blockBytes);
    await closeFileOffThread(f, path);
    assert.throws(() => u.fileInfo(f), PegaflowIoError); // closed for real
  } finally {
    await u.close();
  }
  await h.close();
});

Deno.test("an off-thread file call fails as PegaflowIoError with the status's name", async () => {
  const h = await harness(1 << 20);
  const u = Uring.open(h.pool.handle, h.ring.handle, 16, 4);
  const offThread = (call: RegExp, code: number) => (e: unknown) => {
    assert.ok(e instanceof PegaflowIoError, String(e));
    assert.equal(e.code, code);
    assert.match(e.message, call);
    assert.match(e.message, /PF_E[A-Z]+ \(run off the JS thread/);
    return true;
  };
  try {
    const path = `${h.dir}/gone.bin`;
    const f = await openFileOffThread(u.handle, path, FileFlag.CREATE);
    await closeFileOffThread(f, path);
    const handle = PF_STATUS.PF_EHANDLE;
    await assert.rejects(
      closeFileOffThread(f, path),
      offThread(/^pf_file_close\(.*gone\.bin\) failed \(-2\): PF_EHANDLE /, handle),
    );
    await assert.rejects(
      fileInfoOffThread(f),
      offThread(/^pf_file_info failed \(-2\): PF_EHANDLE /, handle),
    );
    await assert.rejects(
      openFileOffThread(u.handle, `${h.dir}/no/such/dir/x`, 0),
      (e: unknown) => e instanceof PegaflowIoError && /^pf_file_open\(.*x\) failed/.test(e.message),
    );
    await assert.rejects(
      fsSpaceOffThread(`${h.dir}/no/such/dir`),
      (e: unknown) =>
        e instanceof PegaflowIoError && /^pf_fs_space\(.*dir\) failed/.test(e.message),
    );
    // A bad path is a rejection too (the caller races the promise), not a throw.
    const nul = openFileOffThread(u.handle, `${h.dir}/a\0b`, 0);
    await assert.rejects(nul, TypeError);
  } finally {
    await u.close();
  }
  await h.close();
});
