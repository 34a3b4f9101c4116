/**
 * A hung disk: io batches whose completion does not come. The seam holds
 * back the SSD's completion records on their way from the ring to the tier,
 * which is what a slow kernel looks like from JS (the ops themselves ran,
 * so the test's pool pages are safe; the tier cannot tell). The tier must
 * degrade (logged with the path and the oldest op, counted), keep the stuck
 * batch's pins, drop new writes and miss prefetches, give flush() and
 * close() a deadline that names what is outstanding, and recover once the
 * completions arrive.
 */
import assert from "node:assert/strict";
import { Registry } from "prom-client";
import { registerSsdMetrics } from "../../lib/ssd/metrics.ts";
import { SsdStalledError, type SsdTierOptions } from "../../lib/ssd/tier.ts";
import { FP, type Harness, harness, holdingRing, TEST_NAMESPACE, within } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 64 * 1024;

/** A tier of 8 MiB in 1 MiB segments on `ring` (the harness's, or one that holds io back). */
function open(h: Harness, ring: SsdTierOptions["ring"], o: Partial<SsdTierOptions> = {}) {
  return h.openTier({ ring, capacityBytes: 8 * MiB, segmentBytes: MiB, ...o });
}

async function until(cond: () => boolean, ms: number, what: string): Promise<void> {
  const end = performance.now() + ms;
  while (!cond()) {
    if (performance.now() > end) throw new Error(`${what} did not happen within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

const key = (s: string) => `${TEST_NAMESPACE}/${s}`;

Deno.test("a write batch the disk never completes degrades the tier: logged with its path and offset, its pins kept, new writes dropped, prefetches miss, flush gives up; the tier recovers when it completes", async () => {
  const h = await harness();
  const { ring, held } = holdingRing(h.ring);
  const tier = await open(h, ring, { ioStallMs: 200, closeTimeoutMs: 10_000 });
  try {
    h.fill(key("old"), 0, BLOCK);
    h.write(tier, [h.block(key("old"), 0, BLOCK)]);
    await within(tier.flushWrites(), 5_000, "the first write");
    held.on = true;
    const stuck = [h.block(key("s0"), BLOCK, BLOCK), h.block(key("s1"), 2 * BLOCK, BLOCK)];
    assert.equal(h.write(tier, stuck).status, "queued");
    await until(() => tier.degraded, 5_000, "the tier degrading");
    const path = tier.files[0].path;
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes("SSD io stalled") &&
        l.includes(`"path":"${path}"`) && l.includes('"offset":') && l.includes('"op":"write"')
      ),
      h.logs.join("\n"),
    );
    for (const b of stuck) assert.equal(b.pins, 1, `${b.key}: the kernel may still read it`);
    // New work is not queued behind the stalled disk.
    const later = h.block(key("later"), 3 * BLOCK, BLOCK);
    assert.equal(h.write(tier, [later]).status, "dropped");
    assert.equal(later.pins, 0);
    assert.deepEqual(tier.prefetch("r1", [key("old")], h.allocator(8 * MiB), FP), {
      state: "miss",
      reason: "degraded",
    });
    let s = tier.stats();
    assert.equal(s.ioStalls, 1);
    assert.equal(s.ioDegraded, 1);
    assert.equal(s.writeDegradedDrops, 1);
    assert.equal(s.writeDegradedDroppedBlocks, 1);
    assert.equal(s.prefetchDegradedMisses, 1);
    const reg = new Registry();
    registerSsdMetrics(reg, () => tier.stats());
    const text = await reg.metrics();
    assert.match(text, /pegaflow_ssd_degraded 1/);
    assert.match(text, /pegaflow_ssd_io_stalls_total 1/);
    // flush() does not wait forever: it names what is outstanding.
    await assert.rejects(
      within(tier.flushWrites(), 5_000, "flush on a stalled disk"),
      (e: Error) =>
        e instanceof SsdStalledError && e.message.includes("the io is stalled") &&
        e.message.includes(path) && e.message.includes("1 write batches in flight"),
    );
    // The kernel completes: the pins go, the tier serves again.
    held.release();
    await until(() => !tier.degraded, 5_000, "the tier recovering");
    await within(tier.flushWrites(), 5_000, "flush after recovery");
    for (const b of stuck) assert.equal(b.pins, 0);
    assert.ok(h.logs.some((l) => l.includes("SSD io recovered")), h.logs.join("\n"));
    h.fill(key("later"), 3 * BLOCK, BLOCK);
    assert.equal(h.write(tier, [later]).status, "queued");
    await within(tier.flushWrites(), 5_000, "a write after recovery");
    assert.equal(tier.lookupPrefix([key("s0"), key("s1"), key("later")], FP), 3);
    s = tier.stats();
    assert.equal(s.ioDegraded, 0);
    assert.equal(s.writeBlocks, 4);
  } finally {
    held.release();
    await within(tier.close(), 5_000, "tier.close");
    await h.close();
  }
});

Deno.test("close on a stalled disk gives up at its deadline naming the outstanding write, and finishes once the kernel completes it", async () => {
  const h = await harness();
  const { ring, held } = holdingRing(h.ring);
  // The stall deadline is far off: close's own deadline ends the wait.
  const tier = await open(h, ring, { ioStallMs: 60_000, closeTimeoutMs: 300 });
  try {
    held.on = true;
    const stuck = [h.block(key("c0"), 0, BLOCK)];
    assert.equal(h.write(tier, stuck).status, "queued");
    await within(tier.close(), 5_000, "close on a stalled disk");
    const path = tier.files[0].path;
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes("SSD close gave up") &&
        l.includes("deadline 300 ms") && l.includes(`"path":"${path}"`) &&
        l.includes('"op":"write"') && l.includes('"writeInflight":1')
      ),
      h.logs.join("\n"),
    );
    assert.equal(stuck[0].pins, 1, "the pin stays while the kernel may read its pages");
    held.release();
    await until(() => h.logs.some((l) => l.includes("SSD close finished")), 5_000, "close");
    assert.equal(stuck[0].pins, 0);
    // The engine and the file's lock are gone: the next tier opens the file and finds the block.
    const again = await open(h, h.ring, {});
    try {
      assert.equal(again.lookupPrefix([key("c0")], FP), 1);
    } finally {
      await again.close();
    }
  } finally {
    held.release();
    await h.close();
  }
});
