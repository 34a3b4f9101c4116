/**
 * Discards: a rank whose load failed names the hashes of the blocks it
 * computed over that load (`SaveRequest.discard_hashes`). With TP (or PP)
 * the other ranks computed theirs from the same garbage (all-reduce, stage
 * hand-off) and may have saved it: their slots sit in an inflight block that
 * a later correct save of the prefix would complete (dedup skips filled
 * slots) and seal with the bad ones. So, in the rank's namespace:
 *
 * - an inflight block of such a hash is dropped: every filled slot is freed;
 *   a copy still running into it (PENDING slots) marks it `discarded`, its
 *   completion then fails and frees it (lib/storage/seal.ts), and no save
 *   or fill plans into it meanwhile;
 * - a sealed, unpinned block is evicted (it may hold another rank's slot
 *   computed over the garbage, e.g. MLA's one shared slot; losing it costs a
 *   recompute); a sealed, pinned one (leased, loading, transfer-locked) keeps
 *   its bytes for those readers but is marked `discarded` (counted): no
 *   query, lock or save finds it, and its last unpin evicts it
 *   (lib/storage/state.ts);
 * - a tombstone keeps saves and fills of the hash from being admitted for
 *   {@link DISCARD_TTL_MS}: another rank's save of the same step may still be
 *   on its way, and would otherwise refill the freed slot.
 *
 * Tombstones are found like blocks, by (namespace, hash bucket) with chains;
 * at most {@link MAX_DISCARD_TOMBSTONES} are kept (past it the oldest of the
 * namespace holding the most go), swept lazily from the oldest end. A save
 * with no tombstone in the store pays one size check, nothing per block.
 *
 * @module
 */

import type { Block } from "./block.ts";
import { dropInflight, evictSealed, freeFilledSlots } from "./eviction.ts";
import { type BlockHash, hashBucket, sameHash } from "./keys.ts";
import { checkRequest, type StoreState } from "./state.ts";

/**
 * How long a discarded hash refuses saves. The saves it must stop are the
 * other ranks' of the same engine step, sent by their workers' save threads
 * no later than their Save deadline after the step (30 s by default,
 * `PEGAFLOW_SAVE_TIMEOUT_MS`); twice that covers a save queued behind a slow
 * one. Longer only delays re-caching the prefix (the engine recomputes it).
 */
export const DISCARD_TTL_MS = 60_000;

/**
 * Most tombstones kept (one maximal Save's worth of hashes): past it the
 * oldest go, so an engine discarding without end cannot grow the server's
 * memory (~150 bytes each, ~10 MiB at the bound).
 */
export const MAX_DISCARD_TOMBSTONES = 65_536;

/** One discard of one rank (see {@link KvStore.discard}). */
export interface DiscardRequest {
  namespace: string;
  instance: string;
  /** TP rank of the discarding worker (for errors and logs). */
  rank: number;
  hashes: readonly BlockHash[];
}

/** What a discard did. */
export interface DiscardResult {
  /** Inflight blocks dropped (freed now, or when the copy still running into them ends). */
  readonly dropped: number;
  /** Of those, blocks a copy was still running into (freed at its completion). */
  readonly copiesCut: number;
  /** Sealed, unpinned blocks evicted. */
  readonly evicted: number;
  /** Sealed blocks a lease, load or transfer lock pins: doomed (never served again), evicted at their last unpin. */
  readonly pinnedKept: number;
  /** Tombstones held after this discard (all namespaces). */
  readonly tombstones: number;
}

/** A discarded hash of one namespace, until it expires. */
interface Tombstone {
  readonly namespace: string;
  readonly bucket: number;
  /** The hash as sent (bytes copied: the request's buffer is not kept alive). */
  readonly hash: BlockHash;
  expiresAt: number;
  /** Next tombstone of the same bucket. */
  chainNext: Tombstone | null;
}

/** One namespace's tombstones: found by hash bucket (chains), and oldest first. */
interface NamespaceTombstones {
  readonly buckets: Map<number, Tombstone>;
  readonly order: Set<Tombstone>;
}

/** The tombstones of every namespace, oldest first. */
export class Tombstones {
  readonly #byNamespace = new Map<string, NamespaceTombstones>();
  /** Insertion order = expiry order (one TTL, a monotonic clock; a refresh moves to the end). */
  readonly #order = new Set<Tombstone>();

  constructor(readonly ttlMs = DISCARD_TTL_MS, readonly max = MAX_DISCARD_TOMBSTONES) {}

  get size(): number {
    return this.#order.size;
  }

  /** Buckets of `namespace` after sweeping what expired by `now`; undefined when none. */
  live(namespace: string, now: number): ReadonlyMap<number, Tombstone> | undefined {
    this.sweep(now);
    return this.#byNamespace.get(namespace)?.buckets;
  }

