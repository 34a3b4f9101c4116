/**
 * The storage facade the KV server drives: which bytes of the pinned pool
 * hold which block, what a query hits, what a save must copy and where, what
 * a load reads. Pure policy — it never copies a byte; lib/transfer turns the
 * offsets it returns into one native gather/scatter batch.
 *
 * The facade owns the state (state.ts) and delegates each job to the module
 * named for it:
 *
 * | job                                   | module             |
 * | ------------------------------------- | ------------------ |
 * | namespace registry (layout per name)  | namespaces.ts      |
 * | lookup: query prefix, block state     | lookup.ts          |
 * | save planning (dedup → … → blocks)    | save_plan.ts       |
 * | save candidates (dedup, room, admit)  | save_candidates.ts |
 * | discards and their tombstones         | discard.ts         |
 * | sealing (complete a save or fill)     | seal.ts            |
 * | load tickets (lease consumption)      | load_ticket.ts     |
 * | transfer locks                        | transfer_lock.ts   |
 * | TTL collection, instance cleanup      | cleanup.ts         |
 * | run-merged eviction, inflight drops   | eviction.ts        |
 * | invariant checker                     | invariants.ts      |
 * | offset index formula and accessor     | offsets.ts         |
 *
 * All methods are synchronous (single-threaded JS; the native copy runs in
 * between `beginSave` and `completeSave`, or `consumeLease` and `loadDone`).
 * Per-block work is O(1) map/list operations plus O(layers × segments)
 * for the offsets; pool allocation is per (layer, segment) per save, never
 * per block; block records are recycled, so a full pool's save/evict churn
 * allocates no per-block records.
 *
 * Invariants (pinned down by tests/storage/, checked by {@link KvStore.verify}):
 * - a block is served (query, lease, load) only when sealed;
 * - a block under a lease, an in-flight load or a transfer lock, and a slot
 *   under an in-flight save copy, is never freed or evicted;
 * - every pool byte is either free or owned by exactly one slot item:
 *   dropping everything returns free bytes to capacity;
 * - a save that cannot be placed is refused with a {@link PoolExhaustedError}
 *   result, never partly written into someone else's bytes.
 *
 * @module
 */

import type { PoolAllocator } from "./allocator.ts";
import type { BlockLayout } from "./block.ts";
import type { BlockHash } from "./keys.ts";
import type { LeaseId } from "./lease.ts";
import { collectExpired, dropInstanceState } from "./cleanup.ts";
import { discardHashes, type DiscardRequest, type DiscardResult } from "./discard.ts";
import { evictBytes } from "./eviction.ts";
import { verifyStore } from "./invariants.ts";
import {
  type ConsumeOptions,
  consumeTicket,
  finishTicket,
  type LoadTicket,
} from "./load_ticket.ts";
import { blockState, queryPrefix, type QueryResult } from "./lookup.ts";
import { completePlan, type SaveCompletion } from "./seal.ts";
import {
  type FillRequest,
  planFill,
  planSave,
  type SaveBegin,
  type SavePlan,
  type SaveRequest,
} from "./save_plan.ts";
import { type KvStoreOptions, type StoreCounters, StoreState } from "./state.ts";
import {
  lockBlocks,
  recordBlockChecksums,
  type TransferLock,
  unlockBlocks,
} from "./transfer_lock.ts";

// The store's public types, re-exported so callers keep one import for the facade.
export type { BlockLayout } from "./block.ts";
export type { ConsumeOptions, LoadTicket } from "./load_ticket.ts";
export type { QueryResult } from "./lookup.ts";
export type { SaveCompletion } from "./seal.ts";
export type { DiscardRequest, DiscardResult } from "./discard.ts";
export { DISCARD_TTL_MS, MAX_DISCARD_TOMBSTONES } from "./discard.ts";
export type { FillRequest, SaveBegin, SavePlan, SaveRequest } from "./save_plan.ts";
export type { KvStoreOptions } from "./state.ts";
export type { TransferLock } from "./transfer_lock.ts";
export { DEFAULT_INFLIGHT_TTL_MS, MAX_HASHES_PER_REQUEST } from "./state.ts";
export { SPARE_BLOCK_RECORDS } from "./namespaces.ts";

/** Counters (the monotonic ones are `StoreCounters`, state.ts) and gauges for /metrics. */
export interface StoreStats extends StoreCounters {
  capacityBytes: number;
  usedBytes: number;
  freeBytes: number;
  evictableBytes: number;
  /** Bytes reserved for copies in flight (saves not yet completed). */
  inflightCopyBytes: number;
  largestFreeBytes: number;
  freeExtents: number;
  /** Allocated bytes per pool part (NUMA node, lib/numa.ts); one entry when unsplit. */
  partUsedBytes: number[];
  sealedBlocks: number;
  inflightBlocks: number;
  pinnedBlocks: number;
  admissionRejections: number;
  leasesActive: number;
  transferLocksActive: number;
  loadsInflight: number;
  /** Discarded hashes still refusing saves (at most `MAX_DISCARD_TOMBSTONES`). */
  discardTombstones: number;
}

