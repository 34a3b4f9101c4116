/**
 * A fetch asks the owners the index names in its order, passing over one
 * that failed by its own doing — it answers a miss, it is dead — for the
 * next, at most three, and never past a failure that is not the owner's
 * (lib/peer/owner_walk.ts). One process over real parts (_two_nodes.ts): a
 * requester, the harness's owner ("owner") and a second owner ("owner-2")
 * with its own pool, lock table, gRPC service and peer RPC socket. An owner
 * that failed by its own doing (frozen, dead) is a suspect for a while:
 * asked after the healthy owners, so later fetches do not pay its deadline.
 */

import assert from "node:assert/strict";
import { blockLayoutIdentity } from "../../lib/storage/layout.ts";
import { Logger } from "../../lib/log.ts";
import type { PeerTierStats } from "../../lib/peer/fetch_stats.ts";
import {
  fetchAll,
  hash,
  LAYOUT,
  NS,
  ownerNode,
  type OwnerOptions,
  payloadOf,
  seal,
  twoNodes,
  type TwoNodesOptions,
} from "./_two_nodes.ts";

/** 96 KiB blocks, 200 KiB chunks: a 6-block prefix is locked as [0, 1] + [2..5]. */
const CHUNK_BYTES = 200 * 1024;
const hashes = [0, 1, 2, 3, 4, 5].map(hash);
const blocks = { namespace: NS, hashes, layout: blockLayoutIdentity(LAYOUT) };

/** An address nothing listens on (a port taken, then given back): a dead owner. */
function deadAddr(): string {
  const l = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const port = l.addr.port;
  l.close();
  return `127.0.0.1:${port}`;
}

/** The harness's requester and owner, a second owner holding the 6 blocks, and the requester's log. */
async function threeNodes(o: TwoNodesOptions = {}, secondOwner: OwnerOptions = {}) {
  const lines: string[] = [];
  const t = await twoNodes({
    chunkBytes: CHUNK_BYTES,
    log: new Logger("info", {}, (l) => void lines.push(l)),
    ...o,
  });
  const second = await ownerNode(3, secondOwner);
  const payloads = seal(second.owner, hashes);
  const owner2 = { nodeId: "owner-2", addr: second.ownerAddr, length: hashes.length };
  return {
    t,
    second,
    payloads,
    owner2,
    /** The requester's log lines that say it passed over an owner. */
    skips: () => lines.filter((l) => l.includes("passed over an owner")),
    /** The requester's log lines that say `text`. */
    logged: (text: string) => lines.filter((l) => l.includes(text)),
    async close() {
      await t.close();
      await second.close();
    },
  };
}

/** Each of `hs` is sealed on the requester with the bytes `want` (no diff of 96 KiB arrays). */
function assertLanded(
  t: Awaited<ReturnType<typeof twoNodes>>,
  hs: Uint8Array[],
  want: Uint8Array[],
) {
  hs.forEach((h, i) => {
    assert.equal(t.req.store.blockState(NS, h), "sealed", `block ${i} landed`);
    const got = payloadOf(t.req.host, t.req.n.mem, h)!;
    assert.ok(got.length === want[i].length && got.every((b, j) => b === want[i][j]), `block ${i}`);
  });
}

function failures(s: PeerTierStats): number {
  return Object.values(s.failures).reduce((a, b) => a + b, 0);
}

Deno.test("an owner that answers a miss is passed over: the next owner the index names serves the prefix, both parts of its split lock", async () => {
  const w = await threeNodes();
  try {
    // The index names the harness's owner first, but it evicted the blocks since.
    w.t.setOwned(6);
    w.t.setOthers([w.owner2]);
    await fetchAll(w.t.tier, blocks, "r-miss");
    await w.t.tier.flush();
    assertLanded(w.t, hashes, w.payloads);
    const s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 1, "a success, not a miss");
    assert.equal(failures(s), 0, "the owner passed over is no failure of the fetch");
    assert.deepEqual(s.ownersSkipped, { connect: 0, "lock-rpc": 0, "owner-miss": 1 });
    assert.equal(w.t.calls["framed queryBlocksForTransfer"], 1, "the first owner was asked once");
    assert.equal(w.t.locks.stats().misses["not-held"], 1);
    const l2 = w.second.locks.stats();
    assert.equal(l2.granted, 2, "the first chunk and the rest, both of the second owner");
    assert.equal(l2.released, 2);
    assert.equal(l2.held, 0);
    assert.equal(w.second.owner.store.stats().pinnedBlocks, 0);
    const skips = w.skips();
    assert.equal(skips.length, 1, "one line per owner passed over");
    for (
      const field of [
        `"owner":"owner"`,
        `"addr":"${w.t.ownerAddr}"`,
        `"reason":"owner-miss"`,
        `"namespace":"${NS}"`,
        `"request":"r-miss"`,
        `"first_block":`,
        `"next_owner":"owner-2"`,
      ]
    ) assert.ok(skips[0].includes(field), `${field} in ${skips[0]}`);
    w.t.req.store.verify();
  } finally {
    await w.close();
  }
});

