/**
 * The peer tier in one process, over real parts (the harness: _two_nodes.ts):
 * two pools on the host backend, two stores, the owner's lock table behind a
 * real gRPC `Peer` service, the requester's tier reading over the real TCP
 * transport. What the multi-process tests cannot reach from outside: a block
 * whose bytes do not match its checksum is never served, block checksums
 * agree however the pool cuts a block, and the service refuses bad input
 * naming the field.
 */

import assert from "node:assert/strict";
import { Buffer } from "node:buffer";
import * as grpc from "@grpc/grpc-js";
import { poolChecksums } from "../../ffi/uring.ts";
import { crc32c } from "../../lib/ssd/format.ts";
import { blockLayoutIdentity } from "../../lib/storage/layout.ts";
import { PeerTier } from "../../lib/peer/peer_tier.ts";
import { LocalRpcClient, LocalRpcStatus } from "../../lib/client/local_rpc.ts";
import { IndexAdvertiser } from "../../lib/index/advertiser.ts";
import {
  fetchAll,
  hash,
  LAYOUT,
  log,
  node,
  NS,
  payloadOf,
  POOL,
  seal,
  twoNodes,
} from "./_two_nodes.ts";

Deno.test("blocks fetched from a peer land byte-exact and sealed in RAM, the owner's lock released", async () => {
  const t = await twoNodes();
  try {
    const hashes = [0, 1, 2, 3, 4].map(hash);
    const payloads = seal(t.owner, hashes);
    t.setOwned(5);
    const blocks = { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) };
    await fetchAll(t.tier, blocks, "r1");
    for (let i = 0; i < 5; i++) {
      assert.equal(t.req.store.blockState(NS, hashes[i]), "sealed");
      assert.deepEqual(payloadOf(t.req.host, t.req.n.mem, hashes[i]), payloads[i], `block ${i}`);
    }
    await t.tier.flush(); // the lock release runs after the answer
    const s = t.tier.stats();
    assert.equal(s.blocks, 5);
    assert.equal(s.fetchesOk, 1);
    assert.equal(t.locks.stats().held, 0);
    assert.equal(t.locks.stats().released, 1);
    assert.deepEqual(
      t.calls,
      { "framed queryBlocksForTransfer": 1, "framed releaseTransferLock": 1 },
      "the lock and its release went over the peer RPC socket the handshake named",
    );
    assert.deepEqual(t.links.stats().calls, { rpc: 2, grpc: 0 });
    assert.deepEqual(t.linkLog, [], "nothing to warn about");
    // No checksum was recorded after the owner's seal here: the lock computed them.
    assert.equal(t.locks.stats().checksumsAtLock, 5);
    assert.equal(t.owner.store.stats().pinnedBlocks, 0);
    t.req.store.verify();
    t.owner.store.verify();
  } finally {
    await t.close();
  }
});

Deno.test("a block whose bytes changed after its checksum was recorded is never served (fetch read in chunks of 2 blocks)", async () => {
  // 96 KiB blocks, 200 KiB chunks: 2 blocks per READ batch, verified batch by batch.
  const t = await twoNodes({ chunkBytes: 200 * 1024 });
  try {
    const hashes = [10, 11, 12, 13].map(hash);
    const payloads = seal(t.owner, hashes);
    // The checksum stage (put after the seal) records each block's CRC32C.
    const layout = blockLayoutIdentity(LAYOUT);
    const ownerTier = new PeerTier({
      host: t.owner.host,
      index: () => undefined,
      endpoint: t.owner.n.ep,
      transport: "tcp",
      links: t.links,
      checksum: t.owner.checksum,
      log,
    });
    assert.equal(ownerTier.put({ namespace: NS, hashes, layout }).status, "queued");
    await ownerTier.flush();
    assert.equal(ownerTier.stats().checksumsAtSeal, 4);
    await ownerTier.close();
    // Block 2's bytes change in the owner's pool (a stray write, a reused range).
    const pin = t.owner.host.pin(NS, [hashes[2]], "corrupt")!;
    t.owner.n.mem[pin.blocks[0]!.extents[0].offset + 5] ^= 0xff;
    pin.release();
    t.setOwned(4);
    await fetchAll(t.tier, { namespace: NS, hashes, layout }, "r2");
    assert.equal(
      t.req.store.blockState(NS, hashes[2]),
      "absent",
      "the corrupt block is not served",
    );
    for (const i of [0, 1, 3]) {
      assert.deepEqual(payloadOf(t.req.host, t.req.n.mem, hashes[i]), payloads[i], `block ${i}`);
    }
    assert.equal(t.tier.stats().failures.checksum, 1);
    assert.equal(t.locks.stats().checksumsAtLock, 0, "the seal-time checksums were carried");
    // The release named the block; the owner found it changed and dropped it (damage_report.ts).
    await t.tier.flush();
    assert.deepEqual(t.locks.stats().reportedBad, { condemned: 1, intact: 0 });
    assert.equal(t.owner.store.blockState(NS, hashes[2]), "absent", "condemned on the owner");
    for (const i of [0, 1, 3]) assert.equal(t.owner.store.blockState(NS, hashes[i]), "sealed");
    assert.equal(t.owner.store.stats().pinnedBlocks, 0);
    t.owner.store.verify();
    t.req.store.verify();
  } finally {
    await t.close();
  }
});

