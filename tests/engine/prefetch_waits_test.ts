// WaitPrefetch's holds (lib/engine/prefetch_waits.ts): each ends exactly once, with the fetch
// (true), at its wait (false) or at shutdown (false), and leaves no timer behind (Deno's
// sanitizers fail a test that does).
import { strictEqual } from "node:assert/strict";
import { PrefetchWaits } from "../../lib/engine/prefetch_waits.ts";

/** A fetch the test ends by hand. */
function fetchSlot() {
  let end!: () => void;
  let fail!: (e: Error) => void;
  const p = new Promise<void>((res, rej) => ((end = res), (fail = rej)));
  return { p, end, fail };
}

Deno.test("a hold is answered true when its fetch ends, before its wait", async () => {
  const w = new PrefetchWaits();
  const f = fetchSlot();
  const t0 = performance.now();
  const held = w.hold(f.p, 10_000);
  strictEqual(w.size, 1);
  setTimeout(f.end, 20);
  strictEqual(await held, true);
  strictEqual(w.size, 0);
  strictEqual(performance.now() - t0 < 5_000, true, "the fetch's end, not the wait's");
});

Deno.test("a hold is answered false at its wait while the fetch still runs; the fetch ending later changes nothing", async () => {
  const w = new PrefetchWaits();
  const f = fetchSlot();
  const t0 = performance.now();
  strictEqual(await w.hold(f.p, 30), false);
  strictEqual(performance.now() - t0 >= 25, true, "held for its wait");
  strictEqual(w.size, 0);
  f.end();
  await f.p;
});

Deno.test("no fetch: true at once; a fetch that fails counts as ended (the next query finds out)", async () => {
  const w = new PrefetchWaits();
  strictEqual(await w.hold(undefined, 10_000), true);
  const f = fetchSlot();
  const held = w.hold(f.p, 10_000);
  f.fail(new Error("read failed"));
  strictEqual(await held, true);
});

Deno.test("close answers every hold false and later ones at once", async () => {
  const w = new PrefetchWaits();
  const a = fetchSlot(), b = fetchSlot();
  const held = [w.hold(a.p, 10_000), w.hold(b.p, 10_000)];
  w.close();
  strictEqual(w.size, 0);
  const [x, y] = await Promise.all(held);
  strictEqual(x, false);
  strictEqual(y, false);
  strictEqual(await w.hold(fetchSlot().p, 10_000), false, "after close: no hold");
  a.end();
  b.end();
});