Deno.test("a dead owner is passed over for the next; at most three owners are asked", async () => {
  const w = await threeNodes();
  try {
    const dead = (i: number) => ({ nodeId: `dead-${i}`, addr: deadAddr(), length: 6 });
    w.t.setOthers([dead(1), w.owner2]);
    await fetchAll(w.t.tier, blocks, "r-dead");
    await w.t.tier.flush();
    assertLanded(w.t, hashes, w.payloads);
    let s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 1);
    assert.equal(failures(s), 0);
    assert.equal(s.ownersSkipped.connect, 1);
    assert.ok(w.skips()[0].includes(`"owner":"dead-1"`), w.skips()[0]);

    // Three dead owners before the live one: the fetch ends at the third, a miss.
    const other = [6, 7, 8].map(hash);
    w.t.setOthers([dead(2), dead(3), dead(4), { ...w.owner2, length: 3 }]);
    seal(w.second.owner, other);
    await fetchAll(w.t.tier, { ...blocks, hashes: other }, "r-all-dead");
    s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 1, "no second success");
    assert.equal(s.failures.connect, 1, "one failed fetch, counted at the owner it ended on");
    assert.equal(s.ownersSkipped.connect, 3, "two more passed over");
    assert.equal(w.second.locks.stats().granted, 2, "the fourth owner was never asked");
    assert.equal(w.t.req.store.blockState(NS, other[0]), "absent");
  } finally {
    await w.close();
  }
});

Deno.test("a failure that is not the owner's doing ends the fetch at the first owner; a miss there is passed over", async () => {
  // The first owner answers a block payload this node does not have (bad-answer).
  const w = await threeNodes({ tamper: (res) => void (res.payloadBytes = 1234) });
  try {
    const held = seal(w.t.owner, hashes);
    assert.equal(held.length, 6);
    w.t.setOwned(6);
    w.t.setOthers([w.owner2]);
    await fetchAll(w.t.tier, blocks, "r-bad");
    await w.t.tier.flush();
    const s = w.t.tier.stats();
    assert.equal(s.failures["bad-answer"], 1);
    assert.equal(s.fetchesOk, 0);
    assert.deepEqual(s.ownersSkipped, { connect: 0, "lock-rpc": 0, "owner-miss": 0 });
    assert.equal(w.t.locks.stats().released, 1, "the refused answer's lock was released");
    assert.equal(w.second.locks.stats().granted + w.second.locks.stats().misses["not-held"], 0);
    assert.deepEqual(w.skips(), []);

    // This node's layout refused (other-layout): every owner of the namespace would refuse it.
    const other = { ...LAYOUT, layers: 4, segmentBytes: LAYOUT.segmentBytes * 3 / 4 };
    await fetchAll(w.t.tier, { ...blocks, layout: blockLayoutIdentity(other) }, "r-layout");
    assert.equal(w.t.tier.stats().failures["owner-miss"], 1);
    assert.equal(w.t.locks.stats().misses["other-layout"], 1);
    assert.equal(w.second.calls["framed queryBlocksForTransfer"] ?? 0, 0, "never asked");
    assert.deepEqual(w.skips(), []);

    // The same first owner answering a miss (blocks it does not hold) is passed over.
    const more = [9, 10].map(hash);
    const payloads = seal(w.second.owner, more);
    await fetchAll(w.t.tier, { ...blocks, hashes: more }, "r-next");
    assertLanded(w.t, more, payloads);
    assert.equal(w.t.tier.stats().fetchesOk, 1);
    assert.equal(w.t.tier.stats().ownersSkipped["owner-miss"], 1);
  } finally {
    await w.close();
  }
});

