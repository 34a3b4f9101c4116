/**
 * The storage facade the KV server drives: which bytes of the pinned pool
 * hold which block, what a query hits, what a save must copy and where, what
 * a load reads. Pure policy — it never copies a byte; the server turns the
 * offsets it returns into one native gather/scatter batch.
 *
 * All methods are synchronous (single-threaded JS; the native copy runs in
 * between `beginSave` and `completeSave`, or `consumeLease` and `loadDone`).
 * Per-block work is O(1) map/list operations plus O(layers × segments)
 * for the offsets; pool allocation is per (layer, segment) per save, never
 * per block; block records are recycled, so a full pool's save/evict churn
 * allocates no per-block records.
 *
 * Invariants (pinned down by tests/storage/):
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

import { PoolAllocator } from "./allocator.ts";
import {
  Block,
  BlockIndex,
  type BlockLayout,
  type CacheClass,
  NO_OFFSET,
  rankSlots,
  SLOT_EMPTY,
  SLOT_FILLED,
  SLOT_PENDING,
  validateLayout,
} from "./block.ts";
import { fnv1a32, LruCache, TinyLfu } from "./cache.ts";
import {
  InvalidArgumentError,
  LayoutMismatchError,
  PoolExhaustedError,
  StaleHandleError,
} from "./errors.ts";
import { type BlockHash, hashBucket, hashHex } from "./keys.ts";
import { type Lease, type LeaseId, LeaseTable } from "./lease.ts";

/** Re-exported so the server needs one import for the store's types. */
export type { BlockLayout } from "./block.ts";

/** Default age after which an inflight block with no copy in flight is collected. */
export const DEFAULT_INFLIGHT_TTL_MS = 300_000;
/** Most hashes one query or save may name (a 1M-token prompt at 16 tokens per block). */
export const MAX_HASHES_PER_REQUEST = 65_536;
/**
 * Freed block records kept per namespace for reuse: enough for several
 * 625-block saves evicting as many blocks, a few MiB at most.
 */
export const SPARE_BLOCK_RECORDS = 4096;
/**
 * Block records per offset slab. A slab lives while any of its records does;
 * records are recycled, so a slab's worth is the most that can be stranded.
 */
const OFFSET_SLAB_RECORDS = 256;

/** Construction options of a {@link KvStore}. */
export interface KvStoreOptions {
  /** Bytes of the pinned pool this store places blocks in. */
  capacityBytes: number;
  /** Allocation unit (power of two ≥ 512). Default 4096. */
  unitBytes?: number;
  /** Milliseconds now; inject a fake in tests. Default `Date.now`. */
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
   */
  onEvict?: (namespace: string, hash: string) => void;
}

/** The answer to {@link KvStore.query}. */
export interface QueryResult {
  /** Length of the longest prefix of the hashes held sealed. */
  readonly hits: number;
  /** Present when hits > 0: pins those blocks until consumed by every rank, released or expired. */
  readonly lease?: {
    readonly id: string;
    readonly idBytes: Uint8Array;
    readonly expiresAt: number;
  };
}

/** One Save request of one rank. */
export interface SaveRequest {
  namespace: string;
  instance: string;
  /** TP rank of the saving worker (collapsed to 0 for MLA layouts). */
  rank: number;
  /** The engine's block hashes, in prefix order. */
  hashes: readonly BlockHash[];
  /** Layer ids this request carries (default: all layers of the layout). */
  layers?: readonly number[];
  /**
   * Cache class when sealed; default "retained". "reclaimable" is for blocks fetched from a
   * peer: a hook for the peer tier, which is not built yet (no caller passes it today).
   */
  cacheClass?: CacheClass;
}

/**
 * Where a save copies to. The plan covers `layers × rankSlots` slot columns
 * (one rank slot for an engine's Save; every rank slot for a whole-block fill
 * from SSD or a peer). Offsets are column-major so one layer's blocks are
 * adjacent and merge into long DMA ranges:
 *
 * `offsets[((li * rankSlots.length + ri) * segments + seg) * blockCount + b]`
 *
 * is the pool byte offset of planned block `b`, layer `layers[li]`, rank slot
 * `rankSlots[ri]`, segment `seg` — or -1 when that slot is already held or in
 * flight (a duplicate) and must not be copied. For an engine Save
 * (`rankSlots.length === 1`) this is `offsets[(li * segments + seg) * blockCount + b]`.
 */
export interface SavePlan {
  readonly namespace: string;
  readonly instance: string;
  /** Rank slot of an engine Save (the TP rank, or 0 when TP is collapsed); -1 for a fill. */
  readonly rankSlot: number;
  /** Rank slots covered, in offset order. */
  readonly rankSlots: Int32Array;
  /** Layer ids covered, in request order. */
  readonly layers: Int32Array;
  readonly segments: number;
  readonly segmentBytes: number;
  /** Blocks to copy. */
  readonly blockCount: number;
  /** For each planned block, its index in the request's `hashes`. */
  readonly hashIndex: Int32Array;
  readonly offsets: Float64Array;
  /** Bytes to copy (items × segmentBytes). */
  readonly bytes: number;
  /** Hashes skipped because they (or these slots) are already held or in flight. */
  readonly deduplicated: number;
  /** New blocks TinyLFU refused (less popular than what they would evict). */
  readonly admissionRejected: number;
  /** Hashes past the prefix that fitted in the pool (refused for room). */
  readonly refusedForRoom: number;
}

/** A whole-block fill (SSD prefetch, peer fetch): every layer and rank slot of each block. */
export interface FillRequest {
  namespace: string;
  /** Who fills (e.g. `"ssd"` or the peer's node id); recorded for cleanup like an instance. */
  instance: string;
  hashes: readonly BlockHash[];
  /** Default "retained" (SSD); "reclaimable" is the not-yet-built peer tier's (see SaveRequest). */
  cacheClass?: CacheClass;
}

/** The answer to {@link KvStore.beginSave}. */
export type SaveBegin =
  | { readonly ok: true; readonly plan: SavePlan }
  | { readonly ok: false; readonly error: PoolExhaustedError };

