/**
 * The RAM side of the {@link Tier} port over a {@link KvStore}: how a tier
 * fills a block into the pool and pins blocks to read them, through the
 * store's public API only.
 *
 *  - `fill` is one `beginFill` per block: every layer and rank slot in one
 *    plan, so a block that fails verification frees exactly its own slots,
 *    and a verified one seals the moment the tier commits it. (One plan per
 *    batch would spread each block over a column per slot; one plan per
 *    block lets the allocator hand out its slots side by side, so a record
 *    is read with a few iovecs.)
 *  - `pin` is one `lockForTransfer` for the whole batch (the lock's table is
 *    column-major over the found blocks, lib/storage/offsets.ts; it is turned
 *    into each block's payload-order ranges here, once).
 *
 * Adjacent pool ranges of a block are merged by the one range merger
 * (lib/transfer/ranges.ts), so a record is read or written with few iovecs.
 *
 * @module
 */

import { blockExtents, BlockRangesWriter, mergeExtents } from "../transfer/ranges.ts";
import { NO_CHECKSUM, rankSlots } from "./block.ts";
import { LeaseError } from "./errors.ts";
import type { KvStore } from "./store.ts";
import type { FillClass, RamExtents, RamFill, RamFillBatch, RamPin, TierHost } from "./tier.ts";

/**
 * A {@link TierHost} over `store`: the port's method table, each method an
 * adapter onto the store's public API.
 *
 * @example
 * ```ts
 * const host = storeTierHost(store);
 * const tier = new SsdStorageTier(ssd, host);
 * ```
 */
export function storeTierHost(store: KvStore): TierHost {
  return {
    fill: (namespace, hash, filler, cacheClass) =>
      fillBlock(store, namespace, hash, filler, cacheClass),
    fillMany: (namespace, hashes, filler, cacheClass) =>
      fillBlocks(store, namespace, hashes, filler, cacheClass),
    payloadBytes(namespace) {
      const l = store.layoutOf(namespace);
      return l ? l.layers * rankSlots(l) * l.segments * l.segmentBytes : undefined;
    },

    recordChecksums(namespace, hashes, crcs) {
      store.recordChecksums(namespace, hashes, crcs);
    },

    // The store has nobody to tell (advertisedFills, lib/index/attach.ts, does): it only
    // says which of them it still holds sealed.
    committed: (namespace, hashes) =>
      hashes.filter((h) => store.blockState(namespace, h) === "sealed"),

    pin: (namespace, hashes, requester) => pinBlocks(store, namespace, hashes, requester),
  };
}

/** `fill`: one block over every layer and rank slot, in one plan of its own. */
function fillBlock(
  store: KvStore,
  namespace: string,
  hash: Uint8Array,
  filler: string,
  cacheClass: FillClass,
): RamFill | null {
  const begun = store.beginFill({ namespace, instance: filler, hashes: [hash], cacheClass });
  if (!begun.ok) return null;
  const p = begun.plan;
  const items = p.offsets.length;
  // Held already, refused for room, or some slots are being saved by an engine
  // (their offsets are -1): that save completes the block, not this fill.
  let whole = p.blockCount === 1 && p.refusedForRoom === 0;
  for (let i = 0; whole && i < items; i++) whole = p.offsets[i] >= 0;
  if (!whole) {
    store.completeSave(p, false);
    return null;
  }
  // One block over every layer and rank slot, in order: the plan's columns
  // (lib/storage/offsets.ts) are payload order, so its offsets are the block's.
  let settled = false;
  const settle = (ok: boolean) => {
    if (settled) throw new Error(`fill of block in namespace ${namespace} settled twice`);
    settled = true;
    store.completeSave(p, ok);
  };
  return {
    extents: mergeExtents(p.offsets, p.segmentBytes),
    payloadBytes: items * p.segmentBytes,
    commit: () => settle(true),
    abort: () => settle(false),
  };
}

/** `fillMany`: one plan for a batch; the leading run of asked hashes planned whole. */
function fillBlocks(
  store: KvStore,
  namespace: string,
  hashes: readonly Uint8Array[],
  filler: string,
  cacheClass: FillClass,
): RamFillBatch | null {
  if (hashes.length === 0) return null;
  const begun = store.beginFill({ namespace, instance: filler, hashes, cacheClass });
  if (!begun.ok) return null;
  const p = begun.plan;
  const n = p.blockCount;
  const items = n > 0 ? p.offsets.length / n : 0;
  // The leading run of asked hashes planned whole: plan block k must be hash k
  // (a held block is deduplicated out of the plan) with every slot of its own.
  let m = 0;
  for (; m < n && p.hashIndex[m] === m; m++) {
    let whole = true;
    for (let col = 0; whole && col < items; col++) whole = p.offsets[col * n + m] >= 0;
    if (!whole) break;
  }
  if (m === 0) {
    store.completeSave(p, false);
    return null;
  }
  // Each block's offsets in payload order are column col of the table (lib/storage/offsets.ts).
  const w = new BlockRangesWriter(m, m * items);
  for (let k = 0; k < m; k++) w.addBlock(p.offsets, k, n, items, p.segmentBytes);
  let settled = false;
  return {
    count: m,
    payloadBytes: items * p.segmentBytes,
    ranges: w.finish(),
    settle: (ok) => {
      if (settled) {
        throw new Error(`fill of ${m} blocks in namespace ${namespace} settled twice`);
      }
      settled = true;
      store.completeSave(p, (k) => k < m && ok(k));
    },
  };
}

/** `pin`: one transfer lock for the batch, turned into each block's payload-order ranges. */
function pinBlocks(
  store: KvStore,
  namespace: string,
  hashes: readonly Uint8Array[],
  requester: string,
): RamPin | null {
  const layout = store.layoutOf(namespace);
  if (!layout || hashes.length === 0) return null;
  const lock = store.lockForTransfer(namespace, hashes, requester);
  if (!lock) return null;
  const found = lock.found.length;
  const per = layout.layers * rankSlots(layout) * layout.segments;
  // Asked index → found index (the lock's table is column-major over the
  // found blocks; a block's offsets in payload order are its column walk,
  // lib/storage/offsets.ts), turned into flat ranges once.
  const at = new Int32Array(hashes.length).fill(-1);
  for (let i = 0; i < found; i++) at[lock.found[i]] = i;
  const w = new BlockRangesWriter(hashes.length, found * per);
  for (let a = 0; a < hashes.length; a++) {
    if (at[a] < 0) w.addEmpty();
    else w.addBlock(lock.offsets, at[a], found, per, lock.segmentBytes);
  }
  const ranges = w.finish();
  const payloadBytes = per * lock.segmentBytes;
  const blocks: (RamExtents | undefined)[] = new Array(hashes.length).fill(undefined);
  for (let i = 0; i < found; i++) {
    const a = lock.found[i];
    const crc = lock.checksums[i];
    // Objects per range only for a caller that reads them (the SSD write, a
    // lock-time checksum); a lock answer packs `ranges` directly.
    blocks[a] = {
      get extents() {
        return blockExtents(ranges, a);
      },
      payloadBytes,
      checksum: crc === NO_CHECKSUM ? undefined : crc,
    };
  }
  let released = false;
  return {
    blocks,
    ranges,
    release: () => {
      if (released) return;
      released = true;
      try {
        store.releaseTransferLock(lock.id);
      } catch (e) {
        // Released once here, so "unknown" means the lock outlived its TTL and the
        // store's collector already unpinned its blocks: nothing is left to release.
        if (!(e instanceof LeaseError && e.reason === "unknown-or-expired")) throw e;
      }
    },
  };
}
