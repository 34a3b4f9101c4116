/**
 * Views over native memory are refused once their owner is closed. Before,
 * `Pool.view` after `close()` handed out a Uint8Array over the unmapped pool
 * (a write through it landed in the next pool mmap placed there),
 * `SharedMemory.view` after `close()` one over the unmapped object (a touch
 * killed the process with SIGSEGV), and `Uring.headers` stayed a view of
 * the arena pf_uring_close frees (writing it corrupts the C heap).
 */
import assert from "node:assert/strict";
import { CompletionRing, Engine, NativeError, SharedMemory } from "../../ffi/mod.ts";
import { PegaflowIoError, Uring } from "../../ffi/uring.ts";
import { spawnDeno } from "./process.ts";

function isClosed(fn: string) {
  return (e: unknown) =>
    (e instanceof NativeError && e.codeName === "PF_EHANDLE" && e.fn === fn &&
      /is closed/.test(e.message)) ||
    (e instanceof PegaflowIoError && e.code === -2 && e.call === fn && /is closed/.test(e.message));
}

Deno.test("Pool.view throws after close", () => {
  const engine = Engine.open({ backend: "host", workers: 1 });
  const pool = engine.createPool(1 << 20);
  assert.equal(pool.view(0, 16).length, 16);
  pool.close();
  try {
    assert.throws(() => pool.view(0, 16), isClosed("Pool.view"));
  } finally {
    engine.close();
  }
});

Deno.test("SharedMemory.view throws after close", () => {
  const shm = SharedMemory.open(`/pf-uac-${Deno.pid}`, 4096, { create: true, unlink: true });
  assert.equal(shm.view().length, 4096);
  shm.close();
  assert.throws(() => shm.view(), isClosed("SharedMemory.view"));
});

Deno.test("Uring.headers throws once the io_uring is closed", async () => {
  const engine = Engine.open({ backend: "host", workers: 1 });
  const pool = engine.createPool(1 << 20);
  const ring = new CompletionRing(64);
  const u = Uring.open(pool.handle, ring.handle, 8, 2);
  try {
    assert.equal(u.headers.length, 2 * 4096);
    await u.close();
    assert.throws(() => u.headers, isClosed("Uring.headers"));
  } finally {
    await u.close();
    await ring.shutdown();
    ring.destroy();
    pool.close();
    engine.close();
  }
});

Deno.test("destroying the ring from a completions$ subscriber is refused, not freed under its reader", async () => {
  // Before: destroy() succeeded (no wait pending in C at that moment) and
  // the reader then stored the tail word into unmapped memory: SIGSEGV.
  const child = spawnDeno(new URL("./ring_destroy_child.ts", import.meta.url), []);
  const outcome = await child.line();
  const done = await child.line();
  const status = await child.proc.status;
  assert.equal(status.signal, null, `child killed by ${status.signal}`);
  assert.match(
    outcome ?? "",
    /^refused: pf_ring_destroy failed with PF_EBUSY: ring \d+: its reader/,
  );
  assert.equal(done, "exited cleanly");
  assert.equal(status.code, 0);
});
