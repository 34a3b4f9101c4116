/**
 * The cache file's lock in this process: a lock in transition (closed here, or its open file
 * still shared a moment longer, as with a child being spawned) is waited out for a short while
 * instead of refusing a tier reopened in place; held for good, it is refused naming this pid.
 */
import assert from "node:assert/strict";
import { lockCacheFile, SsdLockedError } from "../../lib/ssd/file_lock.ts";

async function tempFile(): Promise<string> {
  const dir = await Deno.makeTempDir({ prefix: "pf-ssd-flock-" });
  const path = `${dir}/pegaflow-ssd.cache`;
  Deno.writeFileSync(path, new Uint8Array(0));
  return path;
}

function holder(path: string, holdMs: number) {
  const w = new Worker(new URL("./_lock_holder_worker.ts", import.meta.url).href, {
    type: "module",
  });
  const next = () =>
    new Promise<string>((resolve) => {
      w.onmessage = (e: MessageEvent<string>) => {
        resolve(e.data);
      };
    });
  const first = next();
  w.postMessage({ path, holdMs });
  return { worker: w, first, next };
}

Deno.test("a lock this process lets go of within the settle time is waited out, not refused", async () => {
  const path = await tempFile();
  const h = holder(path, 80);
  try {
    assert.equal(await h.first, "locked");
    const released = h.next();
    const t0 = performance.now();
    const f = await lockCacheFile(path); // retries; the worker's thread lets go at 80 ms
    const waited = performance.now() - t0;
    await f.close();
    assert.equal(await released, "released");
    assert.ok(waited >= 40 && waited < 500, `waited ${waited.toFixed(1)} ms`);
  } finally {
    h.worker.terminate();
    await Deno.remove(path.slice(0, path.lastIndexOf("/")), { recursive: true });
  }
});

Deno.test("a lock this process keeps past the settle time is refused, naming this pid", async () => {
  const path = await tempFile();
  const held = Deno.openSync(path, { read: true, write: true });
  try {
    assert.ok(held.tryLockSync(true));
    const t0 = performance.now();
    await assert.rejects(
      lockCacheFile(path, 60),
      (e: unknown) => {
        assert.ok(e instanceof SsdLockedError);
        assert.equal(e.holderPid, Deno.pid);
        assert.ok(e.message.includes(path), e.message);
        return true;
      },
    );
    assert.ok(performance.now() - t0 >= 55, "it waited the settle time first");
  } finally {
    held.close();
    await Deno.remove(path.slice(0, path.lastIndexOf("/")), { recursive: true });
  }
});