Deno.test("a block's checksum is the CRC32C of its payload however the pool cuts it into ranges", async () => {
  const nd = node(3);
  try {
    const bytes = nd.n.mem;
    const whole = [{ offset: 4096, bytes: 12288 }];
    const cut = [{ offset: 4096, bytes: 100 }, { offset: 4196, bytes: 8000 }, {
      offset: 12196,
      bytes: 4188,
    }];
    const other = [{ offset: 65536, bytes: 7 }];
    const crcs = await poolChecksums(nd.n.pool.handle, [whole, cut, other]);
    const want = crc32c(bytes.subarray(4096, 4096 + 12288));
    assert.equal(crcs[0], want);
    assert.equal(crcs[1], want);
    assert.equal(crcs[2], crc32c(bytes.subarray(65536, 65543)));
    // Lengths around the native code's paths (the crc32 instruction below 256
    // bytes; the fold: 256-byte rounds, then 16-byte lanes, then a tail), odd offsets.
    const cases: { offset: number; bytes: number }[] = [];
    for (const off of [0, 3, 4096 + 5]) {
      for (
        const n of [
          1,
          7,
          8,
          255,
          256,
          257,
          271,
          272,
          511,
          512,
          527,
          1023,
          3073,
          6149,
          32768,
          100_003,
          (1 << 20) + 13,
        ]
      ) {
        cases.push({ offset: off, bytes: n });
      }
    }
    const got = await poolChecksums(nd.n.pool.handle, cases.map((x) => [x]));
    cases.forEach((x, i) =>
      assert.equal(
        got[i],
        crc32c(bytes.subarray(x.offset, x.offset + x.bytes)),
        `${x.bytes} @ ${x.offset}`,
      )
    );
    await assert.rejects(
      poolChecksums(nd.n.pool.handle, [[{ offset: POOL - 10, bytes: 11 }]]),
      /outside the pool/,
    );
  } finally {
    await nd.n.close();
  }
});