  /** True when `buckets` (from {@link live}) hold a tombstone of `hash`. */
  static holds(
    buckets: ReadonlyMap<number, Tombstone>,
    hash: BlockHash,
    bucket: number,
  ): boolean {
    for (let t = buckets.get(bucket); t; t = t.chainNext ?? undefined) {
      if (sameHash(t.hash, hash)) return true;
    }
    return false;
  }

  /**
   * Adds (or refreshes) the tombstone of `hash`. Past {@link max}, the oldest
   * of the namespace holding the most go: one namespace discarding without
   * end recycles its own, never another's still within their TTL.
   */
  add(namespace: string, hash: BlockHash, bucket: number, now: number): void {
    const held = this.#byNamespace.get(namespace);
    for (let t = held?.buckets.get(bucket); t; t = t.chainNext ?? undefined) {
      if (!sameHash(t.hash, hash)) continue;
      t.expiresAt = now + this.ttlMs;
      this.#order.delete(t);
      this.#order.add(t);
      held!.order.delete(t);
      held!.order.add(t);
      return;
    }
    while (this.#order.size >= this.max) this.#remove(this.#victim());
    // Looked up again: the eviction may have taken this namespace's last tombstone.
    let ns = this.#byNamespace.get(namespace);
    if (!ns) this.#byNamespace.set(namespace, ns = { buckets: new Map(), order: new Set() });
    const t: Tombstone = {
      namespace,
      bucket,
      hash: typeof hash === "string" ? hash : hash.slice(),
      expiresAt: now + this.ttlMs,
      chainNext: ns.buckets.get(bucket) ?? null,
    };
    ns.buckets.set(bucket, t);
    ns.order.add(t);
    this.#order.add(t);
  }

  /** Drops every tombstone expired by `now` (from the oldest end: O(expired)). */
  sweep(now: number): void {
    for (const t of this.#order) {
      if (t.expiresAt > now) return;
      this.#remove(t);
    }
  }

  /** The oldest tombstone of the namespace holding the most (O(namespaces); only at the bound). */
  #victim(): Tombstone {
    let most: NamespaceTombstones | undefined;
    for (const ns of this.#byNamespace.values()) {
      if (!most || ns.order.size > most.order.size) most = ns;
    }
    return most!.order.values().next().value!;
  }

  #remove(t: Tombstone): void {
    this.#order.delete(t);
    const ns = this.#byNamespace.get(t.namespace)!;
    ns.order.delete(t);
    const m = ns.buckets;
    let prev: Tombstone | null = null;
    for (let x = m.get(t.bucket) ?? null; x; prev = x, x = x.chainNext) {
      if (x !== t) continue;
      if (prev) prev.chainNext = t.chainNext;
      else if (t.chainNext) m.set(t.bucket, t.chainNext);
      else m.delete(t.bucket);
      break;
    }
    if (ns.order.size === 0) this.#byNamespace.delete(t.namespace);
  }
}

/**
 * Applies one discard (see the module doc). Every hash is validated before
 * anything changes; the tombstones are laid before any block is touched, so
 * an `onEvict` that throws leaves the rest of the hashes refused all the same.
 */
export function discardHashes(st: StoreState, req: DiscardRequest): DiscardResult {
  const { namespace, instance, rank, hashes } = req;
  const ns = st.namespaces.require(namespace, instance);
  checkRequest(hashes.length, { namespace, instance, rank });
  const buckets = new Int32Array(hashes.length);
  for (let i = 0; i < hashes.length; i++) buckets[i] = hashBucket(hashes[i], ns.seed);
  const now = st.clock();
  st.tombstones.sweep(now);
  for (let i = 0; i < hashes.length; i++) st.tombstones.add(namespace, hashes[i], buckets[i], now);
  let dropped = 0;
  let copiesCut = 0;
  let evicted = 0;
  let pinnedKept = 0;
  try {
    for (let i = 0; i < hashes.length; i++) {
      const b = st.index.find(namespace, hashes[i], buckets[i]);
      if (!b || b.discarded) continue;
      if (b.state === "sealed") {
        if (b.pins > 0) {
          // Its readers keep its bytes; nothing new finds it, and the last unpin evicts it.
          pinnedKept++;
          b.discarded = true;
        } else {
          evicted++;
          evictSealed(st, b);
        }
        continue;
      }
      dropped++;
      if (dropDiscarded(st, b)) copiesCut++;
    }
  } finally {
    st.c.discardedBlocks += dropped + evicted;
    st.c.discardPinnedKept += pinnedKept;
  }
  return { dropped, copiesCut, evicted, pinnedKept, tombstones: st.tombstones.size };
}

/**
 * An inflight block of a discarded hash: freed now when no copy runs into it;
 * else its filled slots are freed and it is marked, so the running copies'
 * completions fail and free it (true then).
 */
function dropDiscarded(st: StoreState, b: Block): boolean {
  if (b.pending === 0) {
    dropInflight(st, b);
    return false;
  }
  freeFilledSlots(st, b);
  b.discarded = true;
  return true;
}
