/**
 * A server whose pool takes a while to pre-touch says so while it works:
 * progress lines (phase, bytes touched of total, rate, elapsed, backend,
 * device) appear before the pool is announced ready. Real server process;
 * --pool-progress-ms shortens the period so a small pool is enough.
 */
import assert from "node:assert/strict";
import { startServer } from "./harness.ts";

const POOL = 512 << 20;

Deno.test("start-up logs pool pre-touch progress before the pool is ready", async () => {
  // The shortest period: on a loaded 2-core CI machine a 10 ms timer once first fired after the
  // pool was done, and the start logged no progress line at all.
  const srv = await startServer(["--pool-size", "512mb", "--pool-progress-ms", "1"]);
  try {
    const lines = srv.logs().map((l) => JSON.parse(l) as Record<string, unknown>);
    const ready = lines.findIndex((l) => l.msg === "pinned pool ready");
    assert.ok(ready > 0, "no readiness line");
    const progress = lines
      .map((l, i) => ({ l, i }))
      .filter(({ l }) => l.msg === "pool creation progress");
    assert.ok(progress.length > 0, "no progress line while the pool was created");
    let last = 0;
    for (const { l, i } of progress) {
      assert.ok(i < ready, "a progress line after the pool was ready");
      assert.equal(l.backend, "host");
      assert.equal(l.device, 0);
      assert.equal(l.total_bytes, POOL);
      assert.ok(["map", "touch", "lock"].includes(l.phase as string), `phase ${l.phase}`);
      const touched = l.touched_bytes as number;
      assert.ok(touched >= last && touched <= POOL, `touched ${touched} after ${last}`);
      assert.equal(l.percent, Math.floor((100 * touched) / POOL));
      assert.equal(typeof l.gib_per_s, "number");
      assert.equal(typeof l.elapsed_ms, "number");
      last = touched;
    }
    assert.ok(progress.some(({ l }) => l.phase === "touch"), "no line during the pre-touch");
  } finally {
    await srv.stop();
  }
});
