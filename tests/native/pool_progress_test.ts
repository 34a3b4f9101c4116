/**
 * Creating a large pool takes seconds (pre-touch); createPoolAsync runs it
 * off the JS thread and reports how far it got while it works.
 */
import assert from "node:assert/strict";
import { Engine, NativeError, type PoolProgress } from "../../ffi/mod.ts";

const MB = 1 << 20;

Deno.test("a pool created off the JS thread reports pre-touch progress while it works", async () => {
  const engine = Engine.open({ backend: "host" });
  const seen: PoolProgress[] = [];
  const pool = await engine.createPoolAsync(512 * MB, { pretouch: true }, {
    intervalMs: 1,
    onProgress: (p) => seen.push(p),
  });
  try {
    const info = pool.info();
    assert.ok(info.pretouched);
    assert.equal(info.bytes, 512 * MB);
    assert.ok(seen.length > 0, "no progress reported while the pool was created");
    assert.ok(seen.some((p) => p.phase === "touch"), `phases seen: ${seen.map((p) => p.phase)}`);
    for (let i = 0; i < seen.length; i++) {
      const p = seen[i];
      assert.equal(p.backend, "host");
      assert.equal(p.totalBytes, 512 * MB);
      assert.ok(p.touchedBytes <= p.totalBytes);
      if (i > 0) assert.ok(p.touchedBytes >= seen[i - 1].touchedBytes, "progress went backwards");
    }
    // The timer stops with the call: nothing is reported after it returned.
    const n = seen.length;
    await new Promise((r) => setTimeout(r, 10));
    assert.equal(seen.length, n);
  } finally {
    pool.close();
    engine.close();
  }
});

Deno.test("a pool that cannot be created off the JS thread still reports the library's reason", async () => {
  const engine = Engine.open({ backend: "host" });
  try {
    await assert.rejects(
      engine.createPoolAsync(0, {}),
      (e: unknown) =>
        e instanceof NativeError && e.codeName === "PF_EINVAL" &&
        /pf_pool_create: bytes is 0/.test(e.message),
    );
  } finally {
    engine.close();
  }
});
