/**
 * The SSD tier as the KV engine sees it: two calls, on the existing store
 * API only (no change to lib/storage).
 *
 *  - {@link SsdKvBridge.onSealed}: after `store.completeSave` sealed blocks,
 *    offer them for write-behind. When a write starts, the block is pinned
 *    with a transfer lock (so eviction cannot free it mid-write) and its
 *    slots are read in the store's slot order — `(layer × rankSlots +
 *    rankSlot) × segments + segment` — which is the record's payload order.
 *    A block evicted before that is skipped.
 *  - {@link SsdKvBridge.beforeQuery}: in QueryPrefetch, before
 *    `store.query`: if the prefix continues past RAM on SSD (or is being
 *    read for another request, or a prefetch for this request id exists),
 *    start/join/poll the prefetch. Pool space for a fetched block is
 *    planned like a save (`beginSave` for each rank slot, one plan per block
 *    so a block that fails verification frees exactly its own slots); the
 *    tier commits a verified block the moment it lands (`completeSave`
 *    seals it into RAM), so every later `store.query` hits it.
 *  - Every block is written and read under its namespace's layout identity
 *    (`blockLayoutIdentity`, lib/storage/layout.ts): a record written by
 *    another layout of the namespace is never read into this one.
 *
 * @module
 */

import { rankSlots } from "../storage/block.ts";
import type { BlockHash } from "../storage/keys.ts";
import { blockKey } from "../storage/keys.ts";
import type { KvStore, SavePlan } from "../storage/store.ts";
import { blockLayoutIdentity, type LayoutIdentity } from "../storage/layout.ts";
import type { PoolExtent } from "./io.ts";
import type { PrefetchAllocation, SsdTier, SsdWriteBlock, StoredLayout } from "./tier.ts";
import type { Logger } from "../log.ts";

/** Requester name of the tier's transfer locks (shows in store diagnostics). */
export const SSD_WRITER = "ssd-write-behind";

/** Splits a store key `namespace:hex` into its parts. */
function splitKey(key: string): { namespace: string; hex: string } {
  const i = key.lastIndexOf(":");
  if (i <= 0) throw new RangeError(`"${key}" is not a block key (namespace:hash)`);
  return { namespace: key.slice(0, i), hex: key.slice(i + 1) };
}

/** Merges extents that follow each other in the pool (fewer iovecs per record). */
export function mergeExtents(offsets: ArrayLike<number>, bytes: number): PoolExtent[] {
  const out: PoolExtent[] = [];
  for (let j = 0; j < offsets.length; j++) {
    const off = offsets[j];
    const last = out[out.length - 1];
    if (last && last.offset + last.bytes === off) last.bytes += bytes;
    else out.push({ offset: off, bytes });
  }
  return out;
}

/**
 * Connects an {@link SsdTier} to a {@link KvStore}.
 *
 * @example
 * ```ts
 * const bridge = new SsdKvBridge(tier, store, log);
 * // after completeSave: bridge.onSealed(namespace, completion.sealedKeys);
 * // in QueryPrefetch:   if (bridge.beforeQuery(ns, inst, hashes, reqId)) answer "loading";
 * ```
 */
export class SsdKvBridge {
  constructor(
    readonly tier: SsdTier,
    readonly store: KvStore,
    readonly log: Logger,
  ) {}

  /** Offers freshly sealed blocks for write-behind; never waits. */
  onSealed(sealedKeys: readonly string[]): void {
    if (sealedKeys.length === 0) return;
    const blocks: SsdWriteBlock[] = [];
    // One namespace per batch in practice: its identity is looked up once, not per block.
    let ns = "";
    let identity: LayoutIdentity | undefined;
    for (const key of sealedKeys) {
      const { namespace, hex } = splitKey(key);
      if (namespace !== ns || !identity) {
        const layout = this.store.layoutOf(namespace);
        if (!layout) continue; // sealed blocks always have a namespace; nothing to write otherwise
        ns = namespace;
        identity = blockLayoutIdentity(layout);
      }
      let lockId: string | undefined;
      blocks.push({
        key,
        namespace,
        layout: identity,
        acquire: () => {
          const lock = this.store.lockForTransfer(namespace, [hex], SSD_WRITER);
          if (!lock) return null; // evicted since it was sealed
          lockId = lock.id;
          return mergeExtents(lock.offsets, lock.segmentBytes);
        },
        release: () => {
          if (lockId !== undefined) this.store.releaseTransferLock(lockId);
          lockId = undefined;
        },
      });
    }
    this.tier.enqueueWrite(blocks);
  }

