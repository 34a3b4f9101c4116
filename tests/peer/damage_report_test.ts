/**
 * Damage reports (lib/peer/damage_report.ts), on the harness of
 * _two_nodes.ts (real gRPC, the real peer RPC socket, the real TCP
 * transport): a requester's release names the blocks that landed with
 * another checksum than the lock answered; the owner checks them again while
 * still pinned and drops those whose bytes changed since their seal, keeps
 * those that still match, and refuses a report that names no block of the
 * lock — releasing the lock in every case.
 */

import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import { blockLayoutIdentity } from "../../lib/storage/layout.ts";
import { fetchAll, hash, LAYOUT, NS, payloadOf, seal, twoNodes } from "./_two_nodes.ts";

type TwoNodes = Awaited<ReturnType<typeof twoNodes>>;

/** Records each block's CRC32C of its bytes now, as the seal-time checksum stage does. */
async function recordSealChecksums(t: TwoNodes, hashes: Uint8Array[]): Promise<void> {
  const pin = t.owner.host.pin(NS, hashes, "seal-checksums")!;
  try {
    const crcs = await t.owner.checksum(pin.blocks.map((b) => b!.extents));
    t.owner.host.recordChecksums(NS, hashes, crcs);
  } finally {
    pin.release();
  }
}

/** Flips one byte of `h`'s bytes in the owner's pool (a stray write after the seal). */
function damage(t: TwoNodes, h: Uint8Array): void {
  const pin = t.owner.host.pin(NS, [h], "damage")!;
  t.owner.n.mem[pin.blocks[0]!.extents[0].offset + 7] ^= 0x5a;
  pin.release();
}

const layout = blockLayoutIdentity(LAYOUT);

/** A lock request for `hashes` by requester "r", under `lockId`. */
function ask(hashes: Uint8Array[], lockId: Uint8Array) {
  return {
    namespace: NS,
    blockHashes: hashes,
    layoutFingerprint: layout.fingerprint,
    requester: "r",
    lockTtlMs: 5000,
    shiftedExtents: false,
    lockId,
  };
}

Deno.test("a damaged block in the second part of a split lock is dropped on its owner, not the block at its index in the first part", async () => {
  // 96 KiB blocks, 200 KiB chunks: 2 blocks a chunk, so 6 blocks lock as [0, 1] + [2..5].
  const t = await twoNodes({ chunkBytes: 200 * 1024 });
  try {
    const hashes = [40, 41, 42, 43, 44, 45].map(hash);
    const payloads = seal(t.owner, hashes);
    await recordSealChecksums(t, hashes);
    damage(t, hashes[3]); // index 1 of the second lock
    t.setOwned(6);
    await fetchAll(t.tier, { namespace: NS, hashes, layout }, "r-split");
    await t.tier.flush();
    assert.equal(t.locks.stats().granted, 2, "two locks");
    assert.equal(t.req.store.blockState(NS, hashes[3]), "absent", "not served here");
    for (const i of [0, 1, 2, 4, 5]) {
      assert.deepEqual(payloadOf(t.req.host, t.req.n.mem, hashes[i]), payloads[i], `block ${i}`);
      assert.equal(t.owner.store.blockState(NS, hashes[i]), "sealed", `owner keeps block ${i}`);
    }
    assert.equal(t.owner.store.blockState(NS, hashes[3]), "absent", "dropped on the owner");
    assert.deepEqual(t.locks.stats().reportedBad, { condemned: 1, intact: 0 });
    assert.equal(t.locks.stats().held, 0);
    assert.equal(t.owner.store.stats().pinnedBlocks, 0);
    // Dropped, not just hidden: a save of it is refused for a while (the store's discard).
    assert.equal(t.owner.host.fill(NS, hashes[3], "test", "retained"), null);
    t.owner.store.verify();
    t.req.store.verify();
  } finally {
    await t.close();
  }
});