/**
 * The storage engine's policy core.
 *
 * @example
 * ```ts
 * const store = new KvStore({ capacityBytes: 30 * 2 ** 30 });
 * store.defineNamespace(ns, { layers: 32, tpSize: 1, collapseTp: false, segments: 2, segmentBytes: 32768 });
 * const b = store.beginSave({ namespace: ns, instance: "e1", rank: 0, hashes });
 * if (!b.ok) return status(b.error.code, b.error.message);
 * await gather(b.plan);                    // native batch copy into pool + offsets
 * store.completeSave(b.plan, copyOk);      // seals complete blocks
 * const q = store.query(ns, hashes, "e1"); // { hits, lease }
 * const t = store.consumeLease(q.lease!.id, "e1", 0);
 * await scatter(t); store.loadDone(t);
 * ```
 */
export class KvStore {
  readonly #st: StoreState;

  constructor(opts: KvStoreOptions) {
    this.#st = new StoreState(opts);
  }

  /** The pool allocator (read-only use: sizes and free extents for diagnostics). */
  get allocator(): PoolAllocator {
    return this.#st.allocator;
  }

  /**
   * Declares the block geometry of a namespace (at the first registration of
   * an engine using it). Idempotent for the same layout; a different layout
   * under the same namespace throws {@link LayoutMismatchError}.
   */
  defineNamespace(namespace: string, layout: BlockLayout): void {
    this.#st.namespaces.define(namespace, layout);
  }

  /** The layout of a defined namespace, or undefined. */
  layoutOf(namespace: string): BlockLayout | undefined {
    const s = this.#st.namespaces.get(namespace);
    return s ? { ...s.layout } : undefined;
  }

