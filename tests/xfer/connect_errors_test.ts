/**
 * A refused XferPeer.connect names why. The library's argument checks
 * (empty remote, timeout, already connected) fail on the worker thread that
 * ran the nonblocking call, and the peer keeps only a failed attempt's text:
 * those refusals used to carry "" or the text of an earlier attempt (another
 * address's "Connection refused").
 */
import assert from "node:assert/strict";
import { NativeError } from "../../ffi/mod.ts";
import { LocalNode } from "./_harness.ts";

function refused(code: string, why: RegExp) {
  return (e: unknown) => {
    assert.ok(e instanceof NativeError, String(e));
    assert.equal(e.codeName, code, e.message);
    assert.match(e.message, why);
    assert.doesNotMatch(e.message, /Connection refused/);
    return true;
  };
}

Deno.test("connect refusals name their reason, not an earlier attempt's", async () => {
  const a = new LocalNode(1 << 20, 1);
  const b = new LocalNode(1 << 20, 2);
  const peer = b.ep.createPeer();
  try {
    const l = Deno.listen({ hostname: "127.0.0.1", port: 0 });
    const dead = (l.addr as Deno.NetAddr).port;
    l.close();
    await assert.rejects(peer.connect(`127.0.0.1:${dead}`, 2000), /Connection refused/);
    const live = `127.0.0.1:${a.ep.info().port}`;
    const h = peer.handle;
    await assert.rejects(
      peer.connect(live, 0),
      refused("PF_EINVAL", new RegExp(`peer ${h}: timeoutMs 0 must be`)),
    );
    await assert.rejects(
      peer.connect("", 1000),
      refused("PF_EINVAL", new RegExp(`peer ${h}: remote info is empty`)),
    );
    await peer.connect(live, 2000);
    await assert.rejects(
      peer.connect(live, 2000),
      refused("PF_EINVAL", new RegExp(`peer ${h}: is already connected`)),
    );
    assert.equal(peer.state().connected, true);
  } finally {
    await peer.close();
    await b.close();
    await a.close();
  }
});
