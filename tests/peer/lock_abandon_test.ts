/**
 * A lock the owner grants after its requester gave up (the requester's lock
 * call reached its deadline: the owner's handler queued, its checksums slow,
 * its answer late) is released at once instead of pinning its blocks for the
 * lock's TTL: the requester named the lock and releases that id when its
 * call got no answer (lib/peer/lock_call.ts), and the owner abandons the lock
 * whenever that release comes (lib/peer/locks.ts). Two nodes in one process
 * over the real peer RPC socket (or gRPC) and TCP transport (_two_nodes.ts);
 * the owner is made slow at one exact point by holding its handler, its
 * checksum function or its answer until the requester's fetch has ended. A
 * lock whose answer the requester cannot decode (the owner granted it) is
 * released by its id the same way.
 */

import assert from "node:assert/strict";
import { Buffer } from "node:buffer";
import { blockLayoutIdentity } from "../../lib/storage/layout.ts";
import { encodeFrame, type Frame, FrameReader, writeAll } from "../../lib/local_rpc/wire.ts";
import {
  ABANDONED_KEEP_MS,
  MAX_ABANDONED,
  PEER_LOCK_ID_BYTES,
  PeerLockTable,
} from "../../lib/peer/locks.ts";
import {
  fetchAll,
  hash,
  LAYOUT,
  log,
  node,
  NS,
  seal,
  twoNodes,
  type TwoNodesOptions,
} from "./_two_nodes.ts";

/** The requester's lock deadline: the owner is held past it. */
const RPC_TIMEOUT_MS = 300;

/** A point the owner waits at until the test opens it, and the event of reaching it. */
function gate() {
  const reached = Promise.withResolvers<void>();
  const open = Promise.withResolvers<void>();
  return {
    reached: reached.promise,
    open: () => open.resolve(),
    wait: () => (reached.resolve(), open.promise),
  };
}

/**
 * Runs one fetch of two sealed blocks that ends as a `lock-rpc` miss (the
 * owner held at a gate past the requester's deadline), waits for the
 * requester's background calls (the release of the lock it named), runs
 * `whileHeld`, then opens the gate and waits for the owner's late answer.
 */
async function lateLock(
  t: Awaited<ReturnType<typeof twoNodes>>,
  held: ReturnType<typeof gate>,
  answered: Promise<void>,
  whileHeld = () => {},
) {
  const hashes = [1, 2].map(hash);
  seal(t.owner, hashes);
  t.setOwned(2);
  await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "late");
  assert.equal(t.tier.stats().failures["lock-rpc"], 1, "the requester gave up on its lock");
  const via = t.rpcAddr ? "framed" : "grpc";
  assert.equal(t.calls[`${via} queryBlocksForTransfer`], 1, "its request reached the owner");
  await held.reached;
  await t.tier.flush(); // the release of the lock it named, answered by the owner
  whileHeld();
  held.open();
  await answered;
  for (const h of hashes) assert.equal(t.req.store.blockState(NS, h), "absent");
}

Deno.test("a lock request the owner handles only after its requester gave up is not granted", async () => {
  for (const framed of [true, false]) {
    const held = gate(), answered = Promise.withResolvers<void>();
    const t = await twoNodes({
      framed,
      rpcTimeoutMs: RPC_TIMEOUT_MS,
      beforeLock: () => held.wait(), // the owner's event loop busy elsewhere
      beforeAnswer: () => Promise.resolve(answered.resolve()),
    });
    const via = framed ? "peer RPC" : "gRPC";
    try {
      await lateLock(t, held, answered.promise);
      const s = t.locks.stats();
      assert.equal(s.held, 0, `${via}: no lock left for a requester that is gone`);
      assert.equal(s.granted, 0, via);
      assert.equal(s.misses.abandoned, 1, via);
      assert.equal(t.owner.store.stats().pinnedBlocks, 0, `${via}: nothing pinned`);
      const releases = t.calls[`${framed ? "framed" : "grpc"} releaseTransferLock`];
      assert.equal(releases, 1, `${via}: the requester released the lock it named`);
    } finally {
      await t.close();
    }
  }
});

