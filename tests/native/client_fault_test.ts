/**
 * A client's shared memory can shrink under the library (the client
 * ftruncates the shm file behind a host region or a load-state block after
 * the server mapped it). The access must fail THAT batch or call with
 * PF_EFAULT and a text naming the object, never kill the process; and a
 * SIGBUS outside the library's guarded copies must keep its default meaning.
 */
import assert from "node:assert/strict";
import {
  CopyBatch,
  CopyEngine,
  NativeError,
  PF_STATUS,
  type Region,
  SharedMemory,
} from "../../ffi/mod.ts";

const KB = 1024;

function shmName(region: Region): string {
  return new TextDecoder().decode(region.handle).replace(/\0+$/, "");
}

/** Shrinks the shm object `name` behind every mapping of it, as a client could. */
function shrink(name: string, bytes = 0): void {
  Deno.truncateSync(`/dev/shm${name}`, bytes);
}

function fill(region: Region, bytes: number, seed: number): Uint8Array {
  const data = new Uint8Array(bytes);
  for (let i = 0; i < bytes; i++) data[i] = (i * 31 + seed) & 0xff;
  region.write(0, data);
  return data;
}

Deno.test("a region shrunk after import fails its batch with PF_EFAULT naming it; other regions still copy", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20, workers: 2 });
  const goodOwn = ce.engine.allocRegion(64 * KB);
  const badOwn = ce.engine.allocRegion(64 * KB);
  const good = ce.engine.importRegion(goodOwn.handle, 64 * KB);
  const bad = ce.engine.importRegion(badOwn.handle, 64 * KB);
  try {
    const data = fill(goodOwn, 64 * KB, 7);
    fill(badOwn, 64 * KB, 9);
    shrink(shmName(badOwn));

    // Group 0 from a good region, group 1 from the shrunk one, group 2 good again.
    const b = new CopyBatch(4, 16).reset("d2h");
    b.group(good, 10).seg(0, 0, 16 * KB);
    b.group(bad, 11).seg(4 * KB, 16 * KB, 16 * KB);
    b.group(good, 12).seg(16 * KB, 32 * KB, 16 * KB);
    const s = ce.submit(b);
    const landed: number[] = [];
    const layersErr = new Promise<unknown>((resolve) =>
      s.layers$.subscribe({ next: (l) => landed.push(l), error: resolve })
    );
    const r = await s.done;
    assert.equal(r.status, PF_STATUS.PF_EFAULT);
    assert.match(
      r.error ?? "",
      new RegExp(
        `group 1 \\(layer 11\\): region \\d+ \\("${
          shmName(badOwn)
        }", 65536 bytes mapped\\) faulted at offset 4096 reading it \\(save\\)`,
      ),
    );
    const err = await layersErr;
    assert.ok(err instanceof NativeError && err.codeName === "PF_EFAULT");
    // Progress is a prefix: the group after the fault is not reported landed.
    assert.deepEqual(landed, [10]);
    assert.deepEqual(ce.pool.view(0, 16 * KB), data.subarray(0, 16 * KB));

    // The engine carries on: the good region saves and loads byte-exact.
    const ok = new CopyBatch(1, 1).reset("d2h");
    ok.group(good, 0).seg(0, 128 * KB, 64 * KB);
    assert.equal((await ce.submit(ok).done).status, 0);
    assert.deepEqual(ce.pool.view(128 * KB, 64 * KB), data);

    // A load (scatter) into the shrunk region fails the same way.
    const load = new CopyBatch(1, 1).reset("h2d");
    load.group(bad, 5).seg(0, 0, 8 * KB);
    const lr = await ce.submit(load).done;
    assert.equal(lr.status, PF_STATUS.PF_EFAULT);
    assert.match(lr.error ?? "", /group 0 \(layer 5\).*faulted at offset \d+ writing it \(load\)/);

    // Nothing is left counted: every object closes.
    assert.equal(bad.info().inflight, 0);
  } finally {
    bad.close();
    good.close();
    badOwn.close();
    goodOwn.close();
    await ce.close();
  }
});

Deno.test("reading or writing a shrunk region synchronously throws PF_EFAULT", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20 });
  const own = ce.engine.allocRegion(32 * KB);
  const imp = ce.engine.importRegion(own.handle, 32 * KB);
  try {
    shrink(shmName(own), 8 * KB);
    assert.equal(imp.read(0, 4 * KB).length, 4 * KB, "pages still backed read fine");
    assert.throws(
      () => imp.read(8 * KB, 4 * KB),
      (e: unknown) =>
        e instanceof NativeError && e.codeName === "PF_EFAULT" &&
        /pf_region_read: region \d+ \("\/pegaflow-[\d-]+", 32768 bytes mapped\) faulted at offset 8192/
          .test(e.message),
    );
    assert.throws(() => imp.write(16 * KB, new Uint8Array(100)), /PF_EFAULT.*offset 16384/);
  } finally {
    imp.close();
    own.close();
    await ce.close();
  }
});

