/**
 * The SSD tier behind the Tier port, wired as the server wires it
 * (LowerTiers over the real KvStore, SsdStorageTier over a real SsdTier, the
 * store's TierHost): write-behind through the tier.admit → ssd.write chain,
 * prefetch through beginFill, committed slot-for-slot.
 */
import assert from "node:assert/strict";
import { KvStore } from "../../lib/storage/store.ts";
import { LowerTiers } from "../../lib/storage/lower_tiers.ts";
import { sealedHashBytes } from "../../lib/storage/tier.ts";
import { storeTierHost } from "../../lib/storage/tier_host.ts";
import type { TierHost } from "../../lib/storage/tier.ts";
import { SsdStorageTier } from "../../lib/ssd/ssd_tier_port.ts";
import type { SsdTier } from "../../lib/ssd/tier.ts";
import { type Harness, harness } from "./_harness.ts";

const MiB = 1 << 20;
const NS = "0123456789abcdef";
// 4 layers × 2 TP ranks × K/V of 16 KiB: 256 KiB per block, 16 slots.
const LAYOUT = { layers: 4, tpSize: 2, collapseTp: false, segments: 2, segmentBytes: 16384 };
const hashes = Array.from({ length: 12 }, (_, i) => new Uint8Array([0x10, i, 0xab]));
const hex = (h: Uint8Array) => [...h].map((b) => b.toString(16).padStart(2, "0")).join("");

/** Saves `hs` into the store as the engine would: plan per rank, write pool bytes, complete. */
function save(
  store: KvStore,
  pool: { view(o: number, n: number): Uint8Array },
  hs: Uint8Array[],
): Uint8Array[] {
  const sealed: Uint8Array[] = [];
  for (let rank = 0; rank < LAYOUT.tpSize; rank++) {
    const begun = store.beginSave({ namespace: NS, instance: "inst", rank, hashes: hs });
    assert.ok(begun.ok);
    const p = begun.plan;
    for (let li = 0; li < p.layers.length; li++) {
      for (let s = 0; s < p.segments; s++) {
        for (let b = 0; b < p.blockCount; b++) {
          const off = p.offsets[(li * p.segments + s) * p.blockCount + b];
          // Content names (hash, layer, rank, segment) so a misplaced slot is caught.
          const tag = `${hex(hs[p.hashIndex[b]])}/${p.layers[li]}/${rank}/${s}`;
          const v = pool.view(off, p.segmentBytes);
          v.fill(0);
          v.set(new TextEncoder().encode(tag));
        }
      }
    }
    sealed.push(...sealedHashBytes(p, hs, store.completeSave(p, true)));
  }
  return sealed;
}

function slotTag(
  store: KvStore,
  pool: { view(o: number, n: number): Uint8Array },
  hash: Uint8Array,
): string[] {
  const lock = store.lockForTransfer(NS, [hash], "test")!;
  const tags: string[] = [];
  for (const off of lock.offsets) {
    const v = pool.view(off, 64);
    tags.push(new TextDecoder().decode(v.subarray(0, v.indexOf(0))));
  }
  store.releaseTransferLock(lock.id);
  return tags;
}

/** The tiers as the server wires them: one SSD tier behind the port, over `store` (or `host`). */
function wire(h: Harness, store: KvStore, tier: SsdTier, host = storeTierHost(store)): LowerTiers {
  return new LowerTiers({ ram: store, tiers: [new SsdStorageTier(tier, host, h.log)] });
}

Deno.test("tier port: sealed blocks go to SSD; after RAM eviction a query loads them back into the store byte-exact", async () => {
  const h = await harness(32 * MiB);
  const store = new KvStore({ capacityBytes: 32 * MiB });
  store.defineNamespace(NS, LAYOUT);
  const tier = await h.openTier({
    capacityBytes: 64 * MiB,
    segmentBytes: 4 * MiB,
  });
  const tiers = wire(h, store, tier);
  try {
    const sealed = save(store, h.pool, hashes);
    assert.equal(sealed.length, 12);
    const before = hashes.map((x) => slotTag(store, h.pool, x));
    tiers.sealed(NS, sealed);
    await tiers.flush();
    assert.equal(tier.stats().writeBlocks, 12);
    assert.equal(store.stats().pinnedBlocks, 0, "write-behind released its transfer locks");
    // RAM loses everything; the first 3 blocks come back from a save.
    store.evictAll();
    save(store, h.pool, hashes.slice(0, 3));
    assert.equal(
      tiers.beforeQuery(NS, "inst", hashes, "req-A"),
      true,
      "prefix continues on SSD: loading",
    );
    assert.equal(
      store.query(NS, hashes, "other", 1).hits,
      3,
      "fetched blocks are invisible until committed",
    );
    assert.equal(
      tiers.beforeQuery(NS, "inst", hashes, "req-B"),
      true,
      "another request joins the read in flight",
    );
    await tier.prefetchSettled("inst:req-A"); // the tier keys it under its instance
    const other = store.query(NS, hashes, "other", 1);
    assert.equal(other.hits, 12, "committed as they landed, before req-A polls again");
    store.releaseLease(other.lease!.idBytes);
    assert.equal(tier.stats().readBlocks, 9, "read once for both requests");
    assert.equal(tiers.beforeQuery(NS, "inst", hashes, "req-B"), false);
    assert.equal(tiers.beforeQuery(NS, "inst", hashes, "req-A"), false);
    const q = store.query(NS, hashes, "inst", 2);
    assert.equal(q.hits, 12);
    for (let i = 0; i < hashes.length; i++) {
      assert.deepEqual(
        slotTag(store, h.pool, hashes[i]),
        before[i],
        `block ${hashes[i]} slot by slot`,
      );
    }
    // A later query with everything in RAM does not touch the SSD.
    assert.equal(tiers.beforeQuery(NS, "inst", hashes, "req-C"), false);
    assert.equal(tier.hasPrefetch("req-C"), false);
    assert.equal(store.stats().transferLocksActive, 0);
    store.verify();
  } finally {
    await tier.close();
    await h.close();
  }
});