Deno.test("the Peer service refuses malformed lock requests naming the field, over gRPC and the peer RPC socket, and locks nothing", async () => {
  const t = await twoNodes();
  try {
    const ok = {
      namespace: NS,
      blockHashes: [hash(1)],
      layoutFingerprint: blockLayoutIdentity(LAYOUT).fingerprint,
      requester: "r",
      lockTtlMs: 0,
      shiftedExtents: false,
      lockId: new Uint8Array(0), // the owner picks it
    };
    const cases: [Partial<typeof ok>, RegExp][] = [
      [{ namespace: "" }, /namespace is empty/],
      [{ requester: "" }, /requester is empty/],
      [{ blockHashes: [] }, /block_hashes is empty/],
      [{ blockHashes: [hash(1), new Uint8Array(65)] }, /block_hashes\[1\] is 65 bytes/],
      [{ layoutFingerprint: "" }, /layout_fingerprint is empty/],
      [{ lockId: new Uint8Array(5) }, /lock_id is 5 bytes; expected 16/],
    ];
    seal(t.owner, [hash(1)]);
    for (const rpcAddr of ["", t.rpcAddr]) {
      const via = rpcAddr ? "peer RPC" : "gRPC";
      for (const [bad, why] of cases) {
        await assert.rejects(
          t.links.lock(t.ownerAddr, { ...ok, ...bad }, 2000, rpcAddr),
          (e: { code: number; details: string }) => {
            assert.equal(e.code, grpc.status.INVALID_ARGUMENT, `${via}: ${e.details}`);
            assert.match(e.details, why);
            return true;
          },
        );
      }
      const other = await t.links.lock(
        t.ownerAddr,
        { ...ok, layoutFingerprint: "0".repeat(32) },
        2000,
        rpcAddr,
      );
      assert.equal(other.missReason, "other-layout");
      assert.equal(other.lockId.length, 0);
      assert.equal(t.locks.stats().held, 0);
      const locked = await t.links.lock(t.ownerAddr, ok, 2000, rpcAddr);
      assert.equal(locked.checksums.length, 1);
      assert.equal(locked.extentShifts.length, 0, "not asked for shifts: every extent");
      const release = async (who: string) =>
        (await t.links.release(
          t.ownerAddr,
          { lockId: locked.lockId, requester: who, failedBlocks: [] },
          2000,
          rpcAddr,
        )).released;
      assert.equal(await release("someone-else"), false, via);
      assert.equal(await release("r"), true, via);
      assert.equal(await release("r"), false, via);
      assert.equal(t.owner.store.stats().pinnedBlocks, 0);
    }
    assert.equal(t.calls["grpc queryBlocksForTransfer"], 8);
    assert.equal(t.calls["framed queryBlocksForTransfer"], 8);
    // Bytes that are not the request message: INVALID_ARGUMENT naming it, not INTERNAL.
    const framed = new LocalRpcClient(
      { transport: "tcp", hostname: "127.0.0.1", port: Number(t.rpcAddr.split(":")[1]) },
      1 << 20,
      { queryBlocksForTransfer: 1, releaseTransferLock: 2, nothing: 9 },
    );
    const garbage = new Uint8Array([0x0a, 0xff, 0xff, 0xff, 0x0f]);
    try {
      for (
        const [method, message] of [
          ["QueryBlocksForTransfer", "QueryBlocksForTransferRequest"],
          ["ReleaseTransferLock", "ReleaseTransferLockRequest"],
        ]
      ) {
        const e = await rawPeerCall(t.ownerAddr, method, garbage);
        assert.equal(e?.code, grpc.status.INVALID_ARGUMENT, `${method}: ${e?.details}`);
        assert.match(e!.details, new RegExp(message));
        const name = method[0].toLowerCase() + method.slice(1);
        await assert.rejects(framed.call(name, garbage, 2000), (f: LocalRpcStatus) => {
          assert.equal(f.code, grpc.status.INVALID_ARGUMENT, `${method}: ${f.details}`);
          assert.match(f.details, new RegExp(message));
          return true;
        });
      }
      // A method id the socket does not serve: UNIMPLEMENTED naming the socket's ids.
      await assert.rejects(framed.call("nothing", new Uint8Array(0), 2000), (f: LocalRpcStatus) => {
        assert.equal(f.code, grpc.status.UNIMPLEMENTED);
        assert.match(f.details, /peer RPC: unknown method id 9 \(known: 1, 2\)/);
        return true;
      });
    } finally {
      framed.close();
    }
    assert.equal(t.locks.stats().held, 0);
  } finally {
    await t.close();
  }
});