Deno.test("a load state shrunk after it was opened: guarded access and submit fail with PF_EFAULT", async () => {
  const name = `/pegaflow-test-ls-${Deno.pid}-a`;
  const owner = SharedMemory.open(name, 64, { create: true, unlink: true });
  const peer = SharedMemory.open(name, 64); // the server's mapping
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20 });
  const region = ce.engine.allocRegion(64 * KB);
  try {
    const w = new Uint8Array([1, 2, 3, 4, 5, 6, 7, 8]);
    peer.write(16, w);
    const back = new Uint8Array(8);
    peer.read(16, back);
    assert.deepEqual(back, w);

    shrink(name);
    assert.throws(
      () => peer.read(0, new Uint8Array(8)),
      new RegExp(`PF_EFAULT.*shm \\d+ \\("${name}", 64 bytes mapped\\) faulted at offset 0`),
    );
    assert.throws(() => peer.write(20, new Uint8Array(4)), /PF_EFAULT/);
    assert.throws(() => peer.read(60, new Uint8Array(8)), /PF_ERANGE.*exceeds its 64 mapped bytes/);

    const b = new CopyBatch(1, 1).reset("h2d", "host", { shm: peer, offset: 16 });
    b.group(region, 0).seg(0, 0, 4 * KB);
    assert.throws(
      () => ce.submit(b),
      new RegExp(`PF_EFAULT.*progress shm \\d+ \\("${name}".*faulted at offset 16`),
    );
    // A refused batch counts nothing.
    assert.equal(region.info().inflight, 0);
  } finally {
    peer.close();
    owner.close();
    region.close();
    await ce.close();
  }
});

Deno.test("a kept mapping knows whether its name still names its object (pf_shm_same)", () => {
  const name = `/pf-same-${Deno.pid}`;
  let owner = SharedMemory.open(name, 4 * KB, { create: true, unlink: true });
  const peer = SharedMemory.open(name, 4 * KB);
  try {
    assert.equal(peer.same(), true);
    shrink(name, 2 * KB);
    assert.equal(peer.same(), false, "shrunk below the mapping");
    Deno.truncateSync(`/dev/shm${name}`, 8 * KB);
    assert.equal(peer.same(), true, "as long as it was again (longer is fine)");
    owner.close(); // unlinks
    assert.equal(peer.same(), false, "unlinked");
    owner = SharedMemory.open(name, 4 * KB, { create: true, unlink: true });
    assert.equal(peer.same(), false, "another object under the same name");
    const again = SharedMemory.open(name, 4 * KB);
    assert.equal(again.same(), true);
    again.close();
  } finally {
    peer.close();
    owner.close();
  }
  assert.throws(
    () => peer.same(),
    (e: unknown) => e instanceof NativeError && e.codeName === "PF_EHANDLE",
  );
});

Deno.test("progress words that vanish while a batch is queued fail that batch only", async () => {
  const name = `/pegaflow-test-ls-${Deno.pid}-b`;
  const owner = SharedMemory.open(name, 64, { create: true, unlink: true });
  const peer = SharedMemory.open(name, 64);
  // One worker and a 16-record ring: the first batch's 17th record (its BATCH)
  // waits for this thread to read the ring, so the second batch cannot start
  // before the object is shrunk below — no timing involved.
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20, workers: 1, ringCapacity: 16 });
  const region = ce.engine.allocRegion(64 * KB);
  try {
    const first = new CopyBatch(16, 16).reset("d2h");
    for (let g = 0; g < 16; g++) first.group(region, g).seg(g * KB, g * KB, KB);
    const a = ce.submit(first);
    const second = new CopyBatch(2, 2).reset("h2d", "host", { shm: peer, offset: 16 });
    second.group(region, 0).seg(0, 0, KB);
    second.group(region, 1).seg(KB, KB, KB);
    const b = ce.submit(second);
    shrink(name);

    assert.equal((await a.done).status, 0, "the batch before is untouched");
    const r = await b.done;
    assert.equal(r.status, PF_STATUS.PF_EFAULT);
    assert.match(
      r.error ?? "",
      new RegExp(
        `progress words: shm \\d+ \\("${name}", 64 bytes mapped\\) faulted at offset 16 writing layers_ready`,
      ),
    );
    // The engine goes on copying, and every object it touched closes.
    const again = new CopyBatch(1, 1).reset("d2h");
    again.group(region, 0).seg(0, 32 * KB, 4 * KB);
    assert.equal((await ce.submit(again).done).status, 0);
    peer.close();
  } finally {
    owner.close();
    region.close();
    await ce.close();
  }
});

Deno.test("a SIGBUS outside the library's guarded copies still kills the process", async () => {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", new URL("./sigbus_child.ts", import.meta.url).pathname],
    stdout: "piped",
    stderr: "piped",
  });
  const out = await child.output();
  const said = new TextDecoder().decode(out.stdout);
  assert.match(said, /guard installed/, "the child got as far as the unguarded touch");
  assert.doesNotMatch(said, /survived/);
  assert.equal(out.signal, "SIGBUS");
});
