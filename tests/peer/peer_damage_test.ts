/**
 * A block damaged in its owner's pool after its seal, across real server
 * processes (tests/peer/_cluster.ts) and one real redis-server: the test
 * flips one byte of it through /proc/<pid>/mem (it runs as root), a peer's
 * fetch finds it failing its checksum and takes only the prefix before it,
 * and its release reports it (docs/peer.md, "Damaged blocks"): the owner
 * finds the bytes changed since the seal and drops the block from its RAM
 * and so from the index, keeping and lending the others.
 */

import assert from "node:assert/strict";
import type { ServerProc } from "../server/harness.ts";
import { uid } from "../server/harness.ts";
import type { SimEngine } from "../../lib/client/sim_engine.ts";
import { PeerLinks } from "../../lib/peer/link.ts";
import { remoteExtents } from "../../lib/peer/extents_wire.ts";
import { blockLayoutOf, claimStage, newLayout } from "../../lib/engine/namespaces.ts";
import { blockLayoutIdentity } from "../../lib/storage/layout.ts";
import { makeCluster } from "./_cluster.ts";
import {
  assertClean,
  engineOn,
  loadAndVerify,
  metric,
  pollQuery,
  prefix,
  probeOf,
  savePrefix,
  waitFor,
} from "./_fetch.ts";

/**
 * The owner's pool size: no other size a test server maps (64 MiB is the
 * harness default), so its one anonymous mapping of this size is the pool.
 */
const POOL_SIZE = "67mb";
/** Pages of the owner's pool mapping (no huge-pages option: the base page). */
const PAGE_BYTES = 4096;
/** The lock and release the test asks for itself, as a requester would (the peer RPC deadline). */
const RPC_MS = 2000;

/** The layout fingerprint the server derives from `sim`'s registration (lib/engine/namespaces.ts). */
function fingerprintOf(sim: SimEngine): string {
  const claim = {
    who: sim.instanceId,
    tpSize: sim.tpSize,
    ppSize: sim.ppSize,
    ppRank: sim.ppRank,
    layerNames: sim.layerNames,
    segBytes: sim.segBytes,
    numSegments: sim.segments,
    kvSharedAcrossTp: sim.mla,
  };
  const layout = newLayout(sim.namespace, claim);
  claimStage(layout, claim);
  return blockLayoutIdentity(blockLayoutOf(layout)).fingerprint;
}

/**
 * Block `k`'s first pool range on `owner` (offset from the pool's base,
 * bytes), asked as a peer asks: a transfer lock on the prefix up to it, then
 * its release reporting nothing.
 */
async function firstRangeOf(
  owner: ServerProc,
  sim: SimEngine,
  hashes: Uint8Array[],
  k: number,
): Promise<{ offset: number; bytes: number }> {
  const links = new PeerLinks();
  try {
    const lockId = crypto.getRandomValues(new Uint8Array(16));
    const requester = "damage-probe";
    const res = await links.lock(owner.grpc, {
      namespace: sim.namespace,
      blockHashes: hashes.slice(0, k + 1),
      layoutFingerprint: fingerprintOf(sim),
      requester,
      lockTtlMs: 10_000,
      shiftedExtents: true,
      lockId,
    }, RPC_MS);
    const rel = await links.release(owner.grpc, { lockId, requester, failedBlocks: [] }, RPC_MS);
    assert.equal(rel.released, true, "the probe's lock was released");
    assert.equal(res.missReason, "", `the probe's lock missed: ${res.missReason}`);
    assert.equal(res.checksums.length, k + 1, "the probe locked the prefix through block k");
    const r = remoteExtents(res);
    if (typeof r === "string") throw new Error(`the probe's lock answer: ${r}`);
    const e = 2 * r.starts[k];
    return { offset: r.ranges[e], bytes: r.ranges[e + 1] };
  } finally {
    links.close();
  }
}

/**
 * The virtual address of `srv`'s pinned pool: its one private anonymous
 * read-write mapping of the pool's size (from its "pinned pool ready" line).
 */
function poolBase(srv: ServerProc): number {
  const ready = srv.logs().find((l) => l.includes("pinned pool ready"));
  assert.ok(ready, "the owner logged its pool");
  const poolBytes = Number(JSON.parse(ready).pool_bytes);
  const mapped = Math.ceil(poolBytes / PAGE_BYTES) * PAGE_BYTES;
  const maps = Deno.readTextFileSync(`/proc/${srv.pid}/maps`).split("\n");
  const pools = maps.filter((l) => {
    const [range, perms, offset, dev, inode, path] = l.trim().split(/\s+/);
    if (!range || perms !== "rw-p" || offset !== "00000000" || dev !== "00:00" || inode !== "0") {
      return false;
    }
    if (path !== undefined) return false; // [heap], [stack], ...
    const [from, to] = range.split("-").map((x) => parseInt(x, 16));
    return to - from === mapped;
  });
  assert.equal(pools.length, 1, `one anonymous mapping of ${mapped} bytes:\n${pools.join("\n")}`);
  return parseInt(pools[0].split("-")[0], 16);
}

