/**
 * The records every job of the store reads and writes: pool allocator,
 * namespaces, block index, LRU and admission, leases and transfer locks,
 * the open save plans and load tickets, and the counters. The job modules
 * (lookup, save_plan, seal, load_ticket, transfer_lock, cleanup, eviction,
 * invariants) are functions over one `StoreState`; `KvStore` (store.ts) is
 * the facade that owns it and calls them. Pinning lives here because every
 * job pins or unpins and the pinned-block gauge must stay exact.
 *
 * @module
 */

import { PoolAllocator } from "./allocator.ts";
import { type Block, BlockIndex, type BlockLayout } from "./block.ts";
import { LruCache, TinyLfu } from "./cache.ts";
import { InvalidArgumentError } from "./errors.ts";
import { type Lease, LeaseTable } from "./lease.ts";
import { NamespaceRegistry } from "./namespaces.ts";
import type { PlanRecord } from "./save_plan.ts";
import type { TicketRecord } from "./load_ticket.ts";
import { Tombstones } from "./discard.ts";
import { evictSealed } from "./eviction.ts";
import { monotonicNow } from "../clock.ts";

/** Default age after which an inflight block with no copy in flight is collected. */
export const DEFAULT_INFLIGHT_TTL_MS = 300_000;
/** Most hashes one query or save may name (a 1M-token prompt at 16 tokens per block). */
export const MAX_HASHES_PER_REQUEST = 65_536;

/** Construction options of a {@link KvStore} (store.ts). */
export interface KvStoreOptions {
  /** Bytes of the pinned pool this store places blocks in. */
  capacityBytes: number;
  /** Allocation unit (power of two ≥ 512). Default 4096. */
  unitBytes?: number;
  /**
   * Sizes of the pool's consecutive NUMA parts (lib/numa.ts), multiples of
   * the unit; a save that names a part allocates there first. Default: one.
   */
  parts?: readonly number[];
  /** Milliseconds now; inject a fake in tests. Default `monotonicNow` (lib/clock.ts). */
  clock?: () => number;
  /** Lease lifetime. Default 600 s. */
  leaseTtlMs?: number;
  /** Transfer lock lifetime. Default: the lease TTL. */
  transferLockTtlMs?: number;
  /** Inflight blocks older than this (with no copy in flight) are collected. Default 5 min. */
  inflightTtlMs?: number;
  /** TinyLFU admission: sketch sized for this many blocks. Off when absent. */
  lfuCapacityBlocks?: number;
  /** Random bytes for lease ids. Default `crypto.getRandomValues`. */
  randomBytes?: (n: number) => Uint8Array;
  /**
   * Called synchronously for each evicted block, e.g. to withdraw it from the
   * cross-node index or the SSD write queue. Must not call back into the store.
   * If it throws, eviction stops at that block (every block evicted so far is
   * freed, a save being placed rolls back) and the error reaches the caller.
   */
  onEvict?: (namespace: string, hash: string) => void;
}

/** Counters reported by /metrics (monotonic). */
export interface StoreCounters {
  queries: number;
  hits: number;
  misses: number;
  savedBlocks: number;
  deduplicated: number;
  evictions: number;
  evictedBytes: number;
  saveRefusals: number;
  staleCollected: number;
  leasesExpired: number;
  /** Blocks a discard dropped (inflight) or evicted (sealed, unpinned). */
  discardedBlocks: number;
  /** Sealed blocks a discard named while a lease, load or transfer lock pinned them (evicted at the last unpin). */
  discardPinnedKept: number;
  /** Hashes of saves and fills refused because a discard named them within its TTL. */
  discardRefused: number;
}

/** The store's records, shared by its job modules. */
export class StoreState {
  readonly allocator: PoolAllocator;
  readonly clock: () => number;
  readonly inflightTtlMs: number;
  readonly onEvict: ((namespace: string, hash: string) => void) | undefined;
  readonly namespaces: NamespaceRegistry;
  readonly index = new BlockIndex();
  /** Discarded hashes refusing saves until they expire (discard.ts). */
  readonly tombstones = new Tombstones();
  readonly lru: LruCache;
  readonly lfu: TinyLfu | undefined;
  readonly leases: LeaseTable<Block>;
  readonly locks: LeaseTable<Block>;
  /** Open save plans and load tickets (strong: they own slots and pins until completed). */
  readonly plans = new Set<PlanRecord>();
  readonly tickets = new Set<TicketRecord>();
  /** consumeLease's scratch: where each run of linked blocks starts in the lease. */
  runHeads = new Int32Array(0);
  inflightCopyBytes = 0;
  loadsInflight = 0;
  pinned = 0;
  readonly c: StoreCounters = {
    queries: 0,
    hits: 0,
    misses: 0,
    savedBlocks: 0,
    deduplicated: 0,
    evictions: 0,
    evictedBytes: 0,
    saveRefusals: 0,
    staleCollected: 0,
    leasesExpired: 0,
    discardedBlocks: 0,
    discardPinnedKept: 0,
    discardRefused: 0,
  };

