/**
 * The first steps of save planning (lib/storage/save_plan.ts): which of a
 * request's hashes still need bytes, and how many of them the pool takes.
 *
 * - **dedup**: hashes already sealed, slots already PENDING or FILLED, and a
 *   hash named twice are skipped before any byte moves; a hash skipped only
 *   because another copy is writing its slots (PENDING) is a rider: that
 *   copy may still fail, so the caller learns which (`riders`); a hash a
 *   discard named within its TTL (lib/storage/discard.ts) is refused;
 * - **fitRoom**: keep the longest prefix that free + evictable bytes hold;
 * - **admit**: only when eviction is needed, TinyLFU turns away new blocks
 *   less popular than the LRU victim.
 *
 * The candidates are one flat need map; no per-block arrays.
 *
 * @module
 */

import { type Block, type CacheClass, SLOT_EMPTY, SLOT_PENDING } from "./block.ts";
import { type BlockHash, hashBucket, hashHex, sameHash } from "./keys.ts";
import type { NamespaceState } from "./namespaces.ts";
import type { StoreState } from "./state.ts";
import { Tombstones } from "./discard.ts";

/** What one plan is for: its namespace, writer and slot columns. */
export interface PlanTarget {
  readonly ns: NamespaceState;
  readonly namespace: string;
  readonly instance: string;
  /** The saving rank, or -1 for a fill. */
  readonly rank: number;
  readonly layers: number[];
  readonly rankSlotList: number[];
  /** Column (li * R + ri) → slot index within a block. */
  readonly colSlot: Int32Array;
  readonly cacheClass: CacheClass;
  /** Preferred pool part (NUMA node), or undefined for any. */
  readonly part?: number;
  /** A second pass over hashes this request already named (its riders): no access is counted again. */
  readonly again?: boolean;
}

/**
 * The hashes that still need bytes after dedup, packed in request order
 * (`need[k * C + c]`: block k needs column c). The admission step compacts
 * them in place.
 */
export interface Candidates {
  readonly need: Uint8Array;
  readonly needCount: Int32Array;
  readonly hashIndex: number[];
  readonly buckets: number[];
  readonly hexes: string[];
  readonly existing: (Block | undefined)[];
  readonly deduplicated: number;
  /**
   * Request indexes of the deduplicated hashes that lacked slots only another copy
   * was writing (PENDING, none FILLED or sealed yet): they land only if that copy does.
   */
  readonly riders: number[];
  /** Hashes refused because a discard named them within its TTL (or their block is discarded). */
  readonly discarded: number;
}

/** Step 1: which (block, column) slots still need bytes. One flat need map, no per-block arrays. */
export function dedup(st: StoreState, t: PlanTarget, hashes: readonly BlockHash[]): Candidates {
  const C = t.colSlot.length;
  const need = new Uint8Array(hashes.length * C);
  const needCount = new Int32Array(hashes.length);
  const hashIndex: number[] = [];
  const buckets: number[] = [];
  const hexes: string[] = [];
  const existing: (Block | undefined)[] = [];
  let deduplicated = 0;
  let discarded = 0;
  const riders: number[] = [];
  // Discarded hashes of this namespace, if any: one size check when there are none.
  const tombs = st.tombstones.size > 0 ? st.tombstones.live(t.namespace, st.clock()) : undefined;
  // A hash named twice in one request is planned once. New hashes are told
  // apart by bucket first (a number), bytes only on a bucket match: no string
  // is hashed per block.
  const seenBlocks = new Set<Block>();
  const seenNew = new Map<number, number>(); // bucket → last request index planned with it
  const sameBucket = new Int32Array(hashes.length); // request index → previous one in its bucket
  // Every hash is validated (hashBucket throws on a malformed one) before any counts as an
  // access or touches the LRU: a refused request changes nothing.
  const bucketOf = new Int32Array(hashes.length);
  for (let i = 0; i < hashes.length; i++) bucketOf[i] = hashBucket(hashes[i], t.ns.seed);
  for (let i = 0; i < hashes.length; i++) {
    const bucket = bucketOf[i];
    if (!t.again) st.lfu?.record(bucket);
    const b = st.index.find(t.namespace, hashes[i], bucket);
    if (b?.discarded || (tombs !== undefined && Tombstones.holds(tombs, hashes[i], bucket))) {
      discarded++;
      continue;
    }
    let hex: string;
    if (b) {
      if (b.state === "sealed" || seenBlocks.has(b)) {
        // Saving a held block again is an access: keep it from being this save's victim.
        if (b.state === "sealed") st.lru.touch(b);
        deduplicated++;
        continue;
      }
      seenBlocks.add(b);
      hex = b.hash;
    } else {
      const head = seenNew.get(bucket) ?? -1;
      let j = head;
      while (j >= 0 && !sameHash(hashes[j], hashes[i])) j = sameBucket[j];
      if (j >= 0) {
        deduplicated++;
        continue;
      }
      sameBucket[i] = head;
      seenNew.set(bucket, i);
      hex = hashHex(hashes[i]);
    }
    const k = hexes.length;
    const n = markNeeded(need, k, t.colSlot, b);
    if (n === 0) {
      deduplicated++;
      if (anyPending(b!, t.colSlot)) riders.push(i);
      continue;
    }
    needCount[k] = n;
    hashIndex.push(i);
    buckets.push(bucket);
    hexes.push(hex);
    existing.push(b);
  }
  return { need, needCount, hashIndex, buckets, hexes, existing, deduplicated, riders, discarded };
}