/** A promise the test resolves itself (an owner's handler held until then). */
function gate() {
  let open = () => {};
  const shut = new Promise<void>((r) => open = r);
  return { shut, open };
}

Deno.test("a later owner whose connection is made only after the fetch's deadline is never asked for a lock", async () => {
  // The first owner's lock is held past the 600 ms lock deadline: passed over with 300 ms of
  // the fetch's 900 left; the second owner's handshake takes 500 ms.
  const held = gate();
  const w = await threeNodes(
    { rpcTimeoutMs: 600, fetchTimeoutMs: 900, beforeLock: () => held.shut },
    { beforeConnect: () => new Promise((r) => setTimeout(r, 500)) },
  );
  try {
    seal(w.t.owner, hashes);
    w.t.setOwned(6);
    w.t.setOthers([w.owner2]);
    await fetchAll(w.t.tier, blocks, "r-late");
    const s = w.t.tier.stats();
    assert.equal(s.ownersSkipped["lock-rpc"], 1, "the held owner passed over");
    assert.equal(s.failures.connect, 1, "one failure: no connection within the deadline");
    assert.equal(failures(s), 1);
    assert.equal(
      w.second.calls["framed queryBlocksForTransfer"] ?? 0,
      0,
      "no lock asked past the deadline",
    );
    held.open();
    await w.t.tier.flush();
    assert.equal(w.second.locks.stats().held, 0);
    assert.equal(w.t.locks.stats().held, 0, "the held owner's lock ended by its abandon");
  } finally {
    held.open();
    await w.close();
  }
});

Deno.test("a later owner's second lock part gets the RPC deadline, not what was left of the walk", async () => {
  // The first owner's lock is held past the 1500 ms lock deadline: the second owner is asked
  // with ~400 ms of the fetch's 1900 left; its answer to the second part takes 900 ms.
  const held = gate();
  const w = await threeNodes(
    { rpcTimeoutMs: 1500, fetchTimeoutMs: 1900, beforeLock: () => held.shut },
    { beforeLock: (n) => n === 2 ? new Promise((r) => setTimeout(r, 900)) : Promise.resolve() },
  );
  try {
    seal(w.t.owner, hashes);
    w.t.setOwned(6);
    w.t.setOthers([w.owner2]);
    await fetchAll(w.t.tier, blocks, "r-rest");
    held.open();
    await w.t.tier.flush();
    assertLanded(w.t, hashes, w.payloads);
    const s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 1);
    assert.equal(failures(s), 0, "the second part is no lock-rpc failure");
    assert.equal(s.ownersSkipped["lock-rpc"], 1);
    const l2 = w.second.locks.stats();
    assert.equal(l2.granted, 2);
    assert.equal(l2.released, 2);
    assert.equal(l2.held, 0);
  } finally {
    held.open();
    await w.close();
  }
});

/** The lock calls `calls` counted (the peer RPC socket carries them). */
function lockCalls(calls: Record<string, number>): number {
  return calls["framed queryBlocksForTransfer"] ?? 0;
}

/** Blocks `from`.. `from + 5`, sealed on each owner given. */
function prefix(from: number, ...owners: Parameters<typeof seal>[0][]) {
  const hs = [0, 1, 2, 3, 4, 5].map((i) => hash(from + i));
  for (const o of owners) seal(o, hs);
  return { ...blocks, hashes: hs };
}