Deno.test("an owner without a peer RPC socket is asked for its lock over gRPC", async () => {
  const t = await twoNodes({ framed: false });
  try {
    const hashes = [0, 1, 2].map(hash);
    const payloads = seal(t.owner, hashes);
    t.setOwned(3);
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "g");
    for (let i = 0; i < 3; i++) {
      assert.deepEqual(payloadOf(t.req.host, t.req.n.mem, hashes[i]), payloads[i], `block ${i}`);
    }
    await t.tier.flush();
    assert.deepEqual(t.calls, {
      "grpc queryBlocksForTransfer": 1,
      "grpc releaseTransferLock": 1,
    });
    assert.deepEqual(t.links.stats().calls, { rpc: 0, grpc: 2 }, "counted for the metric");
    // One warning per owner, however many of its locks take the slow way.
    await fetchAll(t.tier, {
      namespace: NS,
      hashes: [hash(7)],
      layout: blockLayoutIdentity(LAYOUT),
    }, "x");
    const warned = t.linkLog.map((l) => JSON.parse(l)).filter((o) =>
      /no peer RPC socket/.test(o.msg)
    );
    assert.equal(warned.length, 1, t.linkLog.join("\n"));
    assert.equal(warned[0].owner, t.ownerAddr);
    assert.equal(t.locks.stats().held, 0);
  } finally {
    await t.close();
  }
});

Deno.test("an owner whose peer RPC socket moved: one fetch misses, the next handshakes again and finds it", async () => {
  const t = await twoNodes();
  try {
    const hashes = [0, 1, 2, 3, 4, 5].map(hash);
    const payloads = seal(t.owner, hashes);
    t.setOwned(6);
    const at = (i: number) => ({
      namespace: NS,
      hashes: hashes.slice(i, i + 2),
      layout: blockLayoutIdentity(LAYOUT),
    });
    await fetchAll(t.tier, at(0), "before");
    // Its lock's release is sent after the answer: let it reach the owner before the socket
    // closes under it (else the lock stays held until its TTL, and `held` below is 1).
    await t.tier.flush();
    t.moveRpc(); // the owner restarted its socket on another port
    await fetchAll(t.tier, at(2), "moved");
    assert.equal(t.tier.stats().failures["lock-rpc"], 1, "the old address refuses: a miss");
    assert.equal(t.req.store.blockState(NS, hashes[2]), "absent");
    await fetchAll(t.tier, at(2), "again");
    for (const i of [0, 1, 2, 3]) {
      assert.deepEqual(payloadOf(t.req.host, t.req.n.mem, hashes[i]), payloads[i], `block ${i}`);
    }
    await t.tier.flush();
    assert.equal(t.calls["framed queryBlocksForTransfer"], 2, "both locks over a peer RPC socket");
    assert.equal(t.calls["grpc queryBlocksForTransfer"], undefined);
    assert.equal(t.locks.stats().held, 0);
  } finally {
    await t.close();
  }
});

Deno.test("a peer RPC socket that never answers: the lock ends at its deadline as a miss, nothing planned", async () => {
  // Accepts and reads, never answers (a wedged owner).
  const mute = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const held: Deno.Conn[] = [];
  (async () => {
    for await (const c of mute) {
      held.push(c);
      c.readable.pipeTo(new WritableStream()).catch(() => {});
    }
  })();
  const t = await twoNodes({ rpcAddr: `127.0.0.1:${mute.addr.port}`, rpcTimeoutMs: 300 });
  try {
    const hashes = [0, 1].map(hash);
    seal(t.owner, hashes);
    t.setOwned(2);
    const free = t.req.store.stats().freeBytes;
    const t0 = performance.now();
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "m");
    const took = performance.now() - t0;
    assert.ok(took >= 290 && took < 2000, `the fetch ended at the lock's deadline (${took} ms)`);
    const s = t.tier.stats();
    assert.equal(s.failures["lock-rpc"], 1);
    assert.equal(s.blocks, 0);
    assert.equal(t.req.store.blockState(NS, hashes[0]), "absent");
    assert.equal(t.req.store.stats().freeBytes, free, "nothing planned here");
    assert.equal(t.locks.stats().held, 0, "the owner was never asked");
  } finally {
    await t.close();
    mute.close();
    for (const c of held) {
      try {
        c.close();
      } catch { /* closed */ }
    }
  }
});

Deno.test("a prefix no peer holds answers loading once, then a clean miss; nothing is planned", async () => {
  const t = await twoNodes();
  try {
    const hashes = [20, 21].map(hash);
    t.setOwned(0);
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "r3");
    assert.equal(t.tier.take("r3").state, "none", "ready is answered once");
    assert.equal(t.tier.stats().failures["no-owner"], 1);
    assert.equal(t.locks.stats().granted, 0);
    assert.equal(t.req.store.stats().usedBytes, 0);
  } finally {
    await t.close();
  }
});