/** What {@link KvStore.completeSave} did. */
export interface SaveCompletion {
  /** Blocks that became sealed (servable) by this save. */
  readonly sealed: number;
  /** Keys (`namespace:hash`) of those blocks. */
  readonly sealedKeys: readonly string[];
  /** Content hashes (hex) of those blocks, for SSD write-behind and the cross-node index. */
  readonly sealedHashes: readonly string[];
  /** Pool bytes freed (failed saves). */
  readonly freedBytes: number;
}

/**
 * What a load reads: the same layer-major layout as {@link SavePlan}:
 * `offsets[(li * segments + seg) * blockCount + b]`. Holds its blocks until
 * {@link KvStore.loadDone}.
 */
export interface LoadTicket {
  readonly namespace: string;
  readonly instance: string;
  readonly rank: number;
  readonly lease: string;
  readonly layers: Int32Array;
  readonly segments: number;
  readonly segmentBytes: number;
  readonly blockCount: number;
  /** Content hashes (hex) of the blocks, in prefix order. */
  readonly hashes: readonly string[];
  /**
   * The blocks as runs: run `r` is blocks `runStarts[r]` up to `runStarts[r + 1]`
   * (the last entry is `blockCount`), each block's items exactly `itemStride`
   * bytes after the previous block's (blocks saved together). A batch builder
   * walks runs instead of 40,000 single offsets.
   */
  readonly runStarts: Int32Array;
  /** Pool offset of each run's first block: `runOffsets[(li * segments + seg) * runs + r]`. */
  readonly runOffsets: Float64Array;
  /** Pool bytes from one block's item to the next block's within a run. */
  readonly itemStride: number;
  /** Every block's offsets, `offsets[(li * segments + seg) * blockCount + b]`, made from the runs on first use. */
  readonly offsets: Float64Array;
  readonly bytes: number;
}

/** A transfer lock (peer fetch): pins any sealed subset of the asked hashes. */
export interface TransferLock {
  readonly id: string;
  readonly idBytes: Uint8Array;
  readonly expiresAt: number;
  /** Indexes (into the asked hashes) of the blocks held and locked. */
  readonly found: Int32Array;
  /**
   * Every slot of every found block: `offsets[j * found.length + i]` with
   * `j = (layer * rankSlots + rankSlot) * segments + seg`.
   */
  readonly offsets: Float64Array;
  readonly segmentBytes: number;
}

/** Counters and gauges for /metrics. */
export interface StoreStats {
  capacityBytes: number;
  usedBytes: number;
  freeBytes: number;
  evictableBytes: number;
  /** Bytes reserved for copies in flight (saves not yet completed). */
  inflightCopyBytes: number;
  largestFreeBytes: number;
  freeExtents: number;
  sealedBlocks: number;
  inflightBlocks: number;
  pinnedBlocks: number;
  queries: number;
  hits: number;
  misses: number;
  savedBlocks: number;
  deduplicated: number;
  evictions: number;
  evictedBytes: number;
  admissionRejections: number;
  saveRefusals: number;
  staleCollected: number;
  leasesActive: number;
  leasesExpired: number;
  transferLocksActive: number;
  loadsInflight: number;
}

interface NamespaceState {
  readonly layout: BlockLayout;
  readonly rankSlots: number;
  /** Pool bytes one item really takes (segment rounded up to the unit). */
  readonly strideBytes: number;
  readonly blockBytes: number;
  /** Seed of this namespace's hash buckets (the same content hash in two namespaces lands apart). */
  readonly seed: number;
  /** Freed block records kept for reuse (at most {@link SPARE_BLOCK_RECORDS}). */
  readonly spare: Block[];
  /** Where new block records' offsets are cut from ({@link OFFSET_SLAB_RECORDS} per slab). */
  readonly slab: { buf: Float64Array; used: number };
}

/** Internal form of a plan: the public fields plus the blocks, for completion. */
interface PlanRecord extends SavePlan {
  readonly blocks: Block[];
  readonly cacheClass: CacheClass;
  /** Pool bytes reserved (items rounded up to the unit). */
  readonly poolBytes: number;
  settled: boolean;
}

interface TicketRecord extends LoadTicket {
  readonly blocks: readonly Block[];
  settled: boolean;
}

/** A load ticket; `offsets` is expanded from the runs only when someone reads it. */
class Ticket implements TicketRecord {
  settled = false;
  #offsets: Float64Array | undefined;
  constructor(
    readonly namespace: string,
    readonly instance: string,
    readonly rank: number,
    readonly lease: string,
    readonly layers: Int32Array,
    readonly segments: number,
    readonly segmentBytes: number,
    readonly blockCount: number,
    readonly hashes: readonly string[],
    readonly runStarts: Int32Array,
    readonly runOffsets: Float64Array,
    readonly itemStride: number,
    readonly bytes: number,
    readonly blocks: readonly Block[],
  ) {}

  get offsets(): Float64Array {
    if (this.#offsets) return this.#offsets;
    const n = this.blockCount;
    const runs = this.runStarts.length - 1;
    const cols = this.layers.length * this.segments;
    const out = new Float64Array(cols * n);
    for (let c = 0; c < cols; c++) {
      for (let r = 0; r < runs; r++) {
        let off = this.runOffsets[c * runs + r];
        for (let k = this.runStarts[r]; k < this.runStarts[r + 1]; k++) {
          out[c * n + k] = off;
          off += this.itemStride;
        }
      }
    }
    return this.#offsets = out;
  }
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
  readonly allocator: PoolAllocator;
  readonly #clock: () => number;
  readonly #inflightTtlMs: number;
  readonly #onEvict: ((namespace: string, hash: string) => void) | undefined;
  readonly #index = new BlockIndex();
  readonly #lru: LruCache;
  readonly #lfu: TinyLfu | undefined;
  readonly #leases: LeaseTable<Block>;
  readonly #locks: LeaseTable<Block>;
  readonly #namespaces = new Map<string, NamespaceState>();
  /** Open save plans and load tickets (strong: they own slots and pins until completed). */
  readonly #plans = new Set<PlanRecord>();
  readonly #tickets = new Set<TicketRecord>();
  /** consumeLease's scratch: where each run of linked blocks starts in the lease. */
  #runHeads = new Int32Array(0);
  #inflightCopyBytes = 0;
  #loadsInflight = 0;
  #pinned = 0;
  #c = {
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
  };

