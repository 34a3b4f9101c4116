// The RAM side of the Tier port over the real KvStore: fills through
// beginFill (one whole block per plan), pins through one transfer lock per
// batch, and the sealed-hash pairing the engine hands the tiers.
import {
  deepStrictEqual as assertEquals,
  ok as assert,
  strictEqual,
  throws,
} from "node:assert/strict";
import { hashHex } from "../../lib/storage/keys.ts";
import { sealedHashBytes, tierHolder } from "../../lib/storage/tier.ts";
import { checkName } from "../../lib/engine/registration.ts";
import { storeTierHost } from "../../lib/storage/tier_host.ts";
import { blockExtents } from "../../lib/transfer/ranges.ts";
import type { BlockLayout } from "../../lib/storage/block.ts";
import { makeStore, NS } from "./helpers.ts";

/** 3 layers × TP 2 × K/V of 4 KiB: 12 slots items of 4 KiB, 48 KiB per block. */
const TP2: BlockLayout = {
  layers: 3,
  tpSize: 2,
  collapseTp: false,
  segments: 2,
  segmentBytes: 4096,
};
const ITEMS = 3 * 2 * 2;
const bytes = (i: number) => new Uint8Array([0xa0, i, 0x5c]);

/** Every offset of `hash`, in payload order, read through a transfer lock. */
function payloadOffsets(store: ReturnType<typeof makeStore>["store"], hash: Uint8Array): number[] {
  const lock = store.lockForTransfer(NS, [hash], "probe")!;
  const out = [...lock.offsets];
  store.releaseTransferLock(lock.id);
  return out;
}

function expand(extents: readonly { offset: number; bytes: number }[], item: number): number[] {
  const out: number[] = [];
  for (const e of extents) for (let o = 0; o < e.bytes; o += item) out.push(e.offset + o);
  return out;
}

Deno.test("a fill plans one whole block, every layer and rank slot, in payload order, and seals on commit", () => {
  const { store } = makeStore(8, {}, TP2);
  const host = storeTierHost(store);
  strictEqual(host.payloadBytes(NS), ITEMS * 4096);
  strictEqual(host.payloadBytes("unknown-namespace"), undefined);
  const f = host.fill(NS, bytes(1), "ssd", "retained");
  assert(f);
  strictEqual(f.payloadBytes, ITEMS * 4096);
  strictEqual(store.blockState(NS, bytes(1)), "inflight", "invisible until committed");
  strictEqual(store.query(NS, [bytes(1)], "e").hits, 0);
  f.commit();
  strictEqual(store.blockState(NS, bytes(1)), "sealed");
  // The fill's extents are the slots' pool ranges in the order a lock (payload order) lists them.
  assertEquals(expand(f.extents, 4096), payloadOffsets(store, bytes(1)));
  strictEqual(f.extents.length, 1, "in an empty pool a block's slots lie side by side: one range");
  const q = store.query(NS, [bytes(1)], "e", 2);
  strictEqual(q.hits, 1);
  store.releaseLease(q.lease!.idBytes);
  store.verify();
});

Deno.test("an aborted fill frees every byte it planned and leaves no block behind", () => {
  const { store } = makeStore(8, {}, TP2);
  const host = storeTierHost(store);
  const free = store.stats().freeBytes;
  const f = host.fill(NS, bytes(2), "ssd", "retained")!;
  assert(store.stats().freeBytes < free);
  f.abort();
  strictEqual(store.stats().freeBytes, free);
  strictEqual(store.blockState(NS, bytes(2)), "absent");
  store.verify();
});

Deno.test("a fill of a block held, or half-saved by an engine, or with no room, is refused and leaks nothing", () => {
  const { store } = makeStore(2, {}, TP2);
  const host = storeTierHost(store);
  host.fill(NS, bytes(1), "ssd", "retained")!.commit();
  strictEqual(host.fill(NS, bytes(1), "ssd", "retained"), null, "held already");
  // Rank 0 of an engine is saving block 3: its save completes the block, not a fill.
  const b = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [bytes(3)] });
  assert(b.ok);
  const free = store.stats().freeBytes;
  strictEqual(host.fill(NS, bytes(3), "ssd", "retained"), null, "being saved");
  strictEqual(store.stats().freeBytes, free, "the refused fill gave back what it planned");
  store.completeSave(b.plan, false);
  // Two blocks fit the pool; one is pinned under a lease, one half-planned by a fill.
  const q = store.query(NS, [bytes(1)], "e");
  const f = host.fill(NS, bytes(4), "ssd", "retained")!;
  strictEqual(host.fill(NS, bytes(5), "ssd", "retained"), null, "no room");
  f.abort();
  store.releaseLease(q.lease!.idBytes);
  store.verify();
});

