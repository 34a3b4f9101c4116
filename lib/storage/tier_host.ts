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
 *    column-major over the found blocks; it is turned into each block's
 *    payload-order ranges here, once).
 *
 * @module
 */

import { rankSlots } from "./block.ts";
import { LeaseError } from "./errors.ts";
import type { KvStore } from "./store.ts";
import type { FillClass, PoolExtent, RamExtents, RamFill, RamPin, TierHost } from "./tier.ts";

/**
 * Pool ranges of `count` items of `bytes`, item `j` at
 * `offsets[start + j * stride]`, items that continue each other merged
 * (fewer iovecs per record). The items lie back to back in the tier's copy.
 */
function extentsOf(
  offsets: ArrayLike<number>,
  bytes: number,
  start = 0,
  count = offsets.length,
  stride = 1,
): PoolExtent[] {
  const out: PoolExtent[] = [];
  for (let j = 0; j < count; j++) {
    const off = offsets[start + j * stride];
    const last = out[out.length - 1];
    if (last && last.offset + last.bytes === off) last.bytes += bytes;
    else out.push({ offset: off, bytes });
  }
  return out;
}

/**
 * A {@link TierHost} over `store`.
 *
 * @example
 * ```ts
 * const host = storeTierHost(store);
 * const tier = new SsdStorageTier(ssd, host);
 * ```
 */
export function storeTierHost(store: KvStore): TierHost {
  return {
    fill(namespace, hash, filler, cacheClass: FillClass): RamFill | null {
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
      // One block, layers and rank slots in order: the plan's column order is payload order.
      let settled = false;
      const settle = (ok: boolean) => {
        if (settled) throw new Error(`fill of block in namespace ${namespace} settled twice`);
        settled = true;
        store.completeSave(p, ok);
      };
      return {
        extents: extentsOf(p.offsets, p.segmentBytes),
        payloadBytes: items * p.segmentBytes,
        commit: () => settle(true),
        abort: () => settle(false),
      };
    },

    payloadBytes(namespace) {
      const l = store.layoutOf(namespace);
      return l ? l.layers * rankSlots(l) * l.segments * l.segmentBytes : undefined;
    },

    pin(namespace, hashes, requester): RamPin | null {
      const layout = store.layoutOf(namespace);
      if (!layout || hashes.length === 0) return null;
      const lock = store.lockForTransfer(namespace, hashes, requester);
      if (!lock) return null;
      const found = lock.found.length;
      const per = layout.layers * rankSlots(layout) * layout.segments;
      const blocks: (RamExtents | undefined)[] = new Array(hashes.length).fill(undefined);
      for (let i = 0; i < found; i++) {
        // Lock table: offsets[column * found + i], column in payload order.
        blocks[lock.found[i]] = {
          extents: extentsOf(lock.offsets, lock.segmentBytes, i, per, found),
          payloadBytes: per * lock.segmentBytes,
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
    },
  };
}