Deno.test("two requests starting at the same missing block share one fetch and one lock; each request's settled resolves at its end", async () => {
  const t = await twoNodes();
  try {
    const hashes = [30, 31, 32].map(hash);
    const payloads = seal(t.owner, hashes);
    t.setOwned(3);
    const blocks = { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) };
    assert.equal(t.tier.settled("ra"), undefined, "nothing runs before the prefetch");
    assert.equal(t.tier.prefetch("ra", blocks).state, "loading");
    assert.equal(t.tier.prefetch("rb", blocks).state, "loading");
    const ends = ["ra", "rb"].map((id) => t.tier.settled(id));
    assert.ok(ends.every((s) => s instanceof Promise), "both requests' fetch runs");
    await Promise.all(ends);
    for (const id of ["ra", "rb"]) {
      assert.equal(t.tier.settled(id), undefined, `${id}: nothing runs any more`);
      assert.equal(t.tier.take(id).state, "ready", `${id}: settled forgot nothing`);
    }
    await t.tier.flush();
    assert.equal(t.tier.stats().fetches, 1);
    assert.equal(t.locks.stats().granted, 1);
    for (let i = 0; i < 3; i++) {
      assert.deepEqual(payloadOf(t.req.host, t.req.n.mem, hashes[i]), payloads[i]);
    }
  } finally {
    await t.close();
  }
});

/** One raw-bytes call of a Peer method; resolves with its error (null when it answered OK). */
function rawPeerCall(
  addr: string,
  method: string,
  body: Uint8Array,
): Promise<grpc.ServiceError | null> {
  const raw = (x: Uint8Array) => Buffer.from(x);
  const Ctor = grpc.makeGenericClientConstructor({
    [method]: {
      path: `/pegaflow.Peer/${method}`,
      requestStream: false,
      responseStream: false,
      requestSerialize: raw,
      requestDeserialize: raw,
      responseSerialize: raw,
      responseDeserialize: raw,
    },
  }, "Peer");
  const c = new Ctor(addr, grpc.credentials.createInsecure()) as grpc.Client & {
    [m: string]: (req: Buffer, cb: (e: grpc.ServiceError | null) => void) => void;
  };
  return new Promise((resolve) =>
    c[method](Buffer.from(body), (e) => {
      c.close();
      resolve(e);
    })
  );
}

Deno.test("a prefix over two chunks is locked in two parts — the first chunk alone, the rest while it reads — however much the owner still holds", async () => {
  // 96 KiB blocks, 200 KiB chunks: 2 blocks a chunk, so 8 blocks split as [0, 1] + [2..7].
  const hashes = [0, 1, 2, 3, 4, 5, 6, 7].map(hash);
  const cases: { held: number; split?: boolean; locks: number; lands: number }[] = [
    { held: 8, locks: 2, lands: 8 }, // both parts whole
    { held: 3, locks: 2, lands: 3 }, // the second part answers 1 of 6 (evicted since the lookup)
    { held: 1, locks: 1, lands: 1 }, // the first part is short: the prefix ends there, no second lock
    { held: 8, split: false, locks: 1, lands: 8 }, // --splitLock off: one lock
  ];
  for (const c of cases) {
    const t = await twoNodes({ chunkBytes: 200 * 1024, splitLock: c.split });
    try {
      const payloads = seal(t.owner, hashes.slice(0, c.held));
      t.setOwned(8); // the index still names all 8
      const free = t.req.store.stats().freeBytes;
      const blocks = { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) };
      await fetchAll(t.tier, blocks, `r${c.held}`);
      await t.tier.flush();
      const what = JSON.stringify(c);
      for (let i = 0; i < 8; i++) {
        if (i < c.lands) {
          assert.deepEqual(
            payloadOf(t.req.host, t.req.n.mem, hashes[i]),
            payloads[i],
            `${what} block ${i}`,
          );
        } else assert.equal(t.req.store.blockState(NS, hashes[i]), "absent", `${what} block ${i}`);
      }
      assert.equal(t.locks.stats().granted, c.locks, what);
      assert.equal(t.locks.stats().released, c.locks, `${what}: every lock released`);
      assert.equal(t.locks.stats().held, 0, what);
      assert.equal(t.owner.store.stats().pinnedBlocks, 0, what);
      assert.equal(t.tier.stats().blocks, c.lands, what);
      // Nothing planned for blocks the owner did not lock stays behind.
      assert.equal(
        free - t.req.store.stats().freeBytes,
        c.lands * 96 * 1024,
        `${what}: no space leaked`,
      );
      t.req.store.verify();
    } finally {
      await t.close();
    }
  }
});

