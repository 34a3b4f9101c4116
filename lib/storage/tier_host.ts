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

import { mergeExtents, type PoolExtent } from "../transfer/ranges.ts";
import { NO_CHECKSUM, rankSlots } from "./block.ts";
import { LeaseError } from "./errors.ts";
import { offsetIndex, type OffsetTable } from "./offsets.ts";
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
  const own = new Float64Array(items);
  const blocks: { extents: PoolExtent[]; payloadBytes: number }[] = [];
  for (let k = 0; k < n && p.hashIndex[k] === k; k++) {
    let whole = true;
    for (let col = 0; whole && col < items; col++) whole = p.offsets[col * n + k] >= 0;
    if (!whole) break;
    for (let col = 0; col < items; col++) own[col] = p.offsets[col * n + k];
    blocks.push({
      extents: mergeExtents(own, p.segmentBytes),
      payloadBytes: items * p.segmentBytes,
    });
  }
  const m = blocks.length;
  if (m === 0) {
    store.completeSave(p, false);
    return null;
  }
  let settled = false;
  return {
    blocks,
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
  const rs = rankSlots(layout);
  const per = layout.layers * rs * layout.segments;
  const table: OffsetTable = {
    offsets: lock.offsets,
    blockCount: found,
    segments: layout.segments,
  };
  // One block's offsets in payload order, gathered out of the column-major
  // table; reused for every block of the batch.
  const own = new Float64Array(per);
  const blocks: (RamExtents | undefined)[] = new Array(hashes.length).fill(undefined);
  for (let i = 0; i < found; i++) {
    let j = 0;
    for (let layer = 0; layer < layout.layers; layer++) {
      for (let r = 0; r < rs; r++) {
        for (let seg = 0; seg < layout.segments; seg++) {
          own[j++] = lock.offsets[offsetIndex(table, layer, r, seg, i, rs)];
        }
      }
    }
    const crc = lock.checksums[i];
    blocks[lock.found[i]] = {
      extents: mergeExtents(own, lock.segmentBytes),
      payloadBytes: per * lock.segmentBytes,
      checksum: crc === NO_CHECKSUM ? undefined : crc,
    };
  }
  let released = false;
  return {
    blocks,
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
