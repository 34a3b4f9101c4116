/**
 * Closing transfer objects off the JS thread: an endpoint closed while a
 * peer's close is still running waits for it (before: PF_EBUSY and the
 * endpoint, its listener and threads, left open for good), a failed close
 * can be retried, and the error of a nonblocking close names what failed
 * instead of whatever the JS thread's pf_last_error last held.
 */
import assert from "node:assert/strict";
import { loadLibrary, NativeError } from "../../ffi/mod.ts";
import { xferLib } from "../../ffi/xfer.ts";
import { Registry } from "prom-client";
import { metricsResponse } from "../../lib/metrics.ts";
import { registerTransferMetrics } from "../../lib/transfer/metrics.ts";
import { LocalNode } from "./_harness.ts";

const MiB = 1 << 20;

/** A failing call on the JS thread, leaving its text in this thread's pf_last_error. */
function staleJsThreadError(): void {
  assert.ok(loadLibrary().pf_pool_info(0, new Uint8Array(32)) < 0);
}

Deno.test("an endpoint closed right after an unawaited peer.close() waits for that peer", async () => {
  const a = new LocalNode(4 * MiB, 1);
  try {
    for (let i = 0; i < 5; i++) {
      const b = new LocalNode(4 * MiB, 2);
      const peer = b.ep.createPeer();
      await peer.connect(`127.0.0.1:${a.ep.info().port}`, 5000);
      staleJsThreadError();
      // As XferPeers.drop and the lender's retire do: close, not awaited.
      const closing = peer.close();
      try {
        await b.ep.close();
      } catch (e) {
        await closing;
        // Before: PF_EBUSY whose text was the stale pf_pool_info one.
        assert.fail(`round ${i}: ${(e as Error).message}`);
      } finally {
        await closing;
      }
      assert.throws(
        () => b.ep.info(),
        (e) => e instanceof NativeError && e.codeName === "PF_EHANDLE",
      );
      await b.ring.shutdown();
      b.ring.destroy();
      b.pool.close();
      b.engine.close();
    }
  } finally {
    await a.close();
  }
});

Deno.test("a failed endpoint close names the endpoint and its open peers, and can be retried", async () => {
  const b = new LocalNode(4 * MiB, 2);
  // A peer the XferEndpoint object does not track (made through the raw symbol).
  const raw = new Uint32Array(1);
  assert.equal(xferLib().pf_xfer_peer_create(b.ep.handle, raw), 0);
  staleJsThreadError();
  await assert.rejects(b.ep.close(), (e: unknown) => {
    assert.ok(e instanceof NativeError, String(e));
    assert.equal(e.codeName, "PF_EBUSY");
    assert.doesNotMatch(e.message, /pf_pool_info/);
    assert.match(e.message, new RegExp(`endpoint ${b.ep.handle} still has 1 peer`));
    return true;
  });
  // The endpoint is still open: a second close must try again, not return.
  assert.equal(b.ep.info().peers, 1);
  assert.equal(await xferLib().pf_xfer_peer_close(raw[0]), 0);
  await b.ep.close();
  assert.throws(() => b.ep.info(), (e) => e instanceof NativeError && e.codeName === "PF_EHANDLE");
  await b.ring.shutdown();
  b.ring.destroy();
  b.pool.close();
  b.engine.close();
});

Deno.test("the transfer metrics stop reading an endpoint once it is closed, keeping their last values", async () => {
  const b = new LocalNode(4 * MiB, 2);
  const registry = new Registry();
  registerTransferMetrics(registry, () => b.ep);
  const scrape = async () => await (await metricsResponse(registry)).text();
  try {
    assert.match(await scrape(), /pegaflow_transfer_batches_total\{result="ok"\} 0/);
    await b.ep.close();
    assert.ok(b.ep.closed);
    const after = await scrape();
    assert.doesNotMatch(after, /unavailable/, after);
    assert.match(after, /pegaflow_transfer_batches_total\{result="ok"\} 0/);
  } finally {
    await b.ring.shutdown();
    b.ring.destroy();
    b.pool.close();
    b.engine.close();
  }
});

Deno.test("a peer whose close began reads as shut down without asking the library (which frees it meanwhile)", async () => {
  const a = new LocalNode(4 * MiB, 1);
  const b = new LocalNode(4 * MiB, 2);
  try {
    const peer = b.ep.createPeer();
    await peer.connect(`127.0.0.1:${a.ep.info().port}`, 5000);
    assert.equal(peer.state().connected, true);
    const closing = peer.close();
    // Asked while the close runs on another thread, and after: never a read of the freed peer.
    for (const s of [peer.state(), (await closing, peer.state())]) {
      assert.deepEqual(s, { connected: false, remoteBytes: 0, inflight: 0, broken: -9 });
    }
    assert.match(peer.lastError(), /is closed/);
    assert.throws(
      () => peer.info(),
      (e) => e instanceof NativeError && /is closed/.test(e.message),
    );
  } finally {
    await b.close();
    await a.close();
  }
});