Deno.test("the owner's transfer endpoint gone while the second part is locked: at most the first part lands, both locks released, nothing left behind", async () => {
  let closeOwner = () => Promise.resolve();
  const t = await twoNodes({
    chunkBytes: 200 * 1024,
    // The second lock waits until the owner's transfer endpoint is closed under the first READ.
    beforeLock: async (n) => {
      if (n === 2) await closeOwner();
    },
  });
  try {
    const hashes = [0, 1, 2, 3, 4, 5, 6, 7].map(hash);
    seal(t.owner, hashes);
    t.setOwned(8);
    closeOwner = () => t.owner.n.ep.close();
    const free = t.req.store.stats().freeBytes;
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "gone");
    await t.tier.flush();
    const s = t.tier.stats();
    assert.equal(s.fetches, 1);
    // At most the first part (2 blocks) landed: the second part's READ found the peer broken.
    const landed = hashes.filter((h) => t.req.store.blockState(NS, h) === "sealed").length;
    assert.ok(landed === 0 || landed === 2, `${landed} blocks landed`);
    for (const h of hashes.slice(2)) assert.equal(t.req.store.blockState(NS, h), "absent");
    assert.equal(s.blocks, landed);
    assert.equal(free - t.req.store.stats().freeBytes, landed * 96 * 1024, "no space left behind");
    for (const h of hashes) assert.notEqual(t.req.store.blockState(NS, h), "inflight");
    assert.equal(t.locks.stats().granted, 2);
    assert.equal(t.locks.stats().held, 0, "both locks released");
    assert.equal(t.owner.store.stats().pinnedBlocks, 0);
    t.req.store.verify();
  } finally {
    await t.close().catch(() => {}); // the owner's endpoint is closed already
  }
});

Deno.test("a fetched block evicted before its fetch ends is neither advertised nor given the fetched checksum", async () => {
  // 96 KiB blocks, 200 KiB chunks: 8 blocks split as [0, 1] + [2..7]. While the owner takes
  // the second lock, the first part has landed here; then it is evicted, and block 0 is saved
  // again with other bytes (another engine computed it) before the fetch ends.
  const hashes = [0, 1, 2, 3, 4, 5, 6, 7].map(hash);
  const advertised: string[][] = [];
  const advertiser = new IndexAdvertiser();
  advertiser.connect({
    advertise: (
      _ns,
      hs,
    ) => (advertised.push(hs.map((h) => h[1].toString())), Promise.resolve(true)),
    withdraw: () => Promise.resolve(true),
  });
  let evict = () => Promise.resolve();
  const t = await twoNodes({
    chunkBytes: 200 * 1024,
    advertiser,
    beforeLock: async (n) => {
      if (n === 2) await evict();
    },
  });
  try {
    const payloads = seal(t.owner, hashes);
    t.setOwned(8);
    const resaved = new Uint8Array(96 * 1024).fill(0x5a);
    evict = async () => {
      for (let i = 0; i < 400; i++) {
        if (hashes.slice(0, 2).every((h) => t.req.store.blockState(NS, h) === "sealed")) break;
        await new Promise((r) => setTimeout(r, 5));
      }
      assert.equal(t.req.store.blockState(NS, hashes[1]), "sealed", "the first part landed");
      assert.equal(t.req.store.evictAll(), 2);
      const f = t.req.host.fill(NS, hashes[0], "engine", "retained")!;
      let p = 0;
      for (const x of f.extents) {
        t.req.n.mem.set(resaved.subarray(p, p + x.bytes), x.offset);
        p += x.bytes;
      }
      f.commit();
    };
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "ev");
    await t.tier.flush();
    await Promise.resolve(); // the advertiser sends in a microtask
    assert.equal(t.tier.stats().blocks, 8, "every block landed and was committed");
    for (let i = 2; i < 8; i++) {
      assert.deepEqual(payloadOf(t.req.host, t.req.n.mem, hashes[i]), payloads[i], `block ${i}`);
      assert.ok(advertiser.holds(NS, hashes[i]), `block ${i} is advertised`);
    }
    assert.equal(t.req.store.blockState(NS, hashes[1]), "absent");
    assert.equal(advertiser.holds(NS, hashes[1]), false, "an evicted block is not listed as held");
    assert.ok(
      advertised.every((a) => !a.includes("1")),
      `block 1 was never advertised after its eviction: ${JSON.stringify(advertised)}`,
    );
    // Block 0 holds the engine's bytes now: no checksum of the fetched bytes may be recorded on it.
    const pin = t.req.host.pin(NS, [hashes[0]], "check")!;
    try {
      const b = pin.blocks[0]!;
      const actual = (await t.req.checksum([b.extents]))[0];
      assert.ok(
        b.checksum === undefined || b.checksum === actual,
        `block 0's recorded checksum ${b.checksum} is its bytes' ${actual}`,
      );
    } finally {
      pin.release();
    }
    assert.equal(t.locks.stats().held, 0);
    t.req.store.verify();
  } finally {
    await t.close();
  }
});