Deno.test("a lock whose checksums were still computing when its requester gave up is dropped once they end", async () => {
  const held = gate(), answered = Promise.withResolvers<void>();
  const t = await twoNodes({
    rpcTimeoutMs: RPC_TIMEOUT_MS,
    // The blocks have no seal-time checksum: the lock computes them, slowly.
    ownerChecksum: (inner) => async (blocks) => (await held.wait(), inner(blocks)),
    beforeAnswer: () => Promise.resolve(answered.resolve()),
  });
  try {
    await lateLock(t, held, answered.promise);
    const s = t.locks.stats();
    assert.equal(s.held, 0, "the pin taken for the lock was dropped");
    assert.equal(s.granted, 0);
    assert.equal(s.misses.abandoned, 1);
    assert.equal(t.owner.store.stats().pinnedBlocks, 0);
  } finally {
    await t.close();
  }
});

Deno.test("a lock granted but answered after its requester gave up is released by the requester", async () => {
  const held = gate();
  const t = await twoNodes({
    rpcTimeoutMs: RPC_TIMEOUT_MS,
    beforeAnswer: () => held.wait(), // granted, the answer stuck behind other writes
  });
  try {
    await lateLock(t, held, held.reached, () => {
      // The release came while the answer was still held: the lock is gone already.
      assert.equal(t.locks.stats().held, 0);
    });
    const s = t.locks.stats();
    assert.equal(s.granted, 1);
    assert.equal(s.released, 1, "released by the requester, not expired");
    assert.equal(s.held, 0);
    assert.equal(s.timedOut, 0);
    assert.equal(t.owner.store.stats().pinnedBlocks, 0);
  } finally {
    await t.close();
  }
});

/** Bytes no protobuf decoder reads: field 1 (lock_id) claiming 4 GiB that never come. */
const GARBLED = new Uint8Array([0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f]);

/** Copies frames from `from` to `to`, each with the body `body` gives it, until either closes. */
async function relayFrames(from: Deno.Conn, to: Deno.Conn, body: (f: Frame) => Uint8Array) {
  const frames = new FrameReader(64 << 20);
  try {
    for (let n = await from.read(frames.space()); n !== null; n = await from.read(frames.space())) {
      frames.wrote(n);
      for (let f = frames.next(); f; f = frames.next()) {
        await writeAll(to, encodeFrame(f.callId, f.tag, body(f)));
      }
    }
  } catch (_e) {
    // one side closed: the relay of this connection ends
  }
}

/**
 * A relay in front of the owner's peer RPC socket at `to`: every frame goes
 * through as it is, except that each lock answer's body becomes {@link GARBLED}
 * (the owner granted the lock; the requester cannot read its answer).
 */
function garblingRelay(to: string) {
  const [hostname, port] = to.split(":");
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const conns: Deno.Conn[] = [];
  (async () => {
    for await (const down of listener) {
      const up = await Deno.connect({ hostname, port: Number(port) });
      conns.push(down, up);
      const lockCalls = new Set<number>();
      relayFrames(down, up, (f) => (f.tag === 1 && lockCalls.add(f.callId), f.payload));
      relayFrames(up, down, (f) => f.tag === 0 && lockCalls.delete(f.callId) ? GARBLED : f.payload);
    }
  })().catch(() => {}); // the listener closed
  return {
    addr: `127.0.0.1:${listener.addr.port}`,
    close() {
      listener.close();
      for (const c of conns) {
        try {
          c.close();
        } catch (_e) {
          // closed by its peer already
        }
      }
    },
  };
}