  /**
   * Longest prefix of `hashes` held sealed. A hit pins those blocks under a
   * lease bound to `instance` that each of `worldSize` ranks consumes once.
   * Unknown namespace → 0 hits (nothing was ever saved there).
   */
  query(
    namespace: string,
    hashes: readonly BlockHash[],
    instance: string,
    worldSize = 1,
  ): QueryResult {
    this.collect();
    return queryPrefix(this.#st, namespace, hashes, instance, worldSize);
  }

  /**
   * Plans a save: drops hashes (and slots) already held or in flight, applies
   * admission, allocates pool space per (layer, segment) for all blocks at
   * once — evicting LRU blocks as needed — and marks the slots in flight.
   * When not even the first block fits after evicting everything evictable,
   * returns `{ok: false, error}` (RESOURCE_EXHAUSTED); when only a prefix
   * fits, the plan covers that prefix and counts the rest in `refusedForRoom`.
   * Every `ok` plan must be passed to {@link completeSave} exactly once.
   */
  beginSave(req: SaveRequest): SaveBegin {
    this.collect();
    return planSave(this.#st, req);
  }

  /**
   * Plans a whole-block fill (SSD prefetch into RAM, peer fetch): every layer
   * and every rank slot of each block not already held. Same contract as
   * {@link beginSave}; the blocks seal at {@link completeSave}. The tiers
   * call it through lib/storage/tier_host.ts (SSD prefetch, peer fetch).
   */
  beginFill(req: FillRequest): SaveBegin {
    this.collect();
    return planFill(this.#st, req);
  }

  /**
   * Ends a save or fill. `ok`: the copied slots become FILLED and blocks
   * whose every slot is filled are sealed (servable). Not ok: the plan's
   * slots return to EMPTY and their bytes are freed (blocks left with
   * nothing are dropped). `ok` may also be given per plan block (index k in
   * plan order: a fill whose blocks verify one by one); when it throws, the
   * plan completes as failed (every slot freed) and the error is rethrown.
   * Throws {@link StaleHandleError} for a plan already completed or foreign.
   */
  completeSave(plan: SavePlan, ok: boolean | ((block: number) => boolean)): SaveCompletion {
    return completePlan(this.#st, plan, ok);
  }

  /**
   * A rank's load failed: the KV it (and so every other rank of its engine)
   * computed over it is wrong. Drops the inflight blocks of `hashes` (a copy
   * still running into one completes as failed), evicts the sealed unpinned
   * ones, dooms the pinned ones (counted: never served again, evicted at
   * their last unpin), and refuses saves and fills of `hashes` in the
   * namespace for `DISCARD_TTL_MS` (discard.ts). Throws
   * InvalidArgumentError for a malformed hash or an unknown namespace before
   * anything changes.
   */
  discard(req: DiscardRequest): DiscardResult {
    this.collect();
    return discardHashes(this.#st, req);
  }

  /**
   * Consumes a lease for one rank and returns where its blocks are, pinned
   * until {@link loadDone}. `rank` is the global rank (0..worldSize-1, each
   * consumes once); `tpRank` selects the stored slot (default `rank % tpSize`);
   * `layers` restricts the layers (default all, e.g. one PP stage's);
   * `count` loads only the lease's first `count` blocks (default all: an
   * engine that needs fewer gives the rest back; their pins go with the
   * lease). Throws {@link LeaseError} (FAILED_PRECONDITION) for an unknown,
   * expired, foreign or already-consumed lease, and InvalidArgumentError for
   * a `count` above the lease's blocks — in every case before the rank's
   * consume is spent.
   */
  consumeLease(
    lease: LeaseId,
    instance: string,
    rank: number,
    opts: ConsumeOptions = {},
  ): LoadTicket {
    this.collect();
    return consumeTicket(this.#st, lease, instance, rank, opts);
  }

  /** Ends a load (success or not): unpins its blocks. Throws {@link StaleHandleError} when repeated. */
  loadDone(ticket: LoadTicket): void {
    finishTicket(this.#st, ticket);
  }

  /** Releases a lease before every rank consumed it. Throws {@link LeaseError} when unknown or expired. */
  releaseLease(lease: LeaseId): void {
    this.collect();
    this.#st.unpinLease(this.#st.leases.release(lease));
  }

  /**
   * Pins whichever of `hashes` are sealed here, for another reader to copy
   * out (the SSD writer; a peer's one-sided read, lib/peer/).
   * Returns null when none is held.
   */
  lockForTransfer(
    namespace: string,
    hashes: readonly BlockHash[],
    requester: string,
  ): TransferLock | null {
    this.collect();
    return lockBlocks(this.#st, namespace, hashes, requester);
  }

  /** Releases a transfer lock. Throws {@link LeaseError} when unknown or expired. */
  releaseTransferLock(id: LeaseId): void {
    this.collect();
    unlockBlocks(this.#st, id);
  }

  /**
   * Records the CRC32C of sealed blocks (index-aligned with `hashes`) for
   * transfer locks to carry; blocks not held sealed are skipped. Returns how
   * many were recorded.
   */
  recordChecksums(
    namespace: string,
    hashes: readonly BlockHash[],
    crcs: ArrayLike<number>,
  ): number {
    return recordBlockChecksums(this.#st, namespace, hashes, crcs);
  }

  /**
   * An instance went away (unregistered or its session dropped, after its
   * copies drained): release its leases and transfer locks, and free the
   * inflight blocks it wrote last that have no copy in flight.
   */
  dropInstance(instance: string): { leases: number; inflightFreed: number } {
    return dropInstanceState(this.#st, instance);
  }

  /**
   * Expires leases and transfer locks past their TTL and collects inflight
   * blocks older than the inflight TTL that have no copy in flight. Called by
   * every public operation; the server may also call it from a timer.
   */
  collect(): { leasesExpired: number; staleFreed: number } {
    return collectExpired(this.#st);
  }

  /** Evicts every unpinned sealed block (POST /cache/memory/cleanup). Returns blocks evicted. */
  evictAll(): number {
    return evictBytes(this.#st, Infinity);
  }

  /** State of one block: absent, inflight (not servable) or sealed. */
  blockState(namespace: string, hash: BlockHash): "absent" | "inflight" | "sealed" {
    return blockState(this.#st, namespace, hash);
  }

  /**
   * Checks every invariant the store relies on (invariants.ts) and throws an
   * Error naming the first violation. For tests and a debug endpoint.
   */
  verify(): void {
    verifyStore(this.#st);
  }

  /** Counters and gauges for /metrics. */
  stats(): StoreStats {
    const st = this.#st;
    return {
      capacityBytes: st.allocator.capacityBytes,
      usedBytes: st.allocator.usedBytes,
      freeBytes: st.allocator.freeBytes,
      evictableBytes: st.lru.evictableBytes,
      inflightCopyBytes: st.inflightCopyBytes,
      largestFreeBytes: st.allocator.largestFreeBytes(),
      freeExtents: st.allocator.freeExtentCount,
      partUsedBytes: st.allocator.partUsedBytes(),
      sealedBlocks: st.index.sealedCount,
      inflightBlocks: st.index.inflightCount,
      pinnedBlocks: st.pinned,
      ...st.c,
      admissionRejections: st.lfu?.rejections ?? 0,
      leasesActive: st.leases.size,
      transferLocksActive: st.locks.size,
      loadsInflight: st.loadsInflight,
      discardTombstones: st.tombstones.size,
    };
  }
}