/**
 * Marks the columns of candidate `k` whose slot in `b` is EMPTY (every column
 * of a new block) in `need`; returns how many.
 */
function markNeeded(
  need: Uint8Array,
  k: number,
  colSlot: Int32Array,
  b: Block | undefined,
): number {
  const C = colSlot.length;
  let n = 0;
  for (let c = 0; c < C; c++) {
    if (b !== undefined && b.slots[colSlot[c]] !== SLOT_EMPTY) continue;
    need[k * C + c] = 1;
    n++;
  }
  return n;
}

/** True when a copy is writing one of `b`'s slots under these columns (PENDING). */
function anyPending(b: Block, colSlot: Int32Array): boolean {
  for (let c = 0; c < colSlot.length; c++) if (b.slots[colSlot[c]] === SLOT_PENDING) return true;
  return false;
}

/** Step 2: the longest prefix of the candidates that free + evictable bytes can hold. */
export function fitRoom(st: StoreState, cand: Candidates, slotBytes: number) {
  const n = cand.hexes.length;
  let total = 0;
  for (let k = 0; k < n; k++) total += cand.needCount[k] * slotBytes;
  let count = n;
  const room = st.allocator.freeBytes + st.lru.evictableBytes;
  while (count > 0 && total > room) total -= cand.needCount[--count] * slotBytes;
  const firstBytes = n > 0 ? cand.needCount[0] * slotBytes : 0;
  return { count, total, refusedForRoom: n - count, firstBytes };
}

/**
 * Step 3 (only when eviction is needed): new blocks must beat the LRU victim
 * under TinyLFU. Compacts the first `count` candidates in place.
 */
export function admit(
  st: StoreState,
  t: PlanTarget,
  cand: Candidates,
  count: number,
  total: number,
  slotBytes: number,
): { count: number; total: number; admissionRejected: number } {
  const lfu = st.lfu;
  if (!lfu || total <= st.allocator.freeBytes) return { count, total, admissionRejected: 0 };
  const victim = st.lru.victim();
  if (!victim) return { count, total, admissionRejected: 0 };
  const C = t.colSlot.length;
  const { need, needCount, hashIndex, buckets, hexes, existing } = cand;
  let rejected = 0;
  let w = 0;
  total = 0;
  for (let k = 0; k < count; k++) {
    if (existing[k] === undefined && !lfu.admit(buckets[k], victim.bucket)) {
      rejected++;
      continue;
    }
    if (w !== k) {
      hashIndex[w] = hashIndex[k];
      buckets[w] = buckets[k];
      hexes[w] = hexes[k];
      existing[w] = existing[k];
      needCount[w] = needCount[k];
      need.copyWithin(w * C, k * C, (k + 1) * C);
    }
    total += needCount[w] * slotBytes;
    w++;
  }
  return { count: w, total, admissionRejected: rejected };
}