Deno.test("a lock the owner granted but whose answer cannot be decoded is released by the id the requester chose", async () => {
  for (const framed of [true, false]) {
    const via = framed ? "peer RPC" : "gRPC";
    const o: TwoNodesOptions = { framed };
    if (!framed) o.grpcLockAnswer = () => Buffer.from(GARBLED);
    const t = await twoNodes(o);
    const relay = framed ? garblingRelay(t.rpcAddr) : undefined;
    o.rpcAddr = relay?.addr; // the owner's handshake names the relay
    try {
      const hashes = [1, 2].map(hash);
      seal(t.owner, hashes);
      t.setOwned(2);
      await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "bad");
      assert.equal(t.tier.stats().failures["lock-rpc"], 1, `${via}: the answer is a lock-rpc miss`);
      await t.tier.flush(); // the release of the lock it named
      const s = t.locks.stats();
      assert.equal(s.granted, 1, `${via}: the owner granted the lock`);
      assert.equal(s.released, 1, `${via}: released by its id, not left to expire`);
      assert.equal(s.held, 0, via);
      assert.equal(t.owner.store.stats().pinnedBlocks, 0, `${via}: nothing pinned`);
      const releases = t.calls[`${framed ? "framed" : "grpc"} releaseTransferLock`];
      assert.equal(releases, 1, `${via}: one release, of the id the requester chose`);
      for (const h of hashes) assert.equal(t.req.store.blockState(NS, h), "absent");
    } finally {
      relay?.close();
      await t.close();
    }
  }
});

Deno.test("the owner's lock has the id its requester chose; a release before the grant is remembered for a while, and only so many", async () => {
  const owner = node(1);
  let now = 0;
  const locks = new PeerLockTable({
    host: owner.host,
    ram: owner.store,
    checksum: owner.checksum,
    log,
    clock: () => now,
  });
  try {
    const hashes = [3].map(hash);
    seal(owner, hashes);
    const id = (i: number) => {
      const b = new Uint8Array(PEER_LOCK_ID_BYTES);
      new DataView(b.buffer).setUint32(0, i);
      return b;
    };
    const ask = (lockId: Uint8Array, requester = "b") => ({
      namespace: NS,
      hashes,
      layoutFingerprint: blockLayoutIdentity(LAYOUT).fingerprint,
      requester,
      ttlMs: 1000,
      lockId,
    });
    const a = await locks.grant(ask(id(1)));
    assert.equal(a.kind, "locked");
    assert.deepEqual(a.kind === "locked" && a.lockId, id(1), "the id the requester chose");
    await assert.rejects(
      locks.grant(ask(id(1))),
      /requester b asked for lock 00000001\w+, which it holds already/,
    );
    assert.equal(owner.store.stats().pinnedBlocks, 1, "the refused grant's pin was dropped");
    assert.equal(locks.release(id(1), "c"), false, "another requester's lock");
    assert.equal(locks.release(id(1), "b"), true);
    // Released before it is asked for: abandoned, for that requester only.
    assert.equal(locks.release(id(2), "b"), false);
    assert.deepEqual(await locks.grant(ask(id(2))), { kind: "miss", reason: "abandoned" });
    assert.equal((await locks.grant(ask(id(2), "c"))).kind, "locked", "c's id 2 is not b's");
    // Remembered ABANDONED_KEEP_MS, then forgotten (a request delayed longer is granted).
    locks.release(id(3), "b");
    now += ABANDONED_KEEP_MS;
    locks.expire();
    assert.equal((await locks.grant(ask(id(3)))).kind, "locked");
    // At most MAX_ABANDONED remembered: the oldest is forgotten first.
    for (let i = 0; i <= MAX_ABANDONED; i++) locks.release(id(100 + i), "b");
    assert.equal((await locks.grant(ask(id(100)))).kind, "locked", "the oldest was forgotten");
    assert.equal((await locks.grant(ask(id(101)))).kind, "miss");
    // A release naming bytes that are no lock id is not remembered.
    locks.release(new Uint8Array(3), "b");
    assert.equal((await locks.grant(ask(new Uint8Array(3)))).kind, "locked");
    assert.equal(locks.stats().misses.abandoned, 2);
  } finally {
    locks.close();
    await owner.n.close();
  }
});
