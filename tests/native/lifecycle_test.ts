/**
 * Lifecycle: close while copies are in flight is refused (EBUSY), a full
 * ring holds producers back without losing records, many concurrent batches
 * each complete once with their own bytes, progress words reach shared
 * memory, and shutdown wakes every pending wait so the process can exit.
 */
import assert from "node:assert/strict";
import { lastValueFrom, toArray } from "rxjs";
import {
  type Completion,
  COMPLETION_KIND,
  CompletionRing,
  CopyBatch,
  CopyEngine,
  Engine,
  loadLibrary,
  NativeError,
  SharedMemory,
} from "../../ffi/mod.ts";
import { spawnDeno, threadNamesOf } from "./process.ts";

const pf = loadLibrary();

function codeOf(fn: () => unknown): string {
  try {
    fn();
  } catch (e) {
    if (e instanceof NativeError) return `${e.codeName}: ${e.message}`;
    throw e;
  }
  return "ok";
}

/** Collects records of `tag` until its BATCH record. */
function collect(ring: CompletionRing, tag: number): Promise<Completion[]> {
  return new Promise((resolve, reject) => {
    const out: Completion[] = [];
    const sub = ring.completions$.subscribe({
      next: (c) => {
        if (c.tag !== tag) return;
        out.push(c);
        if (c.kind === COMPLETION_KIND.BATCH) {
          queueMicrotask(() => sub.unsubscribe());
          resolve(out);
        }
      },
      error: reject,
    });
  });
}

Deno.test("closing a region, pool, engine or ring while a batch is in flight fails with EBUSY", async () => {
  const engine = Engine.open({ backend: "host", workers: 1 });
  const pool = engine.createPool(1 << 20);
  const region = engine.allocRegion(1 << 16);
  const ring = new CompletionRing(16);
  // 20 groups post 21 records into a 16-record ring nobody reads yet, so the
  // worker is parked on a full ring and the batch stays in flight.
  const b = new CopyBatch(20, 20).reset("d2h");
  for (let g = 0; g < 20; g++) b.group(region, g).seg(g * 512, g * 512, 512);
  const desc = b.finish();
  assert.equal(
    pf.pf_copy_submit(engine.handle, pool.handle, ring.handle, desc, BigInt(desc.length), 42n),
    0,
  );
  assert.ok(region.info().inflight > 0, "the batch should still hold the region");
  assert.match(
    codeOf(() => region.close()),
    /^PF_EBUSY: .*layer groups in flight; drain them before closing/,
  );
  assert.match(codeOf(() => pool.close()), /^PF_EBUSY: .*batches in flight/);
  assert.match(codeOf(() => engine.close()), /^PF_EBUSY: .*still has 2 pools\/regions/);
  assert.match(codeOf(() => ring.destroy()), /^PF_EBUSY/);
  // Start consuming: the producer gets room and the batch finishes, with
  // every record delivered in order.
  const records = await collect(ring, 42);
  assert.deepEqual(records.map((c) => c.kind === COMPLETION_KIND.LAYER ? c.aux : -1), [
    ...Array.from({ length: 20 }, (_, i) => i),
    -1,
  ]);
  assert.equal(region.info().inflight, 0);
  region.close();
  pool.close();
  await ring.shutdown();
  ring.destroy();
  engine.close();
});

Deno.test("a ring far smaller than a batch delivers every record (backpressure, no loss)", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20, ringCapacity: 16, workers: 2 });
  const region = ce.engine.allocRegion(1 << 20);
  try {
    const b = new CopyBatch(300, 300).reset("h2d");
    for (let g = 0; g < 300; g++) b.group(region, 1000 + g).seg(g * 1024, g * 1024, 1024);
    const s = ce.submit(b);
    const layers = lastValueFrom(s.layers$.pipe(toArray()));
    const r = await s.done;
    assert.equal(r.status, 0);
    assert.equal(r.bytes, 300 * 1024);
    assert.deepEqual(await layers, Array.from({ length: 300 }, (_, i) => 1000 + i));
  } finally {
    region.close();
    await ce.close();
  }
});

