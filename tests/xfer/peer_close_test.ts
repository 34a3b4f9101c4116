/**
 * A peer's close() while its connect() is still waiting: the connect gives
 * up at once with PF_ESHUTDOWN and the close resolves after it (the library
 * frees the peer only once the connect has let go of it; before, the close
 * freed it under the connect). Also: one connect at a time per peer.
 */
import assert from "node:assert/strict";
import { NativeError, PF_STATUS } from "../../ffi/mod.ts";
import { LocalNode, silentListener } from "./_harness.ts";

const MiB = 1 << 20;

function isCode(code: number, text: RegExp) {
  return (e: unknown) => {
    assert.ok(e instanceof NativeError, String(e));
    assert.equal(e.code, code, e.message);
    assert.match(e.message, text);
    return true;
  };
}

Deno.test("closing a peer while it connects fails the connect with PF_ESHUTDOWN, then closes", async () => {
  const node = new LocalNode(MiB, 1, { streams: 2 });
  const remote = silentListener();
  try {
    const peer = node.ep.createPeer();
    // 20 s: far past the test; only the close can end it this early.
    const connecting = peer.connect(remote.addr, 20_000);
    const settled = connecting.then(() => "connected", (e) => e);
    await new Promise((r) => setTimeout(r, 200)); // the connect waits for its hello now
    const second = peer.connect(remote.addr, 1000);
    await assert.rejects(second, isCode(PF_STATUS.PF_EBUSY, /a connect is already under way/));
    await peer.close();
    const e = await settled;
    isCode(PF_STATUS.PF_ESHUTDOWN, /peer \d+ is closed/)(e);
    assert.equal(node.ep.info().peers, 0);
  } finally {
    remote.close();
    await node.close();
  }
});