Deno.test("a lock answer whose later ranges lie outside the owner's pool: the blocks before them land, the refusal is counted and nothing is left planned", async () => {
  // 96 KiB blocks, 200 KiB chunks, split off: 4 blocks in 2 READ batches. The owner's answer
  // moves block 2 (a shift of block 1's ranges) past the end of its pool: the second batch is
  // refused before anything moves. That refusal used to go uncounted and unlogged.
  const hashes = [0, 1, 2, 3].map(hash);
  const t = await twoNodes({
    chunkBytes: 200 * 1024,
    splitLock: false,
    tamper: (res) => {
      assert.equal(res.extentCounts[2], 0, "block 2 is sent as a shift");
      res.extentShifts[2] = 2 ** 40;
    },
  });
  try {
    const payloads = seal(t.owner, hashes);
    t.setOwned(4);
    const free = t.req.store.stats().freeBytes;
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "oob");
    await t.tier.flush();
    for (const i of [0, 1]) {
      assert.deepEqual(payloadOf(t.req.host, t.req.n.mem, hashes[i]), payloads[i], `block ${i}`);
    }
    for (const i of [2, 3]) assert.equal(t.req.store.blockState(NS, hashes[i]), "absent");
    const s = t.tier.stats();
    assert.equal(s.blocks, 2);
    assert.equal(s.failures.transfer, 1, "the refused READ batch is counted");
    assert.equal(free - t.req.store.stats().freeBytes, 2 * 96 * 1024, "no space left planned");
    assert.equal(t.locks.stats().held, 0);
    t.req.store.verify();
  } finally {
    await t.close();
  }
});

Deno.test("a lock that expired before the READ: nothing is read from ranges the owner may have reused", async () => {
  // The requester's READ may run as long as its fetch deadline; the owner keeps the blocks only
  // for the TTL it granted (capped at 120 s: a --peer-fetch-timeout-ms above it outlives it).
  const hashes = [40, 41, 42].map(hash);
  let reuse = () => Promise.resolve();
  const t = await twoNodes({ lockTtlMs: 100, beforeRead: () => reuse() });
  try {
    seal(t.owner, hashes);
    const pin = t.owner.host.pin(NS, hashes, "where")!;
    const extents = pin.blocks.map((b) => b!.extents);
    pin.release();
    reuse = async () => {
      await new Promise((r) => setTimeout(r, 250));
      assert.equal(t.locks.expire(), 1, "the owner's lock expired");
      assert.equal(t.owner.store.evictAll(), 3);
      // The space is reused: other bytes now lie where the blocks were.
      for (const xs of extents) {
        for (const x of xs) t.owner.n.mem.fill(0xc3, x.offset, x.offset + x.bytes);
      }
    };
    t.setOwned(3);
    const free = t.req.store.stats().freeBytes;
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "late");
    await t.tier.flush();
    const s = t.tier.stats();
    assert.equal(s.readBytes, 0, "no READ after the owner's lock expired");
    assert.equal(s.failures.checksum, 0, "nothing was read to fail its checksum");
    assert.equal(s.failures.timeout, 1);
    for (const h of hashes) assert.equal(t.req.store.blockState(NS, h), "absent");
    assert.equal(t.req.store.stats().freeBytes, free, "nothing left planned");
    t.req.store.verify();
  } finally {
    await t.close();
  }
});