  constructor(opts: KvStoreOptions) {
    this.allocator = new PoolAllocator({
      capacityBytes: opts.capacityBytes,
      unitBytes: opts.unitBytes,
      parts: opts.parts,
    });
    this.clock = opts.clock ?? monotonicNow;
    this.inflightTtlMs = opts.inflightTtlMs ?? DEFAULT_INFLIGHT_TTL_MS;
    this.onEvict = opts.onEvict;
    this.namespaces = new NamespaceRegistry(this.allocator);
    this.lru = new LruCache((b) => this.namespaces.require(b.namespace).blockBytes);
    this.lfu = opts.lfuCapacityBlocks ? new TinyLfu(opts.lfuCapacityBlocks) : undefined;
    this.leases = new LeaseTable<Block>({
      ttlMs: opts.leaseTtlMs,
      clock: this.clock,
      randomBytes: opts.randomBytes,
    });
    this.locks = new LeaseTable<Block>({
      ttlMs: opts.transferLockTtlMs ?? opts.leaseTtlMs,
      clock: this.clock,
      randomBytes: opts.randomBytes,
      noun: "transfer lock",
    });
  }

  /** One more holder of `b` (lease, load, lock): it leaves the LRU. */
  pin(b: Block): void {
    if (b.pins === 0) this.pinned++;
    this.lru.pin(b);
  }

  /**
   * One holder fewer; the last one puts `b` back at the MRU end, or evicts it
   * when a discard named it while pinned (discard.ts).
   */
  unpin(b: Block): void {
    this.lru.unpin(b);
    if (b.pins > 0) return;
    this.pinned--;
    if (b.discarded) evictSealed(this, b);
  }

  unpinLease(l: Lease<Block>): void {
    this.unpinAll(l.blocks);
  }

  /**
   * Unpins each of `blocks`. An `onEvict` that throws at a doomed block's
   * eviction (its bytes are freed first) does not leave the others pinned:
   * the first error is rethrown once every block was unpinned.
   */
  unpinAll(blocks: readonly Block[]): void {
    eachThenRethrow(blocks, (b) => this.unpin(b));
  }

  /** Unpins the blocks of every lease in `leases` ({@link unpinAll}: all of them, then the first error). */
  unpinLeases(leases: readonly Lease<Block>[]): void {
    eachThenRethrow(leases, (l) => this.unpinAll(l.blocks));
  }
}

/** Checks what every query, save, fill and lock names: an instance id and a bounded hash count. */
export function checkRequest(
  n: number,
  fields: { namespace: string; instance: string; rank?: number },
): void {
  if (typeof fields.instance !== "string" || fields.instance.length === 0) {
    throw new InvalidArgumentError(`instance id must be a non-empty string`, {
      ...fields,
      instance: String(fields.instance),
    });
  }
  if (n > MAX_HASHES_PER_REQUEST) {
    throw new InvalidArgumentError(
      `request names ${n} block hashes; at most ${MAX_HASHES_PER_REQUEST} are accepted`,
      { ...fields, expected: MAX_HASHES_PER_REQUEST, got: n },
    );
  }
}

/**
 * The layer ids a request names, checked against the layout (default: every
 * layer); throws INVALID_ARGUMENT naming the layer for an empty list, a layer
 * outside the layout or a layer named twice.
 */
export function layerList(
  namespace: string,
  instance: string,
  L: BlockLayout,
  layers: readonly number[] | undefined,
  rank: number,
): number[] {
  if (layers === undefined) return Array.from({ length: L.layers }, (_, i) => i);
  if (layers.length === 0) {
    throw new InvalidArgumentError(`layer list is empty`, { namespace, instance, rank });
  }
  const seen = new Set<number>();
  for (const layer of layers) {
    if (!Number.isSafeInteger(layer) || layer < 0 || layer >= L.layers) {
      throw new InvalidArgumentError(`layer ${layer} is outside 0..${L.layers - 1}`, {
        namespace,
        instance,
        rank,
        layer,
        expected: `0..${L.layers - 1}`,
        got: layer,
      });
    }
    if (seen.has(layer)) {
      throw new InvalidArgumentError(`layer ${layer} appears twice`, {
        namespace,
        instance,
        rank,
        layer,
      });
    }
    seen.add(layer);
  }
  return [...layers];
}

/** `f` on every item: one that throws does not stop the rest; the first error is rethrown after. */
function eachThenRethrow<T>(items: readonly T[], f: (item: T) => void): void {
  let error: unknown;
  let failed = false;
  for (const x of items) {
    try {
      f(x);
    } catch (e) {
      if (!failed) error = e;
      failed = true;
    }
  }
  if (failed) throw error;
}
