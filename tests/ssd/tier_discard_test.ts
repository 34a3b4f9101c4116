/**
 * A Save's discard reaches the SSD tier. With MLA (one slot shared by every
 * TP rank) a rank's garbage save seals a block at once and write-behind
 * copied it to disk; another rank's discard evicted the RAM copy only, and
 * once the 60 s tombstone expired a query of the prefix prefetched the
 * garbage back from the SSD. Now `applyDiscards` has the tiers `drop` the
 * hashes: the SSD index forgets them, and a write of them queued or running
 * is not indexed when it lands.
 */
import assert from "node:assert/strict";
import type { EngineContext } from "../../lib/engine/context.ts";
import type { Instance, RankCtx } from "../../lib/engine/instances.ts";
import type { SaveArgs } from "../../lib/engine/save.ts";
import { applyDiscards } from "../../lib/engine/save_discard.ts";
import { Logger } from "../../lib/log.ts";
import { blockLayoutIdentity } from "../../lib/storage/layout.ts";
import { LowerTiers } from "../../lib/storage/lower_tiers.ts";
import { DISCARD_TTL_MS, KvStore } from "../../lib/storage/store.ts";
import { sealedHashBytes } from "../../lib/storage/tier.ts";
import { storeTierHost } from "../../lib/storage/tier_host.ts";
import { SsdStorageTier } from "../../lib/ssd/ssd_tier_port.ts";
import type { SsdTier } from "../../lib/ssd/tier.ts";
import { FakeClock } from "../storage/helpers.ts";
import { type Harness, harness } from "./_harness.ts";

const MiB = 1 << 20;
const NS = "0123456789abcdef";
/** MLA: one K/V slot per layer shared by both TP ranks (either rank's save seals the block). */
const MLA = { layers: 4, tpSize: 2, collapseTp: true, segments: 1, segmentBytes: 16384 };
const H = [new Uint8Array([0xd1, 0, 0xab]), new Uint8Array([0xd1, 1, 0xab])];
const hex = (x: Uint8Array) => [...x].map((b) => b.toString(16).padStart(2, "0")).join("");
type Pool = Harness["pool"];

interface Rig {
  h: Harness;
  clock: FakeClock;
  store: KvStore;
  tier: SsdTier;
  port: SsdStorageTier;
  tiers: LowerTiers;
}

async function rig(): Promise<Rig> {
  const h = await harness(32 * MiB);
  const clock = new FakeClock();
  const store = new KvStore({ capacityBytes: 32 * MiB, clock: clock.read });
  store.defineNamespace(NS, MLA);
  const tier = await h.openTier({ capacityBytes: 64 * MiB, segmentBytes: 4 * MiB });
  const port = new SsdStorageTier(tier, storeTierHost(store), h.log);
  return { h, clock, store, tier, port, tiers: new LowerTiers({ ram: store, tiers: [port] }) };
}

/** One rank's save of `hs`, each slot filled with `tag/hash/layer`; returns the sealed hashes. */
function save(store: KvStore, pool: Pool, hs: Uint8Array[], rank: number, tag: string) {
  const begun = store.beginSave({ namespace: NS, instance: "inst", rank, hashes: hs });
  assert.ok(begun.ok);
  const p = begun.plan;
  for (let li = 0; li < p.layers.length; li++) {
    for (let b = 0; b < p.blockCount; b++) {
      const v = pool.view(p.offsets[li * p.blockCount + b], p.segmentBytes);
      v.fill(0);
      v.set(new TextEncoder().encode(`${tag}/${hex(hs[p.hashIndex[b]])}/${p.layers[li]}`));
    }
  }
  return sealedHashBytes(p, hs, store.completeSave(p, true));
}

/** The tag of each of `hash`'s slots in RAM. */
function tags(store: KvStore, pool: Pool, hash: Uint8Array): string[] {
  const lock = store.lockForTransfer(NS, [hash], "test")!;
  const out = [...lock.offsets].map((off) => {
    const v = pool.view(off, 64);
    return new TextDecoder().decode(v.subarray(0, v.indexOf(0))).split("/")[0];
  });
  store.releaseTransferLock(lock.id);
  return out;
}

/** Rank 1's Save carrying `hashes` as discard_hashes, through the engine's `applyDiscards`. */
function discard(r: Rig, hashes: Uint8Array[]): number {
  const ctx = {
    store: r.store,
    tiers: r.tiers,
    log: new Logger("error"),
  } as unknown as EngineContext;
  const inst = { id: "inst", namespace: NS } as unknown as Instance;
  const rank = { rank: 1, tpRank: 1, ppRank: 0 } as unknown as RankCtx;
  const args = { discardHashes: hashes, layers: [], requestId: "req-bad" } as unknown as SaveArgs;
  return applyDiscards(ctx, inst, rank, args);
}

/** Nothing pinned, locked, queued or in flight; the store's books balance. */
function assertNoLeaks(r: Rig): void {
  const s = r.store.stats();
  assert.deepEqual([s.pinnedBlocks, s.transferLocksActive], [0, 0], "RAM pins or locks left");
  const t = r.tier.stats();
  assert.deepEqual([t.writeQueueDepth, t.writeInflight], [0, 0], "SSD writes left");
  r.store.verify();
}

