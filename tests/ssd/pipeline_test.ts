import assert from "node:assert/strict";
import { map, timer } from "rxjs";
import { TestScheduler } from "rxjs/testing";
import { stage } from "../../lib/pipeline/stage.ts";
import { prefetchStageOptions } from "../../lib/ssd/prefetch.ts";
import { writeStageOptions } from "../../lib/ssd/write_behind.ts";
import { FP, harness } from "./_harness.ts";

const newScheduler = () => new TestScheduler((a, b) => assert.deepEqual(a, b));

Deno.test("write-behind stage: a burst past inflight + depth drops the newest batches at once", () => {
  newScheduler().run(({ cold, expectObservable }) => {
    // 1 write in flight, 2 queued; five batches arrive in one frame; each write takes 10 frames.
    const batches = cold("(abcde|)");
    const out = batches.pipe(
      stage("ssd.write", writeStageOptions(2, 1), (b: string) => timer(10).pipe(map(() => b))),
      map((o) => `${o.input}:${o.status}`),
    );
    expectObservable(out).toBe("(xy) 6ms z 9ms v 9ms (w|)", {
      x: "d:dropped",
      y: "e:dropped",
      z: "a:done",
      v: "b:done",
      w: "c:done",
    });
  });
});

Deno.test("prefetch stage: a full queue refuses at once (the query answers with what RAM has)", () => {
  newScheduler().run(({ cold, expectObservable }) => {
    const reqs = cold("(abc) 7ms d|"); // a, b, c at frame 0; d at 12
    const out = reqs.pipe(
      stage(
        "ssd.prefetch",
        prefetchStageOptions(1, 1),
        (r: string) => timer(10).pipe(map(() => r)),
      ),
      map((o) => `${o.input}:${o.status}`),
    );
    // a runs (0-10), b waits in the queue of 1, c is refused at once; b runs 10-20 and d,
    // arriving at 12 into the freed queue place, runs 20-30.
    expectObservable(out).toBe("c 9ms a 9ms b 9ms (d|)", {
      c: "c:refused",
      a: "a:done",
      b: "b:done",
      d: "d:done",
    });
  });
});

Deno.test("a refused prefetch frees its pool space and budget and answers miss", async () => {
  const MiB = 1 << 20, BLOCK = 64 * 1024;
  const h = await harness();
  const tier = await h.openTier({
    capacityBytes: 32 * MiB,
    segmentBytes: MiB,
    prefetchQueueDepth: 1,
    prefetchInflight: 1,
  });
  try {
    const keys = Array.from({ length: 9 }, (_, i) => `ns/q${i}`);
    h.write(tier, keys.map((k, i) => (h.fill(k, i * BLOCK, BLOCK), h.block(k, i * BLOCK, BLOCK))));
    await tier.flushWrites();
    const alloc = h.allocator(8 * MiB);
    assert.equal(tier.prefetch("r1", keys.slice(0, 3), alloc, FP).state, "loading");
    assert.equal(tier.prefetch("r2", keys.slice(3, 6), alloc, FP).state, "loading");
    assert.deepEqual(tier.prefetch("r3", keys.slice(6, 9), alloc, FP), {
      state: "miss",
      reason: "queue-full",
    });
    assert.equal(alloc.freed, 3, "r3's allocations were returned");
    assert.equal(tier.stats().prefetchReservedBlocks, 6);
    assert.equal(tier.stats().prefetchBackpressure, 1);
    // A query of a prefix already being read joins it: no queue slot needed.
    assert.equal(tier.prefetch("r4", keys.slice(0, 3), alloc, FP).state, "loading");
    assert.equal(alloc.given, 9, "the joiner allocated nothing");
  } finally {
    await tier.close();
    await h.close();
  }
});