Deno.test("a reported block that still matches on its owner is kept, over gRPC and the peer RPC socket", async () => {
  const t = await twoNodes();
  try {
    const hashes = [50, 51].map(hash);
    seal(t.owner, hashes);
    let lockId = new Uint8Array(16);
    for (const rpcAddr of ["", t.rpcAddr]) {
      const via = rpcAddr ? "peer RPC" : "gRPC";
      lockId = crypto.getRandomValues(new Uint8Array(16));
      await t.links.lock(t.ownerAddr, ask(hashes, lockId), 2000, rpcAddr);
      const res = await t.links.release(
        t.ownerAddr,
        { lockId, requester: "r", failedBlocks: [1] },
        2000,
        rpcAddr,
      );
      assert.deepEqual({ ...res }, { released: true, condemned: 0 }, via);
      for (const h of hashes) assert.equal(t.owner.store.blockState(NS, h), "sealed", via);
      assert.equal(t.owner.store.stats().pinnedBlocks, 0, via);
    }
    assert.deepEqual(t.locks.stats().reportedBad, { condemned: 0, intact: 2 });
    // A report on a lock no longer held (released, expired) checks nothing: its ranges may hold
    // other blocks by now.
    const gone = await t.links.release(
      t.ownerAddr,
      { lockId, requester: "r", failedBlocks: [0] },
      2000,
      t.rpcAddr,
    );
    assert.deepEqual({ ...gone }, { released: false, condemned: 0 });
    assert.deepEqual(t.locks.stats().reportedBad, { condemned: 0, intact: 2 });
  } finally {
    await t.close();
  }
});

Deno.test("a report naming no block of its lock is refused naming the field; the lock is released all the same and nothing is dropped", async () => {
  const t = await twoNodes();
  try {
    const hashes = [60, 61].map(hash);
    seal(t.owner, hashes);
    const cases: [number[], RegExp][] = [
      [[2], /failed_blocks\[0\] = 2: lock [0-9a-f]{32} holds 2 blocks/],
      [[1, 1], /failed_blocks\[1\] = 1: named twice/],
    ];
    for (const rpcAddr of ["", t.rpcAddr]) {
      for (const [failedBlocks, why] of cases) {
        const lockId = crypto.getRandomValues(new Uint8Array(16));
        await t.links.lock(t.ownerAddr, ask(hashes, lockId), 2000, rpcAddr);
        await assert.rejects(
          t.links.release(t.ownerAddr, { lockId, requester: "r", failedBlocks }, 2000, rpcAddr),
          (e: { code: number; details: string }) => {
            assert.equal(e.code, grpc.status.INVALID_ARGUMENT, e.details);
            assert.match(e.details, why);
            return true;
          },
        );
        assert.equal(t.locks.stats().held, 0, "released");
        assert.equal(t.owner.store.stats().pinnedBlocks, 0);
      }
    }
    for (const h of hashes) assert.equal(t.owner.store.blockState(NS, h), "sealed");
    assert.deepEqual(t.locks.stats().reportedBad, { condemned: 0, intact: 0 });
  } finally {
    await t.close();
  }
});

Deno.test("a part that ends its READ while the other part throws still reports its damaged blocks to the owner", async () => {
  // 2 blocks a chunk: [0, 1] + [2..5]. Block 0 (first part) is damaged on the owner; the second
  // part throws at its last chunk (a store error recording its checksums stands for any bug).
  const t = await twoNodes({ chunkBytes: 200 * 1024 });
  try {
    const hashes = [70, 71, 72, 73, 74, 75].map(hash);
    seal(t.owner, hashes);
    await recordSealChecksums(t, hashes);
    damage(t, hashes[0]);
    const record = t.req.host.recordChecksums;
    t.req.host.recordChecksums = (ns, hs, crcs) => {
      if (hs.includes(hashes[4])) throw new Error("injected: recording checksums failed");
      return record(ns, hs, crcs);
    };
    t.setOwned(6);
    await fetchAll(t.tier, { namespace: NS, hashes, layout }, "r-throws");
    await t.tier.flush();
    assert.equal(t.locks.stats().granted, 2, "two locks");
    assert.equal(t.locks.stats().held, 0, "both released");
    // Before, a part that threw left the other part's report out of its release: block 0 stayed
    // on the owner, served to every other node.
    assert.deepEqual(t.locks.stats().reportedBad, { condemned: 1, intact: 0 });
    assert.equal(t.owner.store.blockState(NS, hashes[0]), "absent", "dropped on the owner");
    for (const i of [1, 2, 3, 4, 5]) {
      assert.equal(t.owner.store.blockState(NS, hashes[i]), "sealed", `owner keeps block ${i}`);
    }
    assert.equal(t.owner.store.stats().pinnedBlocks, 0);
    t.owner.store.verify();
  } finally {
    await t.close();
  }
});