async function close(r: Rig): Promise<void> {
  await r.tiers.close();
  await r.h.close();
}

Deno.test("tier discard: an MLA garbage block written to SSD is a miss after the TTL, not a prefetch of the garbage", async () => {
  const r = await rig();
  try {
    const sealed = save(r.store, r.h.pool, H, 0, "garbage"); // rank 0 alone seals (MLA)
    assert.equal(sealed.length, 2);
    r.tiers.sealed(NS, sealed);
    await r.tiers.flush();
    const blocks = { namespace: NS, hashes: H, layout: r.tier.storedLayouts(NS)[0] };
    assert.equal(r.port.has(blocks), 2, "write-behind copied both blocks");
    assert.equal(discard(r, H), 2, "rank 1's discard evicted both from RAM");
    assert.equal(r.port.has(blocks), 0, "the SSD still indexes the discarded blocks");
    assert.equal(r.tier.stats().indexBlocks, 0);
    r.clock.tick(DISCARD_TTL_MS);
    assert.equal(
      r.tiers.beforeQuery(NS, "inst", H, "req-after"),
      false,
      "the query after the TTL prefetches the garbage from SSD",
    );
    assert.equal(r.store.blockState(NS, H[0]), "absent");
    assert.equal(r.tier.stats().readBlocks, 0, "a discarded record was read");
    assert.equal(r.tiers.stats().sources.queries.miss, 1);
    // The prefix is cached anew: a correct save seals, is written again and served from SSD.
    r.tiers.sealed(NS, save(r.store, r.h.pool, H, 0, "good"));
    await r.tiers.flush();
    assert.equal(r.port.has(blocks), 2, "the correct blocks were not written to SSD");
    r.store.evictAll();
    assert.equal(r.tiers.beforeQuery(NS, "inst", H, "req-good"), true);
    await r.tier.prefetchSettled("inst:req-good");
    assert.equal(r.tiers.beforeQuery(NS, "inst", H, "req-good"), false);
    for (const x of H) {
      assert.deepEqual(tags(r.store, r.h.pool, x), ["good", "good", "good", "good"]);
    }
    assertNoLeaks(r);
  } finally {
    await close(r);
  }
});

Deno.test("tier discard: a write-behind of a discarded block still in flight does not index it", async () => {
  const r = await rig();
  try {
    const sealed = save(r.store, r.h.pool, H, 0, "garbage");
    // Put straight to the SSD port: a free writer starts the batch at once (pinned in RAM).
    const layout = blockLayoutIdentity(r.store.layoutOf(NS)!);
    const put = r.port.put({ namespace: NS, hashes: sealed, layout });
    assert.equal(put.status, "queued");
    assert.equal(r.tier.stats().writeInflight, 1, "the write runs");
    // The discard finds the blocks pinned by the write: doomed in RAM, dropped from the SSD.
    assert.equal(discard(r, H), 0, "nothing evicted under the write's pin");
    assert.equal(r.tiers.tiers[0].drop(NS, []), 0);
    await r.tiers.flush();
    const t = r.tier.stats();
    assert.equal(t.writeFailures, 0);
    assert.equal(t.indexBlocks, 0, "the write landed and indexed a discarded block");
    assert.equal(r.store.blockState(NS, H[0]), "absent", "the last unpin evicted it");
    r.clock.tick(DISCARD_TTL_MS);
    assert.equal(r.tiers.beforeQuery(NS, "inst", H, "req-after"), false);
    assert.equal(r.tier.stats().readBlocks, 0);
    // Not pending any more: the next (correct) save of the hashes is written and indexed.
    r.tiers.sealed(NS, save(r.store, r.h.pool, H, 0, "good"));
    await r.tiers.flush();
    assert.equal(r.tier.stats().indexBlocks, 2, "a correct save after the TTL was not written");
    assertNoLeaks(r);
  } finally {
    await close(r);
  }
});

Deno.test("tier discard: discarding hashes the SSD does not hold is harmless", async () => {
  const r = await rig();
  try {
    r.tiers.sealed(NS, save(r.store, r.h.pool, [H[0]], 0, "good"));
    await r.tiers.flush();
    const other = [new Uint8Array([0xee, 1]), new Uint8Array([0xee, 2])];
    assert.equal(discard(r, other), 0, "nothing of those in RAM");
    assert.equal(r.tiers.drop(NS, other), 0, "nothing of those on SSD");
    assert.equal(r.tiers.drop("another-namespace", [H[0]]), 0, "another namespace's key");
    assert.equal(r.tier.stats().indexBlocks, 1, "the held block stays indexed");
    r.store.evictAll();
    assert.equal(r.tiers.beforeQuery(NS, "inst", [H[0]], "req"), true, "still served from SSD");
    await r.tier.prefetchSettled("inst:req");
    assert.equal(r.tiers.beforeQuery(NS, "inst", [H[0]], "req"), false);
    assert.deepEqual(tags(r.store, r.h.pool, H[0]), ["good", "good", "good", "good"]);
    assertNoLeaks(r);
  } finally {
    await close(r);
  }
});
