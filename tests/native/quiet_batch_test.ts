/**
 * Quiet batches (`PF_BATCH_QUIET`, `CopyEngine.submitQuiet`): the library
 * posts the BATCH record only, none per group, while the bytes, the progress
 * words and a failure's text are what a loud batch gives.
 */
import assert from "node:assert/strict";
import {
  type Completion,
  COMPLETION_KIND,
  CopyBatch,
  CopyEngine,
  PF_STATUS,
  type Region,
} from "../../ffi/mod.ts";
import { assertQuietProgress } from "./_quiet_progress.ts";

const KB = 1024;
const GROUPS = 6;

/** Every record of the engine's ring, as it is read. */
function record(ce: CopyEngine): { records: Completion[]; stop: () => void } {
  const records: Completion[] = [];
  const sub = ce.ring.completions$.subscribe((c) => records.push(c));
  return { records, stop: () => sub.unsubscribe() };
}

function gather(b: CopyBatch, region: Region, poolBase: number): CopyBatch {
  b.reset("d2h");
  for (let g = 0; g < GROUPS; g++) {
    b.group(region, 100 + g).seg(g * 4 * KB, poolBase + g * 4 * KB, 4 * KB);
  }
  return b;
}

Deno.test("a quiet batch posts one record, its BATCH, and lands every byte; the same buffer submitted loud posts one per group again", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20, workers: 2 });
  const region = ce.engine.allocRegion(64 * KB);
  const seen = record(ce);
  try {
    const data = new Uint8Array(GROUPS * 4 * KB).map((_, i) => (i * 13 + 5) & 0xff);
    region.write(0, data);
    const b = new CopyBatch(GROUPS, GROUPS);
    const r = await ce.submitQuiet(gather(b, region, 0));
    assert.equal(r.status, 0);
    assert.equal(r.bytes, GROUPS * 4 * KB);
    assert.equal(r.path, "host");
    assert.deepEqual(ce.pool.view(0, data.length), data);
    const quietTag = seen.records.at(-1)!.tag;
    assert.deepEqual(
      seen.records.filter((c) => c.tag === quietTag).map((c) => c.kind),
      [COMPLETION_KIND.BATCH],
    );

    // submit() clears the bit the quiet submit set in this buffer.
    const s = ce.submit(gather(b, region, 64 * KB));
    const layers: number[] = [];
    s.layers$.subscribe((l) => layers.push(l));
    assert.equal((await s.done).bytes, GROUPS * 4 * KB);
    assert.deepEqual(layers, [100, 101, 102, 103, 104, 105]);
    assert.equal(seen.records.filter((c) => c.tag === s.tag).length, GROUPS + 1);
    assert.equal(ce.inflight, 0);
  } finally {
    seen.stop();
    region.close();
    await ce.close();
  }
});

Deno.test("a quiet batch still stores its progress words group by group and then its status", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20, workers: 2 });
  const region = ce.engine.allocRegion(64 * KB);
  try {
    await assertQuietProgress(ce, "test-quiet", GROUPS, (progress) => {
      const b = new CopyBatch(GROUPS, GROUPS).reset("h2d", "host", progress);
      for (let g = 0; g < GROUPS; g++) b.group(region, g).seg(g * KB, g * KB, KB);
      return b;
    });
  } finally {
    region.close();
    await ce.close();
  }
});

Deno.test("a quiet batch that faults resolves with the failure's text and 0 bytes; the engine carries on", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20, workers: 2 });
  const own = ce.engine.allocRegion(64 * KB);
  const imported = ce.engine.importRegion(own.handle, 64 * KB);
  const seen = record(ce);
  try {
    const name = new TextDecoder().decode(own.handle).replace(/\0+$/, "");
    Deno.truncateSync(`/dev/shm${name}`, 0); // the client shrinks its file behind the mapping
    const b = new CopyBatch(GROUPS, GROUPS);
    const r = await ce.submitQuiet(gather(b, imported, 0));
    assert.equal(r.status, PF_STATUS.PF_EFAULT);
    assert.equal(r.bytes, 0);
    assert.match(r.error ?? "", /group 0 \(layer 100\): region \d+ .* faulted at offset 0/);
    const tag = seen.records.at(-1)!.tag;
    assert.deepEqual(seen.records.filter((c) => c.tag === tag).map((c) => c.kind), [
      COMPLETION_KIND.BATCH,
    ]);

    const ok = ce.engine.allocRegion(64 * KB);
    try {
      assert.equal((await ce.submitQuiet(gather(b, ok, 0))).status, 0);
    } finally {
      ok.close();
    }
  } finally {
    seen.stop();
    imported.close();
    own.close();
    await ce.close();
  }
});

Deno.test("close() waits for a quiet batch in flight before it frees the ring and pool", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 8 << 20, workers: 1 });
  const region = ce.engine.allocRegion(4 << 20);
  const b = new CopyBatch(1, 1).reset("d2h");
  b.group(region, 0).seg(0, 0, 4 << 20);
  let settled = false;
  const done = ce.submitQuiet(b).then((r) => {
    settled = true;
    return r;
  });
  // The region is still open, so the engine's close at the very end refuses;
  // everything before it (the wait, the ring, the pool) has run by then.
  await assert.rejects(ce.close(), /still has 1 pools\/regions/);
  assert.ok(settled, "close() went on before the quiet batch it waits for had ended");
  assert.equal((await done).status, 0);
  region.close();
  ce.engine.close();
});