Deno.test("many concurrent batches each complete once with their own bytes", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 16 << 20, workers: 3 });
  const region = ce.engine.allocRegion(4 << 20);
  try {
    const src = new Uint8Array(4 << 20);
    for (let i = 0; i < src.length; i++) src[i] = (i * 2654435761) >>> 24;
    region.write(0, src);
    const BATCHES = 64, GROUPS = 4, SEGS = 16, SEG = 4096;
    const batches = Array.from({ length: BATCHES }, () => new CopyBatch(GROUPS, GROUPS * SEGS));
    const subs = batches.map((b, k) => {
      b.reset("d2h");
      for (let g = 0; g < GROUPS; g++) {
        b.group(region, g);
        for (let s = 0; s < SEGS; s++) {
          // Batch k reads a scattered set and writes its own pool slice.
          const i = (k * GROUPS + g) * SEGS + s;
          b.seg(((i * 37) % 1024) * SEG, i * SEG, SEG);
        }
      }
      return ce.submit(b);
    });
    assert.equal(new Set(subs.map((s) => s.tag)).size, BATCHES);
    const results = await Promise.all(subs.map((s) => s.done));
    for (const r of results) {
      assert.equal(r.status, 0);
      assert.equal(r.bytes, GROUPS * SEGS * SEG);
    }
    const pool = ce.pool.view(0, BATCHES * GROUPS * SEGS * SEG);
    for (let i = 0; i < BATCHES * GROUPS * SEGS; i++) {
      const from = ((i * 37) % 1024) * SEG;
      for (let j = 0; j < SEG; j += 511) {
        assert.equal(pool[i * SEG + j], src[from + j], `segment ${i} byte ${j}`);
      }
    }
    assert.equal(ce.inflight, 0);
  } finally {
    region.close();
    await ce.close();
  }
});

Deno.test("progress words in shared memory count landed groups and then the status", async () => {
  const name = `/pegaflow-test-progress-${Deno.pid}`;
  const shm = SharedMemory.open(name, 64, { create: true, unlink: true });
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20, workers: 2 });
  const region = ce.engine.allocRegion(1 << 16);
  try {
    const words = new Uint32Array(shm.view().buffer, 0, 16);
    words[4] = 777; // stale values a new batch must reset
    words[5] = 777;
    const b = new CopyBatch(8, 8).reset("h2d", "host", { shm, offset: 16 });
    for (let g = 0; g < 8; g++) b.group(region, g).seg(g * 1024, g * 1024, 1024);
    const s = ce.submit(b);
    const seen: number[] = [];
    s.layers$.subscribe(() => seen.push(words[4]));
    assert.equal((await s.done).status, 0);
    assert.equal(words[4], 8, "groups done");
    assert.equal(words[5], 1, "final status: ok");
    // Each LAYER record is posted after its progress word was stored.
    seen.forEach((v, i) => assert.ok(v >= i + 1, `progress ${v} behind layer ${i}`));
    // A second process can map the same words by name.
    const other = SharedMemory.open(name, 64);
    assert.equal(new Uint32Array(other.view().buffer)[4], 8);
    other.close();
    // Misaligned or out-of-range progress offsets are refused.
    b.reset("h2d", "host", { shm, offset: 60 }).group(region, 0).seg(0, 0, 8);
    assert.throws(() => ce.submit(b), /progress_off 60 must be 8-aligned with 8 bytes inside shm/);
    b.reset("h2d", "host", { shm: 12345, offset: 0 }).group(region, 0).seg(0, 0, 8);
    assert.throws(() => ce.submit(b), /PF_EHANDLE/);
  } finally {
    region.close();
    await ce.close();
    shm.close();
  }
});

Deno.test("shutdown wakes every pending wait and completes the observable", async () => {
  const ring = new CompletionRing(64);
  const waits = [0, 1, 2].map(() => pf.pf_ring_wait(ring.handle, 0n, -1));
  const done = lastValueFrom(ring.completions$.pipe(toArray()));
  await new Promise((r) => setTimeout(r, 20)); // let the waits block
  assert.match(codeOf(() => ring.destroy()), /^PF_EBUSY/);
  await ring.shutdown();
  for (const w of await Promise.all(waits)) assert.equal(Number(w), -9); // PF_ESHUTDOWN
  assert.deepEqual(await done, []);
  ring.destroy();
  // Waiting on a destroyed ring is a handle error, not a hang.
  assert.equal(Number(await pf.pf_ring_wait(ring.handle, 0n, -1)), -2);
});

Deno.test("a wait with a timeout returns PF_ETIMEDOUT when nothing arrives", async () => {
  const ring = new CompletionRing(16);
  assert.equal(Number(await pf.pf_ring_wait(ring.handle, 0n, 10)), -10);
  await ring.shutdown();
  ring.destroy();
});

Deno.test("a process with waits pending exits once the ring is shut down", async () => {
  const child = spawnDeno(new URL("./shutdown_child.ts", import.meta.url), []);
  const timer = setTimeout(() => child.proc.kill("SIGKILL"), 20_000);
  try {
    assert.equal(await child.line(), "waiting");
    assert.equal(await child.line(), "shut down");
    assert.equal(await child.line(), null);
    const status = await child.proc.status;
    assert.equal(status.code, 0, "the child should exit by itself");
  } finally {
    clearTimeout(timer);
    await child.closeStdin().catch(() => {});
  }
});

Deno.test("the copy engine's threads carry their names (top, perf and /proc say whose CPU)", async () => {
  assert.deepEqual(await threadNamesOf("host", { "pf-host-copy": 3 }), {
    open: { "pf-host-copy": 3 },
    closed: { "pf-host-copy": 0 },
  });
});