  /** The layouts `namespace`'s blocks on SSD were written with (checked at registration). */
  storedLayouts(namespace: string): StoredLayout[] {
    return this.tier.storedLayouts(namespace);
  }

  /**
   * Returns true when the caller must answer "loading" (a prefetch for
   * `requestId` is running). Otherwise any finished prefetch was committed
   * into RAM and `store.query` gives the answer.
   */
  beforeQuery(
    namespace: string,
    instance: string,
    hashes: readonly BlockHash[],
    requestId: string,
  ): boolean {
    const layout = this.store.layoutOf(namespace);
    if (!layout) return false;
    let ram = 0;
    while (ram < hashes.length && this.store.blockState(namespace, hashes[ram]) === "sealed") ram++;
    const pending = this.tier.hasPrefetch(requestId);
    if (ram === hashes.length && !pending) return false;
    const keys = hashes.slice(ram).map((h) => blockKey(namespace, h));
    const slots = layout.layers * rankSlots(layout) * layout.segments;
    const blockBytes = slots * layout.segmentBytes;
    const identity = blockLayoutIdentity(layout);
    const a = this.tier.prefetch(requestId, keys, (wanted) => {
      const out: PrefetchAllocation[] = [];
      for (const w of wanted) {
        if (w.payloadBytes !== blockBytes) {
          // The layout fingerprint matched, so this is a damaged index entry: never read it.
          this.log.warn("SSD block size differs from its namespace's blocks: not fetched", {
            block: w.key,
            namespace,
            bytes: w.payloadBytes,
            expected_bytes: blockBytes,
          });
          break;
        }
        const alloc = this.#plan(
          namespace,
          instance,
          w.key,
          rankSlots(layout),
          slots,
          layout.segments,
        );
        if (!alloc) break;
        out.push(alloc);
      }
      return out;
    }, identity.fingerprint);
    return a.state === "loading";
  }

  /** Plans RAM slots for one block read from SSD; null when it cannot be placed now. */
  #plan(
    namespace: string,
    instance: string,
    key: string,
    ranks: number,
    slots: number,
    segments: number,
  ): PrefetchAllocation | null {
    const { hex } = splitKey(key);
    const plans: SavePlan[] = [];
    const abort = () => {
      for (const p of plans) this.store.completeSave(p, false);
      return null;
    };
    const offsets = new Float64Array(slots);
    for (let r = 0; r < ranks; r++) {
      const begun = this.store.beginSave({ namespace, instance, rank: r, hashes: [hex] });
      if (!begun.ok) return abort();
      const p = begun.plan;
      plans.push(p);
      // Another save holds or writes some of these slots: leave the block to it.
      if (p.blockCount !== 1 || p.refusedForRoom > 0) return abort();
      for (let li = 0; li < p.layers.length; li++) {
        for (let s = 0; s < segments; s++) {
          const off = p.offsets[li * segments + s];
          if (off < 0) return abort();
          offsets[(p.layers[li] * ranks + p.rankSlot) * segments + s] = off;
        }
      }
    }
    let settled = false;
    const settle = (ok: boolean) => {
      if (settled) return;
      settled = true;
      for (const p of plans) this.store.completeSave(p, ok);
    };
    return {
      extents: mergeExtents(offsets, plans[0].segmentBytes),
      free: () => settle(false),
      commit: () => settle(true),
    };
  }
}