Deno.test("a frozen owner is asked after the healthy one until its suspect period ends", async () => {
  // The first owner's lock handler is held (frozen) past the 300 ms lock deadline.
  const SUSPECT_MS = 1500;
  const held = gate();
  const w = await threeNodes({
    rpcTimeoutMs: 300,
    ownerSuspectMs: SUSPECT_MS,
    beforeLock: () => held.shut,
  });
  try {
    seal(w.t.owner, hashes);
    w.t.setOwned(6);
    w.t.setOthers([w.owner2]);
    await fetchAll(w.t.tier, blocks, "r-frozen");
    let s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 1, "served by the second owner after the lock deadline");
    assert.equal(s.ownersSkipped["lock-rpc"], 1);
    assert.deepEqual(s.ownersSuspected, { connect: 0, "lock-rpc": 1 });
    assert.equal(lockCalls(w.t.calls), 1);
    const marked = w.logged("asked after the healthy owners");
    assert.equal(marked.length, 1, "one line when it becomes suspect");
    for (
      const field of [
        `"owner":"owner"`,
        `"addr":"${w.t.ownerAddr}"`,
        `"reason":"lock-rpc"`,
        `"request":"r-frozen"`,
        `"suspect_until":`,
      ]
    ) assert.ok(marked[0].includes(field), `${field} in ${marked[0]}`);

    // Right after: the second owner is asked first; the frozen one gets no lock call.
    const second = prefix(20, w.t.owner, w.second.owner);
    const granted2 = w.second.locks.stats().granted;
    await fetchAll(w.t.tier, second, "r-after");
    s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 2);
    assert.equal(lockCalls(w.t.calls), 1, "no lock call reached the suspect owner");
    assert.equal(s.ownersSkipped["lock-rpc"], 1, "nothing passed over: no deadline paid");
    assert.equal(w.second.locks.stats().granted, granted2 + 2, "both parts from the second owner");
    assert.equal(w.logged("asked after the healthy owners").length, 1, "logged once");

    // Thawed, and its mark expired: it is asked first again and serves the prefix.
    held.open();
    await new Promise((r) => setTimeout(r, SUSPECT_MS));
    const third = prefix(40, w.t.owner, w.second.owner);
    const asked2 = lockCalls(w.second.calls);
    await fetchAll(w.t.tier, third, "r-expired");
    await w.t.tier.flush();
    s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 3);
    assert.equal(lockCalls(w.t.calls), 3, "the first owner locked both parts");
    assert.equal(lockCalls(w.second.calls), asked2, "the second owner was not asked");
    assert.equal(w.t.req.store.blockState(NS, third.hashes[5]), "sealed");
    assert.equal(failures(s), 0);
  } finally {
    held.open();
    await w.close();
  }
});

Deno.test("a suspect owner that grants a lock is cleared at once: the next fetch asks it first", async () => {
  // Only the first lock call is held (frozen once); the suspect period outlasts the test.
  const held = gate();
  const w = await threeNodes({
    rpcTimeoutMs: 300,
    ownerSuspectMs: 60_000,
    beforeLock: (n) => n === 1 ? held.shut : Promise.resolve(),
  });
  try {
    seal(w.t.owner, hashes);
    w.t.setOwned(6);
    w.t.setOthers([w.owner2]);
    await fetchAll(w.t.tier, blocks, "r-frozen");
    assert.equal(w.t.tier.stats().ownersSuspected["lock-rpc"], 1);
    held.open();

    // The second owner (healthy, asked first) misses; the suspect is asked next and grants.
    const mine = prefix(20, w.t.owner);
    const asked2 = lockCalls(w.second.calls);
    await fetchAll(w.t.tier, mine, "r-back");
    let s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 2);
    assert.equal(lockCalls(w.second.calls), asked2 + 1, "the healthy owner was asked first");
    assert.equal(s.ownersSkipped["owner-miss"], 1);
    assert.equal(w.logged("no longer suspect").length, 1);

    // Cleared: asked first again, the second owner untouched.
    const both = prefix(40, w.t.owner, w.second.owner);
    const asked1 = lockCalls(w.t.calls);
    await fetchAll(w.t.tier, both, "r-first");
    await w.t.tier.flush();
    s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 3);
    assert.equal(lockCalls(w.t.calls), asked1 + 2, "both parts from the first owner");
    assert.equal(lockCalls(w.second.calls), asked2 + 1, "the second owner was not asked");
    assert.equal(s.ownersSkipped["owner-miss"], 1);
    assert.deepEqual(s.ownersSuspected, { connect: 0, "lock-rpc": 1 });
  } finally {
    held.open();
    await w.close();
  }
});

Deno.test("a dead owner still in the index costs one failed connect per suspect period, not one per fetch", async () => {
  const w = await threeNodes();
  try {
    w.t.setOthers([{ nodeId: "dead", addr: deadAddr(), length: 6 }, w.owner2]);
    await fetchAll(w.t.tier, blocks, "r-dead");
    let s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 1);
    assert.equal(s.ownersSkipped.connect, 1);
    assert.deepEqual(s.ownersSuspected, { connect: 1, "lock-rpc": 0 });

    await fetchAll(w.t.tier, prefix(20, w.second.owner), "r-again");
    s = w.t.tier.stats();
    assert.equal(s.fetchesOk, 2);
    assert.equal(s.ownersSkipped.connect, 1, "the dead owner was not connected to again");
    assert.equal(failures(s), 0);
  } finally {
    await w.close();
  }
});