/** Reads `n` bytes of process `pid`'s memory at `addr`. */
function peek(mem: Deno.FsFile, addr: number, n: number): Uint8Array {
  mem.seekSync(addr, Deno.SeekMode.Start);
  const out = new Uint8Array(n);
  let got = 0;
  while (got < n) {
    const r = mem.readSync(out.subarray(got));
    if (r === null || r === 0) {
      throw new Error(`short read of process memory at 0x${addr.toString(16)}`);
    }
    got += r;
  }
  return out;
}

/**
 * Flips one byte of block `k` in `owner`'s pool, after checking that the
 * address holds what `sim` saved there (the block's first range: layer 0's
 * K segment).
 */
async function damageBlock(
  owner: ServerProc,
  sim: SimEngine,
  hashes: Uint8Array[],
  k: number,
): Promise<void> {
  const range = await firstRangeOf(owner, sim, hashes, k);
  assert.equal(range.bytes, sim.segBytes, "a block's first range is one segment");
  const at = poolBase(owner) + range.offset;
  const mem = await Deno.open(`/proc/${owner.pid}/mem`, { read: true, write: true });
  try {
    const saved = sim.regions[0].read(k * sim.segBytes, sim.segBytes);
    assert.deepEqual(peek(mem, at, sim.segBytes), saved, "the address holds block k's bytes");
    const old = peek(mem, at + 7, 1)[0];
    mem.seekSync(at + 7, Deno.SeekMode.Start);
    assert.equal(mem.writeSync(new Uint8Array([old ^ 0x5a])), 1);
    assert.equal(peek(mem, at + 7, 1)[0], old ^ 0x5a, "the byte changed in the owner's pool");
  } finally {
    mem.close();
  }
}

Deno.test("a block damaged in its owner's pool after its seal: the requester takes the prefix before it, the owner drops it from RAM and the index and keeps lending the rest", async () => {
  const N = 4, K = 2;
  const c = await makeCluster(2, "kD");
  try {
    const a = await c.start(0, ["--pool-size", POOL_SIZE]);
    const b = await c.start(1);
    const probe = probeOf(c);
    const ns = uid("ns");
    const hashes = prefix(11, N);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    await savePrefix(simA, hashes);
    // Damaged before its seal-time checksum is recorded, the block would be checksummed at lock
    // time, damage included, and pass.
    await waitFor(
      "A recorded its checksums",
      async () => await metric(a, "pegaflow_peer_checksums_total", '{when="seal"}') >= N,
    );
    await waitFor("advertised", async () => (await probe.lookup(ns, hashes)).length === N);
    await damageBlock(a, simA, hashes, K);

    const q = await pollQuery(simB, hashes, "q-damaged");
    assert.equal(q.loading, true);
    assert.equal(q.answer.hits, K, "B serves the prefix before the damaged block");
    await loadAndVerify(simB, hashes, q.answer.leaseId, K);
    assert.equal(await metric(b, "pegaflow_peer_fetch_failures_total", '{reason="checksum"}'), 1);
    assert.ok(b.logs().some((l) => l.includes("peer block failed its checksum")));

    // B's release reports the block after its answer: A checks it again and drops it.
    await waitFor(
      "A condemned the reported block",
      async () =>
        await metric(a, "pegaflow_peer_reported_bad_blocks_total", '{outcome="condemned"}') === 1,
    );
    assert.equal(
      await metric(a, "pegaflow_peer_reported_bad_blocks_total", '{outcome="intact"}'),
      0,
    );
    assert.equal(await metric(a, "pegaflow_cache_blocks"), N - 1, "A keeps the other blocks");
    const own = await pollQuery(simA, hashes, "q-owner");
    assert.equal(own.answer.hits, K, "A's own engine no longer hits the damaged block");
    await loadAndVerify(simA, hashes, own.answer.leaseId, K);
    await waitFor("A withdrew the damaged block", async () => {
      const r = await probe.lookup(ns, [hashes[K]]);
      return r.available && r.owners.length === 0;
    });
    // The prefix: A's run and B's (its fetched blocks, advertised after their commit) end at k.
    const runs = async () => {
      const r = await probe.lookup(ns, hashes);
      return `${r.length}: ${r.owners.map((o) => `${o.nodeId} ${o.length}`).sort().join(", ")}`;
    };
    await waitFor(
      "B advertised the blocks it fetched",
      async () => (await runs()).includes("node-1"),
    );
    assert.equal(await runs(), `${K}: node-0 ${K}, node-1 ${K}`, "nobody holds block k");
    const rest = await probe.lookup(ns, hashes.slice(K + 1));
    assert.ok(
      rest.owners.some((o) => o.nodeId === "node-0" && o.length === N - K - 1),
      "A still advertises the blocks after the damaged one",
    );
    // ...and lends them: a peer's lock on them is granted.
    const after = await firstRangeOf(a, simA, hashes.slice(K + 1), N - K - 2);
    assert.equal(after.bytes, simA.segBytes);

    for (const [srv, who] of [[a, "owner"], [b, "requester"]] as const) {
      assert.equal(await metric(srv, "pegaflow_peer_locks_held"), 0, `${who}: locks held`);
      assert.equal(await metric(srv, "pegaflow_pinned_blocks"), 0, `${who}: pinned blocks`);
      const res = await srv.http_post("/cache/memory/cleanup");
      await res.body?.cancel();
      await assertClean(srv, `${who} after the damaged block was dropped and all evicted`);
    }
  } finally {
    await c.remove();
  }
});