Deno.test("a pin takes one transfer lock for a whole batch, in payload order, and skips what RAM evicted", () => {
  const { store } = makeStore(8, {}, TP2);
  const host = storeTierHost(store);
  for (const i of [1, 2, 4]) host.fill(NS, bytes(i), "ssd", "retained")!.commit();
  const asked = [bytes(1), bytes(2), bytes(3), bytes(4)];
  const pin = host.pin(NS, asked, "ssd")!;
  strictEqual(store.stats().transferLocksActive, 1, "one lock for the batch");
  strictEqual(store.stats().pinnedBlocks, 3);
  strictEqual(pin.blocks[2], undefined, "block 3 is not in RAM");
  for (const i of [0, 1, 3]) {
    const b = pin.blocks[i]!;
    strictEqual(b.payloadBytes, ITEMS * 4096);
    assertEquals(expand(b.extents, 4096), payloadOffsets(store, asked[i]), `block ${i}`);
    assertEquals(blockExtents(pin.ranges, i), b.extents, `block ${i}: flat ranges agree`);
  }
  strictEqual(pin.ranges.starts.length, asked.length + 1, "flat ranges index-aligned with the ask");
  strictEqual(pin.ranges.starts[3], pin.ranges.starts[2], "the block not held has no ranges");
  strictEqual(store.evictAll(), 0, "pinned blocks survive eviction");
  pin.release();
  pin.release(); // idempotent: the lock is released once
  strictEqual(store.stats().transferLocksActive, 0);
  strictEqual(store.evictAll(), 3);
  strictEqual(host.pin(NS, asked, "ssd"), null, "nothing held: nothing pinned");
  store.verify();
});

Deno.test("sealed hash bytes pair a completion's sealed blocks with the request's bytes in plan order", () => {
  const { store } = makeStore(16);
  const req: Uint8Array[] = [bytes(1), bytes(2), bytes(3), bytes(1), bytes(4)];
  // Block 2 is held already (deduplicated), block 1 is named twice.
  const pre = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [bytes(2)] });
  assert(pre.ok);
  store.completeSave(pre.plan, true);
  const b = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: req });
  assert(b.ok);
  const done = store.completeSave(b.plan, true);
  const got = sealedHashBytes(b.plan, req, done);
  assertEquals(got.map((x) => hashHex(x)), [bytes(1), bytes(3), bytes(4)].map((x) => hashHex(x)));
  assert(got.every((x) => req.includes(x)), "the request's own byte arrays, not copies");
});

Deno.test("a write pin that outlived its transfer-lock TTL releases cleanly: the store already unpinned it", () => {
  const { store, clock } = makeStore(8, { transferLockTtlMs: 1_000 }, TP2);
  const host = storeTierHost(store);
  host.fill(NS, bytes(1), "ssd", "retained")!.commit();
  const pin = host.pin(NS, [bytes(1)], "ssd")!;
  strictEqual(store.stats().pinnedBlocks, 1);
  clock.tick(1_001);
  store.collect();
  strictEqual(store.stats().pinnedBlocks, 0, "expired with its TTL");
  pin.release();
  strictEqual(store.stats().transferLocksActive, 0);
  store.verify();
});

Deno.test("a batch fill plans the leading run of blocks in one plan, stops at a held one, and seals per block", () => {
  const { store } = makeStore(8, {}, TP2);
  const host = storeTierHost(store);
  host.fill(NS, bytes(13), "ssd", "retained")!.commit();
  const asked = [bytes(10), bytes(11), bytes(12), bytes(13), bytes(14)];
  const free = store.stats().freeBytes;
  const b = host.fillMany(NS, asked, "peer", "reclaimable")!;
  strictEqual(b.count, 3, "stops at the held block 13");
  strictEqual(b.ranges.starts.length, 4, "one range list per planned block");
  strictEqual(b.payloadBytes, ITEMS * 4096);
  // Every planned byte is distinct.
  const all = [0, 1, 2].flatMap((k) => expand(blockExtents(b.ranges, k), 4096));
  strictEqual(new Set(all).size, 3 * ITEMS);
  assert(store.stats().freeBytes < free);
  b.settle((i) => i !== 1); // block 11 did not verify
  throws(() => b.settle(() => true), /settled twice/);
  strictEqual(store.blockState(NS, bytes(10)), "sealed");
  strictEqual(store.blockState(NS, bytes(11)), "absent", "a block that failed is freed");
  strictEqual(store.blockState(NS, bytes(12)), "sealed");
  strictEqual(store.blockState(NS, bytes(14)), "absent", "never planned past the held block");
  // Sealed blocks are where the batch planned them, in payload order.
  assertEquals(payloadOffsets(store, bytes(12)), expand(blockExtents(b.ranges, 2), 4096));
  strictEqual(host.fillMany(NS, [bytes(13)], "peer", "reclaimable"), null, "held: nothing to plan");
  store.verify();
});

Deno.test("a tier's holds are not an engine's: cleaning up an engine named like the tier keeps them", () => {
  const { store } = makeStore(8, {}, TP2);
  const host = storeTierHost(store);
  for (const i of [1, 2]) host.fill(NS, bytes(i), tierHolder("ssd"), "retained")!.commit();
  const pin = host.pin(NS, [bytes(1), bytes(2)], tierHolder("ssd"))!;
  // An engine may be named "ssd" (or "peer-checksum"); its cleanup drops what its id holds.
  assertEquals(store.dropInstance("ssd"), { leases: 0, inflightFreed: 0 });
  assertEquals(store.dropInstance("peer-checksum"), { leases: 0, inflightFreed: 0 });
  strictEqual(store.evictAll(), 0, "the tier's lock still pins both blocks");
  pin.release();
  strictEqual(store.evictAll(), 2);
  // No engine can be named like a holder: instance ids have no ':'.
  throws(() => checkName("instance_id", tierHolder("ssd"), "test"), /instance_id/);
});