  constructor(opts: KvStoreOptions) {
    this.allocator = new PoolAllocator({
      capacityBytes: opts.capacityBytes,
      unitBytes: opts.unitBytes,
    });
    this.#clock = opts.clock ?? Date.now;
    this.#inflightTtlMs = opts.inflightTtlMs ?? DEFAULT_INFLIGHT_TTL_MS;
    this.#onEvict = opts.onEvict;
    this.#lru = new LruCache((b) => this.#ns(b.namespace).blockBytes);
    this.#lfu = opts.lfuCapacityBlocks ? new TinyLfu(opts.lfuCapacityBlocks) : undefined;
    this.#leases = new LeaseTable<Block>({
      ttlMs: opts.leaseTtlMs,
      clock: this.#clock,
      randomBytes: opts.randomBytes,
    });
    this.#locks = new LeaseTable<Block>({
      ttlMs: opts.transferLockTtlMs ?? opts.leaseTtlMs,
      clock: this.#clock,
      randomBytes: opts.randomBytes,
      noun: "transfer lock",
    });
  }

  /**
   * Declares the block geometry of a namespace (at the first registration of
   * an engine using it). Idempotent for the same layout; a different layout
   * under the same namespace throws {@link LayoutMismatchError}.
   */
  defineNamespace(namespace: string, layout: BlockLayout): void {
    if (typeof namespace !== "string" || namespace.length === 0 || namespace.includes(":")) {
      throw new InvalidArgumentError(`namespace must be a non-empty string without ':'`, {
        namespace: String(namespace),
      });
    }
    validateLayout(namespace, layout);
    const have = this.#namespaces.get(namespace);
    if (have) {
      for (const f of ["layers", "tpSize", "collapseTp", "segments", "segmentBytes"] as const) {
        if (have.layout[f] !== layout[f]) {
          throw new LayoutMismatchError(namespace, f, String(have.layout[f]), String(layout[f]));
        }
      }
      const a = have.layout.identity, b = layout.identity;
      if (a && b && a.fingerprint !== b.fingerprint) {
        throw new LayoutMismatchError(
          namespace,
          "layout",
          `${a.summary} (fingerprint ${a.fingerprint})`,
          `${b.summary} (fingerprint ${b.fingerprint})`,
        );
      }
      have.layout.identity ??= b;
      return;
    }
    const stride = this.allocator.strideOf(layout.segmentBytes);
    const slots = rankSlots(layout);
    this.#namespaces.set(namespace, {
      layout: { ...layout },
      rankSlots: slots,
      strideBytes: stride,
      blockBytes: layout.layers * slots * layout.segments * stride,
      seed: fnv1a32(namespace),
      spare: [],
      slab: { buf: new Float64Array(0), used: 0 },
    });
  }

  /** The layout of a defined namespace, or undefined. */
  layoutOf(namespace: string): BlockLayout | undefined {
    const s = this.#namespaces.get(namespace);
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
    checkRequest(hashes.length, { namespace, instance });
    if (!Number.isSafeInteger(worldSize) || worldSize < 1) {
      throw new InvalidArgumentError(`world size must be an integer ≥ 1`, {
        namespace,
        instance,
        got: worldSize,
      });
    }
    this.#c.queries++;
    const hit: Block[] = [];
    const ns = this.#namespaces.get(namespace);
    const buckets = this.#index.buckets(namespace);
    for (let i = 0; i < hashes.length; i++) {
      const bucket = hashBucket(hashes[i], ns?.seed ?? 0); // validates the hash in any case
      if (!ns) continue; // nothing was ever saved under an unknown namespace
      this.#lfu?.record(bucket);
      if (hit.length < i) continue; // prefix already broken: keep counting frequency
      const b = BlockIndex.findIn(buckets, hashes[i], bucket);
      if (b && b.state === "sealed") hit.push(b);
    }
    this.#c.hits += hit.length;
    this.#c.misses += hashes.length - hit.length;
    if (hit.length === 0) return { hits: 0 };
    // No LRU touch: the pin takes each block out of the LRU and the last unpin
    // puts it back at the MRU end, which is where a touch would have moved it.
    for (const b of hit) this.#pin(b);
    const lease = this.#leases.create(instance, namespace, hit, worldSize);
    return {
      hits: hit.length,
      lease: { id: lease.id, idBytes: lease.idBytes, expiresAt: lease.expiresAt },
    };
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
    const { namespace, instance } = req;
    const ns = this.#ns(namespace, instance);
    const L = ns.layout;
    if (!Number.isSafeInteger(req.rank) || req.rank < 0 || req.rank >= L.tpSize) {
      throw new InvalidArgumentError(`rank ${req.rank} is outside 0..${L.tpSize - 1}`, {
        namespace,
        instance,
        rank: req.rank,
        expected: `0..${L.tpSize - 1}`,
        got: req.rank,
      });
    }
    checkRequest(req.hashes.length, { namespace, instance, rank: req.rank });
    const layers = this.#layers(namespace, instance, L, req.layers, req.rank);
    const rankSlot = L.collapseTp ? 0 : req.rank;
    return this.#plan(
      ns,
      namespace,
      instance,
      req.rank,
      req.hashes,
      layers,
      [rankSlot],
      req.cacheClass,
    );
  }

  /**
   * Plans a whole-block fill (SSD prefetch into RAM, peer fetch): every layer
   * and every rank slot of each block not already held. Same contract as
   * {@link beginSave}; the blocks seal at {@link completeSave}. No server
   * path calls it yet (only tests): the SSD bridge still plans per rank with
   * beginSave, and the peer fetch does not exist.
   */
  beginFill(req: FillRequest): SaveBegin {
    this.collect();
    const ns = this.#ns(req.namespace, req.instance);
    checkRequest(req.hashes.length, { namespace: req.namespace, instance: req.instance });
    const layers = Array.from({ length: ns.layout.layers }, (_, i) => i);
    const ranks = Array.from({ length: ns.rankSlots }, (_, i) => i);
    return this.#plan(
      ns,
      req.namespace,
      req.instance,
      -1,
      req.hashes,
      layers,
      ranks,
      req.cacheClass,
    );
  }

  #plan(
    ns: NamespaceState,
    namespace: string,
    instance: string,
    rank: number,
    hashes: readonly BlockHash[],
    layers: number[],
    rankSlotList: number[],
    cacheClass: CacheClass = "retained",
  ): SaveBegin {
    const L = ns.layout;
    const S = L.segments;
    const R = rankSlotList.length;
    const C = layers.length * R; // slot columns: (layer, rank slot) pairs
    const colSlot = new Int32Array(C); // column → slot index within a block
    for (let li = 0; li < layers.length; li++) {
      for (let ri = 0; ri < R; ri++) {
        colSlot[li * R + ri] = layers[li] * ns.rankSlots + rankSlotList[ri];
      }
    }

    // 1. Dedup: which (block, column) slots still need bytes. One flat need map, no per-block arrays.
    const need = new Uint8Array(hashes.length * C);
    const needCount = new Int32Array(hashes.length);
    const hashIndex: number[] = [];
    const buckets: number[] = [];
    const hexes: string[] = [];
    const existing: (Block | undefined)[] = [];
    let deduplicated = 0;
    // A hash named twice in one request is planned once.
    const seenBlocks = new Set<Block>();
    const seenNew = new Set<string>();
    for (let i = 0; i < hashes.length; i++) {
      const bucket = hashBucket(hashes[i], ns.seed);
      this.#lfu?.record(bucket);
      const b = this.#index.find(namespace, hashes[i], bucket);
      let hex: string;
      if (b) {
        if (b.state === "sealed" || seenBlocks.has(b)) {
          // Saving a held block again is an access: keep it from being this save's victim.
          if (b.state === "sealed") this.#lru.touch(b);
          deduplicated++;
          continue;
        }
        seenBlocks.add(b);
        hex = b.hash;
      } else {
        hex = hashHex(hashes[i]);
        if (seenNew.has(hex)) {
          deduplicated++;
          continue;
        }
        seenNew.add(hex);
      }
      const k = hexes.length;
      let n = 0;
      for (let c = 0; c < C; c++) {
        if (!b || b.slots[colSlot[c]] === SLOT_EMPTY) {
          need[k * C + c] = 1;
          n++;
        }
      }
      if (n === 0) {
        deduplicated++;
        continue;
      }
      needCount[k] = n;
      hashIndex.push(i);
      buckets.push(bucket);
      hexes.push(hex);
      existing.push(b);
    }
    this.#c.deduplicated += deduplicated;

    // 2. Room: keep the longest prefix that free + evictable bytes can hold.
    const slotBytes = S * ns.strideBytes;
    let total = 0;
    for (let k = 0; k < hexes.length; k++) total += needCount[k] * slotBytes;
    let count = hexes.length;
    const room = this.allocator.freeBytes + this.#lru.evictableBytes;
    while (count > 0 && total > room) total -= needCount[--count] * slotBytes;
    const refusedForRoom = hexes.length - count;
    const firstBytes = hexes.length > 0 ? needCount[0] * slotBytes : 0;

    // 3. Admission (only when eviction is needed): new blocks must beat the victim.
    let admissionRejected = 0;
    if (this.#lfu && total > this.allocator.freeBytes) {
      const victim = this.#lru.victim();
      if (victim) {
        let w = 0;
        total = 0;
        for (let k = 0; k < count; k++) {
          if (existing[k] === undefined && !this.#lfu.admit(buckets[k], victim.bucket)) {
            admissionRejected++;
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
        count = w;
      }
    }

    const refuse = (bytes: number): SaveBegin => {
      this.#c.saveRefusals++;
      return {
        ok: false,
        error: new PoolExhaustedError(bytes, this.allocator.freeBytes, this.#lru.evictableBytes, {
          namespace,
          instance,
          rank: rank >= 0 ? rank : undefined,
        }),
      };
    };
    if (count === 0) {
      if (refusedForRoom > 0) return refuse(firstBytes);
      const empty = this.#record(namespace, instance, rank, rankSlotList, layers, ns, {
        count: 0,
        hashIndex: [],
        offsets: new Float64Array(0),
        total: 0,
        deduplicated,
        admissionRejected,
        refusedForRoom: 0,
        blocks: [],
        cacheClass,
      });
      return { ok: true, plan: empty };
    }

    // 4. Evict until the bytes are free, then allocate per (column, segment).
    if (this.allocator.freeBytes < total) this.#evictBytes(total - this.allocator.freeBytes);
    const offsets = new Float64Array(C * S * count).fill(NO_OFFSET);
    // follows[k]: every item of block k comes one stride after block k-1's.
    const follows = new Uint8Array(count).fill(1);
    follows[0] = 0;
    const allocated: [number, number][] = []; // [offset, items] runs, for rollback
    const itemBytes = L.segmentBytes;
    let failed = false;
    outer: for (let c = 0; c < C; c++) {
      let m = 0;
      for (let k = 0; k < count; k++) m += need[k * C + c];
      if (m === 0) continue;
      for (let seg = 0; seg < S; seg++) {
        let runs = this.allocator.allocate(m, itemBytes);
        // Fragmentation across namespaces: keep evicting until the items fit.
        while (runs === null && this.#evictOne()) runs = this.allocator.allocate(m, itemBytes);
        if (runs === null) {
          failed = true;
          break outer;
        }
        for (const r of runs) allocated.push([r.offset, r.items]);
        let r = 0;
        let inRun = 0;
        let prevK = -2;
        const base = (c * S + seg) * count;
        for (let k = 0; k < count; k++) {
          if (!need[k * C + c]) continue;
          if (inRun === 0 || prevK !== k - 1) follows[k] = 0;
          prevK = k;
          offsets[base + k] = runs[r].offset + inRun * ns.strideBytes;
          if (++inRun === runs[r].items) {
            r++;
            inRun = 0;
          }
        }
      }
    }
    if (failed) {
      for (const [off, items] of allocated) this.allocator.free(off, itemBytes, items);
      return refuse(total);
    }

    // 5. Create blocks, mark slots in flight, record offsets on the blocks.
    const now = this.#clock();
    const blocks: Block[] = new Array(count);
    // Run links only between new blocks this plan fills completely (every slot).
    const wholeBlocks = C === L.layers * ns.rankSlots;
    for (let k = 0; k < count; k++) {
      let b = existing[k];
      if (b) b.runPrev = null;
      else {
        b = ns.spare.pop();
        if (b) b.recycle(`${namespace}:${hexes[k]}`, hexes[k], now, buckets[k]);
        else {
          b = new Block(
            `${namespace}:${hexes[k]}`,
            namespace,
            hexes[k],
            L,
            now,
            buckets[k],
            this.#offsetRecord(ns),
          );
        }
        this.#index.addInflight(b);
        if (wholeBlocks && follows[k] && existing[k - 1] === undefined) {
          b.runPrev = blocks[k - 1];
          b.runPrevGen = blocks[k - 1].gen;
        }
      }
      b.lastWriter = instance;
      for (let c = 0; c < C; c++) {
        if (!need[k * C + c]) continue;
        const si = colSlot[c];
        b.slots[si] = SLOT_PENDING;
        b.pending++;
        for (let seg = 0; seg < S; seg++) {
          b.offsets[si * S + seg] = offsets[(c * S + seg) * count + k];
        }
      }
      blocks[k] = b;
    }
    this.#inflightCopyBytes += total;
    const plan = this.#record(namespace, instance, rank, rankSlotList, layers, ns, {
      count,
      hashIndex: hashIndex.slice(0, count),
      offsets,
      total,
      deduplicated,
      admissionRejected,
      refusedForRoom,
      blocks,
      cacheClass,
    });
    return { ok: true, plan };
  }

  #record(
    namespace: string,
    instance: string,
    rank: number,
    rankSlotList: number[],
    layers: number[],
    ns: NamespaceState,
    p: {
      count: number;
      hashIndex: number[];
      offsets: Float64Array;
      total: number;
      deduplicated: number;
      admissionRejected: number;
      refusedForRoom: number;
      blocks: Block[];
      cacheClass: CacheClass;
    },
  ): PlanRecord {
    const plan: PlanRecord = {
      namespace,
      instance,
      rankSlot: rank >= 0 ? rankSlotList[0] : -1,
      rankSlots: Int32Array.from(rankSlotList),
      layers: Int32Array.from(layers),
      segments: ns.layout.segments,
      segmentBytes: ns.layout.segmentBytes,
      blockCount: p.count,
      hashIndex: Int32Array.from(p.hashIndex),
      offsets: p.offsets,
      bytes: (p.total / ns.strideBytes) * ns.layout.segmentBytes,
      deduplicated: p.deduplicated,
      admissionRejected: p.admissionRejected,
      refusedForRoom: p.refusedForRoom,
      blocks: p.blocks,
      cacheClass: p.cacheClass,
      poolBytes: p.total,
      settled: false,
    };
    this.#plans.add(plan);
    return plan;
  }

  /**
   * Ends a save or fill. `ok`: the copied slots become FILLED and blocks
   * whose every slot is filled are sealed (servable). Not ok: the plan's
   * slots return to EMPTY and their bytes are freed (blocks left with
   * nothing are dropped). Throws {@link StaleHandleError} for a plan already
   * completed or foreign.
   */
  completeSave(plan: SavePlan, ok: boolean): SaveCompletion {
    const p = plan as PlanRecord;
    if (!this.#plans.has(p) || p.settled) {
      throw new StaleHandleError(`save plan was already completed or is not from this store`, {
        namespace: plan.namespace,
        instance: plan.instance,
      });
    }
    p.settled = true;
    this.#plans.delete(p);
    this.#inflightCopyBytes -= p.poolBytes;
    const S = p.segments;
    const R = p.rankSlots.length;
    const C = p.layers.length * R;
    const n = p.blockCount;
    const rankSlotsOf = this.#ns(p.namespace).rankSlots;
    const sealedKeys: string[] = [];
    const sealedHashes: string[] = [];
    let freed = 0;
    for (let k = 0; k < n; k++) {
      const b = p.blocks[k];
      for (let c = 0; c < C; c++) {
        if (p.offsets[c * S * n + k] === NO_OFFSET) continue;
        const si = p.layers[Math.floor(c / R)] * rankSlotsOf + p.rankSlots[c % R];
        b.pending--;
        if (ok) {
          b.slots[si] = SLOT_FILLED;
          b.filled++;
        } else {
          b.slots[si] = SLOT_EMPTY;
          for (let seg = 0; seg < S; seg++) {
            this.allocator.free(b.offsets[si * S + seg], p.segmentBytes);
            b.offsets[si * S + seg] = NO_OFFSET;
            freed += this.allocator.strideOf(p.segmentBytes);
          }
        }
      }
      if (ok && b.filled === b.slotCount && b.state === "inflight") {
        this.#index.seal(b);
        this.#lru.insert(b, p.cacheClass);
        this.#c.savedBlocks++;
        sealedKeys.push(b.key);
        sealedHashes.push(b.hash);
      } else if (!ok && b.filled === 0 && b.pending === 0) {
        this.#index.remove(b);
        this.#recycle(b);
      }
    }
    return { sealed: sealedKeys.length, sealedKeys, sealedHashes, freedBytes: freed };
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
    opts: { tpRank?: number; layers?: readonly number[]; count?: number } = {},
  ): LoadTicket {
    this.collect();
    let layers: number[] = [];
    let tpRank = 0;
    // Validate the request against the lease's layout before the rank spends its consume.
    const { lease: l, last } = this.#leases.consume(lease, instance, rank, (l) => {
      const c = opts.count;
      if (c !== undefined && !(Number.isSafeInteger(c) && c >= 0 && c <= l.blocks.length)) {
        throw new InvalidArgumentError(
          `lease ${l.id} holds ${l.blocks.length} blocks; a load names at most that many targets, got ${c}`,
          {
            namespace: l.namespace,
            instance,
            rank,
            lease: l.id,
            expected: l.blocks.length,
            got: c,
          },
        );
      }
      const L = this.#ns(l.namespace, instance).layout;
      tpRank = opts.tpRank ?? rank % L.tpSize;
      if (!Number.isSafeInteger(tpRank) || tpRank < 0 || tpRank >= L.tpSize) {
        throw new InvalidArgumentError(`tp rank ${tpRank} is outside 0..${L.tpSize - 1}`, {
          namespace: l.namespace,
          instance,
          rank,
          lease: l.id,
          expected: `0..${L.tpSize - 1}`,
          got: tpRank,
        });
      }
      layers = this.#layers(l.namespace, instance, L, opts.layers, rank);
    });
    const L = this.#ns(l.namespace, instance).layout;
    const rankSlot = L.collapseTp ? 0 : tpRank;
    const S = L.segments;
    const slotsPerLayer = rankSlots(L);
    // The ticket covers the prefix the load names; the lease keeps pinning all
    // of its blocks until it ends (last consume, release, expiry).
    const blocks = opts.count === undefined || opts.count === l.blocks.length
      ? l.blocks
      : l.blocks.slice(0, opts.count);
    const n = blocks.length;
    // A block saved right after its predecessor (same save, every item one stride
    // further: Block.runPrev) needs no read of its record: the lease splits into
    // runs, and only each run's first record is read (one for a prefix saved in
    // one request).
    if (this.#runHeads.length < n + 1) this.#runHeads = new Int32Array(n + 1);
    const heads = this.#runHeads;
    let runs = 0;
    if (n > 0) heads[runs++] = 0;
    for (let k = 1; k < n; k++) {
      const b = blocks[k];
      const p = blocks[k - 1];
      if (b.runPrev !== p || b.runPrevGen !== p.gen) heads[runs++] = k;
    }
    heads[runs] = n;
    const runOffsets = new Float64Array(layers.length * S * runs);
    for (let r = 0; r < runs; r++) {
      const rec = blocks[heads[r]].offsets;
      for (let li = 0; li < layers.length; li++) {
        const slot = layers[li] * slotsPerLayer + rankSlot; // = Block.slotIndex
        for (let seg = 0; seg < S; seg++) {
          runOffsets[(li * S + seg) * runs + r] = rec[slot * S + seg];
        }
      }
    }
    for (let k = 0; k < n; k++) this.#pin(blocks[k]);
    if (last) this.#unpinLease(l);
    this.#loadsInflight++;
    const ticket = new Ticket(
      l.namespace,
      instance,
      rank,
      l.id,
      Int32Array.from(layers),
      S,
      L.segmentBytes,
      n,
      blocks.map((b) => b.hash),
      heads.slice(0, runs + 1),
      runOffsets,
      this.#ns(l.namespace, instance).strideBytes,
      n * layers.length * S * L.segmentBytes,
      // The lease's list is never mutated (a lease only ever goes away whole).
      blocks,
    );
    this.#tickets.add(ticket);
    return ticket;
  }

  /** Ends a load (success or not): unpins its blocks. Throws {@link StaleHandleError} when repeated. */
  loadDone(ticket: LoadTicket): void {
    const t = ticket as TicketRecord;
    if (!this.#tickets.has(t) || t.settled) {
      throw new StaleHandleError(`load ticket was already completed or is not from this store`, {
        namespace: ticket.namespace,
        instance: ticket.instance,
        rank: ticket.rank,
        lease: ticket.lease,
      });
    }
    t.settled = true;
    this.#tickets.delete(t);
    this.#loadsInflight--;
    for (const b of t.blocks) this.#unpin(b);
  }

  /** Releases a lease before every rank consumed it. Throws {@link LeaseError} when unknown or expired. */
  releaseLease(lease: LeaseId): void {
    this.collect();
    this.#unpinLease(this.#leases.release(lease));
  }

  /**
   * Pins whichever of `hashes` are sealed here so a reader outside the store
   * can copy them out while eviction stays away. Used today by the SSD
   * write-behind (lib/ssd/kv_bridge.ts). The cross-node read it is shaped for
   * (a peer pinning blocks for a one-sided RDMA / TCP read, DESIGN.md) is not
   * built yet. Returns null when none is held.
   */
  lockForTransfer(
    namespace: string,
    hashes: readonly BlockHash[],
    requester: string,
  ): TransferLock | null {
    this.collect();
    checkRequest(hashes.length, { namespace, instance: requester });
    const ns = this.#namespaces.get(namespace);
    if (!ns) return null;
    const found: number[] = [];
    const blocks: Block[] = [];
    for (let i = 0; i < hashes.length; i++) {
      const b = this.#index.find(namespace, hashes[i], hashBucket(hashes[i], ns.seed));
      if (b?.state === "sealed") {
        found.push(i);
        blocks.push(b);
      }
    }
    if (blocks.length === 0) return null;
    for (const b of blocks) this.#pin(b);
    const lock = this.#locks.create(requester, namespace, blocks, 1);
    const per = ns.layout.layers * ns.rankSlots * ns.layout.segments;
    const offsets = new Float64Array(per * blocks.length);
    for (let k = 0; k < blocks.length; k++) {
      for (let j = 0; j < per; j++) offsets[j * blocks.length + k] = blocks[k].offsets[j];
    }
    return {
      id: lock.id,
      idBytes: lock.idBytes,
      expiresAt: lock.expiresAt,
      found: Int32Array.from(found),
      offsets,
      segmentBytes: ns.layout.segmentBytes,
    };
  }

  /** Releases a transfer lock. Throws {@link LeaseError} when unknown or expired. */
  releaseTransferLock(id: LeaseId): void {
    this.collect();
    this.#unpinLease(this.#locks.release(id));
  }

  /**
   * An instance went away (unregistered or its session dropped, after its
   * copies drained): release its leases and transfer locks, and free the
   * inflight blocks it wrote last that have no copy in flight.
   */
  dropInstance(instance: string): { leases: number; inflightFreed: number } {
    const leases = [...this.#leases.dropInstance(instance), ...this.#locks.dropInstance(instance)];
    for (const l of leases) this.#unpinLease(l);
    const victims: Block[] = [];
    for (const b of this.#index.inflight()) {
      if (b.pending === 0 && b.lastWriter === instance) victims.push(b);
    }
    for (const b of victims) this.#dropInflight(b);
    return { leases: leases.length, inflightFreed: victims.length };
  }

  /**
   * Expires leases and transfer locks past their TTL and collects inflight
   * blocks older than the inflight TTL that have no copy in flight. Called by
   * every public operation; the server may also call it from a timer.
   */
  collect(): { leasesExpired: number; staleFreed: number } {
    let leasesExpired = 0;
    for (const l of this.#leases.expire()) {
      this.#unpinLease(l);
      leasesExpired++;
    }
    for (const l of this.#locks.expire()) this.#unpinLease(l);
    this.#c.leasesExpired += leasesExpired;
    const cutoff = this.#clock() - this.#inflightTtlMs;
    const stale: Block[] = [];
    for (const b of this.#index.inflight()) {
      if (b.createdAt > cutoff) break; // creation order: the rest are younger
      if (b.pending === 0) stale.push(b);
    }
    for (const b of stale) this.#dropInflight(b);
    this.#c.staleCollected += stale.length;
    return { leasesExpired, staleFreed: stale.length };
  }

  /** Evicts every unpinned sealed block (POST /cache/memory/cleanup). Returns blocks evicted. */
  evictAll(): number {
    return this.#evictBytes(Infinity);
  }

  /** State of one block: absent, inflight (not servable) or sealed. */
  blockState(namespace: string, hash: BlockHash): "absent" | "inflight" | "sealed" {
    const ns = this.#namespaces.get(namespace);
    const bucket = hashBucket(hash, ns?.seed ?? 0);
    return (ns && this.#index.find(namespace, hash, bucket)?.state) || "absent";
  }

  /**
   * Checks every invariant the store relies on and throws an Error naming the
   * first violation: pool bytes are partitioned exactly into free extents and
   * owned slot items (no overlap, no leak); each block's pin count equals the
   * leases, locks and loads holding it; pinned blocks are sealed and out of
   * the LRU, unpinned sealed blocks are in it; evictable bytes add up.
   * O(blocks × slots): for tests and a debug endpoint, not the hot path.
   */
  verify(): void {
    const ranges: [number, number, string][] = [];
    for (const [off, len] of this.allocator.freeExtents()) ranges.push([off, len, "free"]);
    const pins = new Map<Block, number>();
    const count = (bs: readonly Block[]) => {
      for (const b of bs) pins.set(b, (pins.get(b) ?? 0) + 1);
    };
    for (const l of this.#leases.all()) count(l.blocks);
    for (const l of this.#locks.all()) count(l.blocks);
    for (const t of this.#tickets) count(t.blocks);
    let evictable = 0;
    let pinned = 0;
    let pending = 0;
    for (const b of this.#index.all()) {
      const ns = this.#ns(b.namespace);
      const S = b.layout.segments;
      let filled = 0;
      let pend = 0;
      for (let si = 0; si < b.slots.length; si++) {
        const st = b.slots[si];
        if (st === SLOT_FILLED) filled++;
        if (st === SLOT_PENDING) pend++;
        for (let seg = 0; seg < S; seg++) {
          const off = b.offsets[si * S + seg];
          if ((st === SLOT_EMPTY) !== (off === NO_OFFSET)) {
            throw new Error(`block ${b.key} slot ${si}: state ${st} but offset ${off}`);
          }
          if (st !== SLOT_EMPTY) ranges.push([off, ns.strideBytes, b.key]);
        }
      }
      if (filled !== b.filled || pend !== b.pending) {
        throw new Error(
          `block ${b.key}: counts filled ${b.filled}/${filled} pending ${b.pending}/${pend}`,
        );
      }
      pending += pend;
      // A valid run link to a live block is a promise consumeLease relies on instead
      // of reading offsets (a link to a freed record is never followed: a lease
      // only holds live blocks, and a recycled record has a new gen).
      const p = b.runPrev;
      if (
        p && p.gen === b.runPrevGen && b.state === "sealed" && p.state === "sealed" &&
        this.#index.has(p)
      ) {
        for (let j = 0; j < b.offsets.length; j++) {
          if (b.offsets[j] !== p.offsets[j] + ns.strideBytes) {
            throw new Error(
              `block ${b.key} is linked after ${p.key} but item ${j} is at ${b.offsets[j]}, ` +
                `not ${p.offsets[j]} + ${ns.strideBytes}`,
            );
          }
        }
      }
      if (b.state === "sealed" && filled !== b.slotCount) {
        throw new Error(`block ${b.key} is sealed with ${filled}/${b.slotCount} slots`);
      }
      const want = pins.get(b) ?? 0;
      if (b.pins !== want) throw new Error(`block ${b.key}: ${b.pins} pins, holders say ${want}`);
      if (want > 0) {
        pinned++;
        if (b.state !== "sealed" || b.linked) {
          throw new Error(`pinned block ${b.key} is ${b.state}, linked=${b.linked}`);
        }
      } else if (b.state === "sealed") {
        if (!b.linked) throw new Error(`unpinned sealed block ${b.key} is not in the LRU`);
        evictable += ns.blockBytes;
      }
    }
    for (const b of pins.keys()) {
      if (!this.#index.has(b)) {
        throw new Error(`a holder pins block ${b.key} that was freed`);
      }
    }
    if (evictable !== this.#lru.evictableBytes) {
      throw new Error(`evictable bytes ${this.#lru.evictableBytes}, blocks say ${evictable}`);
    }
    if (pinned !== this.#pinned) {
      throw new Error(`pinned count ${this.#pinned}, blocks say ${pinned}`);
    }
    let planned = 0;
    let plannedSlots = 0;
    for (const p of this.#plans) {
      planned += p.poolBytes;
      const cols = p.layers.length * p.rankSlots.length;
      for (let i = 0; i < cols * p.blockCount; i++) {
        const c = Math.floor(i / p.blockCount);
        if (p.offsets[c * p.segments * p.blockCount + (i % p.blockCount)] !== NO_OFFSET) {
          plannedSlots++;
        }
      }
    }
    if (plannedSlots !== pending) {
      throw new Error(`${pending} slots are pending but open plans cover ${plannedSlots}`);
    }
    if (planned !== this.#inflightCopyBytes) {
      throw new Error(`in-flight copy bytes ${this.#inflightCopyBytes}, plans say ${planned}`);
    }
    ranges.sort((a, b) => a[0] - b[0]);
    let at = 0;
    for (const [off, len, who] of ranges) {
      if (off !== at) {
        throw new Error(
          off < at
            ? `pool overlap at byte ${off}: ${who} overlaps the previous range (ends at ${at})`
            : `pool leak: bytes [${at}, ${off}) are neither free nor owned`,
        );
      }
      at = off + len;
    }
    if (at !== this.allocator.capacityBytes) {
      throw new Error(`pool leak: bytes [${at}, ${this.allocator.capacityBytes}) unaccounted`);
    }
  }

  /** Counters and gauges for /metrics. */
  stats(): StoreStats {
    return {
      capacityBytes: this.allocator.capacityBytes,
      usedBytes: this.allocator.usedBytes,
      freeBytes: this.allocator.freeBytes,
      evictableBytes: this.#lru.evictableBytes,
      inflightCopyBytes: this.#inflightCopyBytes,
      largestFreeBytes: this.allocator.largestFreeBytes(),
      freeExtents: this.allocator.freeExtentCount,
      sealedBlocks: this.#index.sealedCount,
      inflightBlocks: this.#index.inflightCount,
      pinnedBlocks: this.#pinned,
      ...this.#c,
      admissionRejections: this.#lfu?.rejections ?? 0,
      leasesActive: this.#leases.size,
      transferLocksActive: this.#locks.size,
      loadsInflight: this.#loadsInflight,
    };
  }

  #ns(namespace: string, instance?: string): NamespaceState {
    const s = this.#namespaces.get(namespace);
    if (!s) {
      throw new InvalidArgumentError(
        `namespace ${namespace} has no layout: register the engine before saving or loading`,
        { namespace, instance },
      );
    }
    return s;
  }

  #layers(
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

  /**
   * Offset storage for a new block record, cut from the namespace's current slab:
   * the records of blocks created together sit side by side in memory, so a load
   * walking 625 of them streams through a few slabs instead of chasing 625
   * separately allocated buffers (cold after a 1.3 GB copy went through the caches).
   */
  #offsetRecord(ns: NamespaceState): Float64Array {
    const len = ns.layout.layers * ns.rankSlots * ns.layout.segments;
    if (ns.slab.used + len > ns.slab.buf.length) {
      ns.slab.buf = new Float64Array(len * OFFSET_SLAB_RECORDS);
      ns.slab.used = 0;
    }
    const r = ns.slab.buf.subarray(ns.slab.used, ns.slab.used + len);
    ns.slab.used += len;
    return r;
  }

  #pin(b: Block): void {
    if (b.pins === 0) this.#pinned++;
    this.#lru.pin(b);
  }

  #unpin(b: Block): void {
    this.#lru.unpin(b);
    if (b.pins === 0) this.#pinned--;
  }

  #unpinLease(l: Lease<Block>): void {
    for (const b of l.blocks) this.#unpin(b);
  }

  /** Evicts the LRU victim; false when nothing is evictable. */
  #evictOne(): boolean {
    return this.#evictBytes(1) > 0;
  }

  /**
   * Evicts LRU victims until at least `bytes` are freed or nothing is
   * evictable; returns the number of blocks evicted. Victims are freed as
   * merged runs: blocks saved together sit side by side in each slot's run
   * and leave the LRU in that order, so item j of victim k+1 usually starts
   * where item j of victim k ends. Freeing 625 blocks × 64 items then costs
   * ~64 allocator calls, not 40,000.
   */
  #evictBytes(bytes: number): number {
    let freed = 0;
    let evicted = 0;
    let runNs: NamespaceState | undefined;
    let runStart = new Float64Array(0);
    let runEnd = new Float64Array(0);
    const flush = () => {
      if (!runNs) return;
      const stride = runNs.strideBytes;
      for (let j = 0; j < runStart.length; j++) {
        if (runStart[j] === NO_OFFSET) continue;
        this.allocator.free(runStart[j], stride, (runEnd[j] - runStart[j]) / stride);
        runStart[j] = NO_OFFSET;
      }
    };
    while (freed < bytes) {
      const b = this.#lru.victim();
      if (!b) break;
      const ns = this.#ns(b.namespace);
      if (ns !== runNs) {
        flush();
        runNs = ns;
        runStart = new Float64Array(b.offsets.length).fill(NO_OFFSET);
        runEnd = new Float64Array(b.offsets.length);
      }
      const stride = ns.strideBytes;
      this.#lru.remove(b);
      for (let j = 0; j < b.offsets.length; j++) {
        const off = b.offsets[j];
        if (runStart[j] !== NO_OFFSET && off === runEnd[j]) {
          runEnd[j] += stride;
        } else if (runStart[j] !== NO_OFFSET && off + stride === runStart[j]) {
          runStart[j] = off;
        } else {
          if (runStart[j] !== NO_OFFSET) {
            this.allocator.free(runStart[j], stride, (runEnd[j] - runStart[j]) / stride);
          }
          runStart[j] = off;
          runEnd[j] = off + stride;
        }
        b.offsets[j] = NO_OFFSET;
      }
      b.slots.fill(SLOT_EMPTY);
      b.filled = 0;
      this.#index.remove(b);
      this.#recycle(b);
      freed += ns.blockBytes;
      evicted++;
      this.#c.evictions++;
      this.#c.evictedBytes += ns.blockBytes;
      this.#onEvict?.(b.namespace, b.hash);
    }
    flush();
    return evicted;
  }

  /** Frees an inflight block that has no copy in flight. */
  #dropInflight(b: Block): void {
    this.#freeSlots(b);
    this.#index.remove(b);
    this.#recycle(b);
  }

  /** Keeps a freed record (no slots, pins or links left) for the next new block. */
  #recycle(b: Block): void {
    const spare = this.#ns(b.namespace).spare;
    if (spare.length < SPARE_BLOCK_RECORDS) spare.push(b);
  }

  #freeSlots(b: Block): void {
    const S = b.layout.segments;
    for (let si = 0; si < b.slots.length; si++) {
      if (b.slots[si] !== SLOT_FILLED) continue;
      for (let seg = 0; seg < S; seg++) {
        this.allocator.free(b.offsets[si * S + seg], b.layout.segmentBytes);
        b.offsets[si * S + seg] = NO_OFFSET;
      }
      b.slots[si] = SLOT_EMPTY;
    }
    b.filled = 0;
  }
}

/** Checks what every query, save, fill and lock names: an instance id and a bounded hash count. */
function checkRequest(n: number, fields: { namespace: string; instance: string; rank?: number }) {
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