Deno.test("tier port: a block evicted before its write started is skipped and nothing stays pinned", async () => {
  const h = await harness(32 * MiB);
  const store = new KvStore({ capacityBytes: 32 * MiB });
  store.defineNamespace(NS, LAYOUT);
  const tier = await h.openTier({
    capacityBytes: 64 * MiB,
    segmentBytes: 4 * MiB,
    writeQueueDepth: 4,
    writeInflight: 1,
  });
  const tiers = wire(h, store, tier);
  try {
    const first = save(store, h.pool, hashes.slice(0, 2));
    const second = save(store, h.pool, hashes.slice(2, 4));
    tiers.sealed(NS, first); // starts at once (one credit)
    tiers.sealed(NS, second); // queued behind it
    store.evictAll(); // the first batch is pinned by its transfer lock; the second is not yet
    await tiers.flush();
    const s = tier.stats();
    assert.equal(s.writeBlocks, 2);
    assert.equal(s.writeSkippedEvicted, 2);
    assert.equal(store.stats().pinnedBlocks, 0);
  } finally {
    await tier.close();
    await h.close();
  }
});

Deno.test("tier port: health reports capacity and held bytes, and closed after close", async () => {
  const h = await harness(32 * MiB);
  const store = new KvStore({ capacityBytes: 32 * MiB });
  store.defineNamespace(NS, LAYOUT);
  const tier = await h.openTier({ capacityBytes: 64 * MiB, segmentBytes: 4 * MiB });
  const tiers = wire(h, store, tier);
  try {
    const [ssd] = tiers.tiers;
    assert.deepEqual(ssd.health(), {
      state: "up",
      capacityBytes: tier.stats().capacityBytes,
      usedBytes: 0,
      blocks: 0,
    });
    tiers.sealed(NS, save(store, h.pool, hashes.slice(0, 3)));
    await tiers.flush();
    const blockBytes = LAYOUT.layers * LAYOUT.tpSize * LAYOUT.segments * LAYOUT.segmentBytes;
    assert.equal(ssd.health().usedBytes, 3 * blockBytes);
    assert.equal(ssd.health().blocks, 3);
    await tiers.close();
    assert.equal(ssd.health().state, "closed");
    assert.equal(ssd.health().blocks, 3, "readable after close: no I/O behind it");
  } finally {
    await tier.close();
    await h.close();
  }
});

Deno.test("tier port: a fill that throws while planning a prefetch stops it there; the blocks planned before it are read, nothing leaks", async () => {
  const h = await harness(32 * MiB);
  const store = new KvStore({ capacityBytes: 32 * MiB });
  store.defineNamespace(NS, LAYOUT);
  const tier = await h.openTier({ capacityBytes: 64 * MiB, segmentBytes: 4 * MiB });
  const real = storeTierHost(store);
  let fills = 0;
  const host: TierHost = {
    ...real,
    fill(...args) {
      if (++fills === 3) throw new Error("the store refused the fill");
      return real.fill(...args);
    },
  };
  const tiers = wire(h, store, tier, host);
  try {
    const six = hashes.slice(0, 6);
    tiers.sealed(NS, save(store, h.pool, six));
    await tiers.flush();
    store.evictAll();
    assert.equal(tiers.beforeQuery(NS, "inst", six, "req-F"), true, "loading: two blocks planned");
    await tier.prefetchSettled("inst:req-F");
    assert.equal(store.stats().inflightBlocks, 0, "every fill planned was committed");
    const q = store.query(NS, six, "other", 1);
    assert.equal(q.hits, 2, "the blocks before the refused one were read");
    store.releaseLease(q.lease!.idBytes);
    assert.ok(
      h.logs.some((l) =>
        l.includes('"level":"error"') && l.includes(hex(six[2])) && l.includes("inst:req-F") &&
        l.includes(`"namespace":"${NS}"`) && l.includes("the store refused the fill")
      ),
      h.logs.join("\n"),
    );
    assert.equal(tiers.beforeQuery(NS, "inst", six, "req-F"), false, "ready");
    store.verify();
  } finally {
    await tier.close();
    await h.close();
  }
});