Deno.test("a fetch that fails in both parts of a split lock is counted as one failure", async () => {
  // 96 KiB blocks, 200 KiB chunks: 8 blocks split as [0, 1] + [2..7]. The first answer's block 1
  // lies outside the owner's pool (its READ is refused), the second names another transport.
  const hashes = [0, 1, 2, 3, 4, 5, 6, 7].map(hash);
  let answers = 0;
  const t = await twoNodes({
    chunkBytes: 200 * 1024,
    tamper: (res) => {
      if (++answers === 1) res.extentShifts[1] = 2 ** 40;
      else res.transport = "rdma";
    },
  });
  try {
    seal(t.owner, hashes);
    t.setOwned(8);
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "2x");
    await t.tier.flush();
    const s = t.tier.stats();
    assert.equal(s.fetches, 1);
    assert.equal(s.fetchesOk, 0);
    assert.equal(answers, 2, "both parts were locked");
    const counted = Object.values(s.failures).reduce((a, b) => a + b, 0);
    assert.equal(counted, 1, `one failed fetch, one failure: ${JSON.stringify(s.failures)}`);
    assert.equal(s.failures["bad-answer"], 1, "the first failure seen is the one counted");
    assert.equal(t.locks.stats().held, 0, "both locks released");
    t.req.store.verify();
  } finally {
    await t.close();
  }
});

Deno.test("a lock answer that locks no block is refused as a bad answer and released", async () => {
  const hashes = [50, 51].map(hash);
  const t = await twoNodes({
    tamper: (res) => {
      res.checksums = [];
      res.extentCounts = [];
      res.extentShifts = [];
      res.extents = new Uint8Array(0);
    },
  });
  try {
    seal(t.owner, hashes);
    t.setOwned(2);
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "zero");
    await t.tier.flush();
    const s = t.tier.stats();
    assert.equal(s.failures["bad-answer"], 1, JSON.stringify(s.failures));
    assert.equal(s.failures["no-pool-space"], 0, "the pool had room");
    assert.equal(t.locks.stats().held, 0, "the lock was released");
  } finally {
    await t.close();
  }
});

Deno.test("a chunk whose settling throws frees every later chunk's space once it ended: nothing stays planned", async () => {
  // 2 blocks a chunk, one lock: chunks [0, 1], [2, 3], [4, 5]; recording chunk 1's checksums
  // throws (a store error stands for any bug after its bytes landed).
  const t = await twoNodes({ chunkBytes: 200 * 1024, splitLock: false });
  try {
    const hashes = [80, 81, 82, 83, 84, 85].map(hash);
    seal(t.owner, hashes);
    const record = t.req.host.recordChecksums;
    t.req.host.recordChecksums = (ns, hs, crcs) => {
      if (hs.includes(hashes[0])) throw new Error("injected: recording checksums failed");
      return record(ns, hs, crcs);
    };
    t.setOwned(6);
    await fetchAll(t.tier, { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) }, "r-x");
    await t.tier.flush();
    // Before, chunks 2 and 3 were never settled: their blocks stayed inflight here for good.
    for (let i = 2; i < 6; i++) {
      assert.equal(t.req.store.blockState(NS, hashes[i]), "absent", `block ${i}`);
    }
    assert.equal(t.locks.stats().held, 0, "the lock released");
    assert.equal(t.owner.store.stats().pinnedBlocks, 0);
    t.req.store.verify();
  } finally {
    await t.close();
  }
});
