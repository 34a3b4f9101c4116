/**
 * The requester's transfer connections (lib/peer/xfer_peers.ts), over two
 * real TCP endpoints in this process: a link is made once per owner by the
 * handshake, a broken one is dropped and made again, and a drop that names a
 * peer which is no longer the owner's link (a second fetch that failed on
 * the same broken peer, after a third made the new link) leaves the new link
 * alone — it used to forget it, so the next fetch handshook again and the
 * forgotten peer stayed open, never closed until the endpoint was.
 */
import assert from "node:assert/strict";
import { Logger } from "../../lib/log.ts";
import { XferPeers } from "../../lib/peer/xfer_peers.ts";
import { LocalNode } from "../xfer/_harness.ts";

const log = new Logger("error", { component: "xfer-peers-test" });

Deno.test("a drop naming a peer that was already replaced leaves the owner's new link in place (no orphaned peer, no extra handshake)", async () => {
  const owner = new LocalNode(1 << 20, 1), req = new LocalNode(1 << 20, 2);
  const ownerAddr = "owner:50055";
  let trades = 0;
  const peers = new XferPeers(req.ep, 2000, log, {
    transport: "tcp",
    trade: (addr, _info) => {
      assert.equal(addr, ownerAddr);
      trades++;
      const listener = `127.0.0.1:${owner.ep.info().port}`;
      return Promise.resolve({
        transport: "tcp",
        peerInfo: new TextEncoder().encode(listener),
        rpcAddr: "",
      });
    },
  });
  try {
    const first = await peers.get(ownerAddr);
    // Two fetches read over `first`; it breaks. The first fetch to see it drops it ...
    const closed = peers.drop(ownerAddr, first.peer);
    // ... a third fetch makes the owner's new link ...
    const second = await peers.get(ownerAddr);
    assert.notEqual(second.peer, first.peer);
    assert.equal(trades, 2);
    // ... and the second fetch, ending on the old broken peer, drops that one too.
    await peers.drop(ownerAddr, first.peer);
    // The first drop's close runs beside the fetches (a fetch does not wait for it): the
    // count below is of live peers once it ended (it read 2 when counted mid-close).
    await closed;
    const third = await peers.get(ownerAddr);
    assert.equal(third.peer, second.peer, "the new link is kept");
    assert.equal(trades, 2, "no handshake for a link that was never broken");
    assert.equal(req.ep.info().peers, 1, "only the owner's live link is open");
    await peers.close();
    assert.equal(req.ep.info().peers, 0, "closing the links closes every peer made");
  } finally {
    await peers.close();
    await req.close();
    await owner.close();
  }
});
