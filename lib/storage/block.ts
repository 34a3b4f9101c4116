/**
 * Block records and the index that holds them. A block is one engine block's
 * KV for every layer and every TP rank of a namespace; it lives in the pinned
 * pool as `layers × ranks` slots of `segments` items each (K and V for a
 * K/V-split layout, one item for MLA or cross-layer blocks).
 *
 * Lifecycle: **inflight** (slots arriving; invisible to queries; collected
 * when older than a TTL with no copy in flight) → **sealed** (every slot
 * filled; served, cached, evictable when unpinned). A slot is EMPTY, PENDING
 * (a copy into it is in flight) or FILLED; a duplicate save of a slot that is
 * PENDING or FILLED is a no-op.
 *
 * @module
 */

import { InvalidArgumentError } from "./errors.ts";
import { type BlockHash, hexBytesInto } from "./keys.ts";
import {
  MAX_BLOCK_ITEMS,
  MAX_HASH_BYTES,
  MAX_LAYERS,
  MAX_PARALLEL,
  MAX_SEGMENTS,
} from "../limits.ts";
import type { LayoutIdentity } from "./layout.ts";
import { slotIndex } from "./offsets.ts";

/** Geometry of one namespace's blocks in the pool. */
export interface BlockLayout {
  /** Layers per block (all PP stages together; ids in the namespace's registration order, lib/engine/namespaces.ts). */
  layers: number;
  /** TP size of the engines using this namespace. */
  tpSize: number;
  /** True for MLA: KV is identical on every TP rank and stored once (one rank slot). */
  collapseTp: boolean;
  /** Items per slot: 2 for K/V split, 1 for MLA or cross-layer blocks. */
  segments: number;
  /** Bytes of one item (one layer's K or V of one block on one rank). */
  segmentBytes: number;
  /**
   * The full layout's identity (layout.ts): set by the engine, stored with
   * every block kept beyond this process (SSD) so only this layout reads it.
   */
  identity?: LayoutIdentity;
}

/** Checks a layout; throws {@link InvalidArgumentError} naming the bad field. */
export function validateLayout(namespace: string, l: BlockLayout): void {
  const ints: [keyof BlockLayout, number][] = [
    ["layers", MAX_LAYERS],
    ["tpSize", MAX_PARALLEL],
    ["segments", MAX_SEGMENTS],
    ["segmentBytes", Number.MAX_SAFE_INTEGER],
  ];
  for (const [f, max] of ints) {
    const v = l[f] as number;
    if (!Number.isSafeInteger(v) || v < 1 || v > max) {
      throw new InvalidArgumentError(`layout of namespace ${namespace}: ${f} must be 1..${max}`, {
        namespace,
        expected: `1..${max}`,
        got: String(v),
      });
    }
  }
  if (typeof l.collapseTp !== "boolean") {
    throw new InvalidArgumentError(`layout of namespace ${namespace}: collapseTp must be boolean`, {
      namespace,
      got: String(l.collapseTp),
    });
  }
  const items = l.layers * rankSlots(l) * l.segments;
  if (items > MAX_BLOCK_ITEMS) {
    throw new InvalidArgumentError(
      `layout of namespace ${namespace}: ${l.layers} layers × ${rankSlots(l)} rank slots × ` +
        `${l.segments} segments = ${items} items per block, at most ${MAX_BLOCK_ITEMS}`,
      { namespace, expected: `≤ ${MAX_BLOCK_ITEMS}`, got: String(items) },
    );
  }
}

/** Rank slots per layer: 1 when TP is collapsed (MLA). */
export function rankSlots(l: BlockLayout): number {
  return l.collapseTp ? 1 : l.tpSize;
}

/** Slot state: nothing there. */
export const SLOT_EMPTY = 0;
/** Slot state: a copy into it is in flight. */
export const SLOT_PENDING = 1;
/** Slot state: holds its bytes. */
export const SLOT_FILLED = 2;

/**
 * Cache class: saved or prefetched here (kept longer) vs fetched from a peer
 * (evicted first): the peer tier (lib/peer/) fills its blocks "reclaimable".
 */
export type CacheClass = "retained" | "reclaimable";

/** Marker for "no pool offset" in offset arrays. */
export const NO_OFFSET = -1;

/** Marker for "no checksum recorded yet" (a CRC32C is 0..2^32-1). */
export const NO_CHECKSUM = -1;

/**
 * One block. Fields are public for the storage modules (index, cache, store)
 * that maintain its invariants; the store's facade never hands it out mutable.
 */
export class Block {
  state: "inflight" | "sealed" = "inflight";
  /** SLOT_* per (layer, rank slot), index `layer * rankSlots + rankSlot`. */
  readonly slots: Uint8Array;
  /**
   * Pool byte offset per (slot, segment), index `slot * segments + seg`; NO_OFFSET when none.
   * The store carves these out of shared slabs (see the constructor's `offsets`).
   */
  readonly offsets: Float64Array;
  filled = 0;
  pending = 0;
  /** Leases + in-flight loads + transfer locks holding this block. */
  pins = 0;
  cls: CacheClass = "retained";
  /**
   * CRC32C of the sealed block's payload in payload order (lib/storage/tier.ts),
   * or {@link NO_CHECKSUM}: recorded once after the seal (the peer tier computes
   * it in one native call per batch) and carried in a transfer lock, so a peer
   * that reads the block can verify it.
   */
  checksum = NO_CHECKSUM;
  /**
   * The instance that last wrote slots while inflight. When it unregisters
   * the partial block is freed; if another (live) instance wrote after it,
   * that one may still complete the block, and the inflight TTL covers the rest.
   */
  lastWriter: string | undefined;
  /**
   * A discard named this inflight block while copies still ran into it
   * (lib/storage/discard.ts): its filled slots are freed, no save or fill
   * plans into it, and the running copies complete as failed, freeing it.
   */
  discarded = false;
  /** Next block of the same index bucket (owned by BlockIndex). */
  chainNext: Block | null = null;
  /** Intrusive LRU links (owned by cache.ts). */
  prev: Block | null = null;
  next: Block | null = null;
  linked = false;
  /** Bumped each time the record is recycled for another block. */
  gen = 0;
  /**
   * The block saved right before this one in the same save when every one of
   * this block's items sits exactly one item stride after that block's
   * (valid while `runPrev.gen === runPrevGen`). A load then computes this
   * block's offsets from its predecessor's instead of reading its record.
   */
  runPrev: Block | null = null;
  runPrevGen = 0;

  /** `namespace:hash`, for logs and completion reports. */
  key: string;
  /** Content hash, lower-case hex. */
  hash: string;
  /**
   * The same hash as bytes (first `hashLength`): a lookup with the engine's bytes
   * compares bytes, not 64 hex digits decoded one by one.
   */
  readonly hashBytes = new Uint8Array(MAX_HASH_BYTES);
  hashLength = 0;
  createdAt: number;
  /** {@link hashBucket} of the hash under the namespace's seed. */
  bucket: number;

  constructor(
    key: string,
    readonly namespace: string,
    hash: string,
    readonly layout: BlockLayout,
    createdAt: number,
    bucket: number,
    offsets?: Float64Array,
    hashBytes?: Uint8Array,
  ) {
    this.key = key;
    this.hash = hash;
    this.hashLength = this.#setHashBytes(hash, hashBytes);
    this.createdAt = createdAt;
    this.bucket = bucket;
    const n = layout.layers * rankSlots(layout);
    this.slots = new Uint8Array(n);
    if (offsets && offsets.length !== n * layout.segments) {
      throw new RangeError(
        `block ${key}: offset storage holds ${offsets.length} entries, expected ${
          n * layout.segments
        }`,
      );
    }
    this.offsets = (offsets ?? new Float64Array(n * layout.segments)).fill(NO_OFFSET);
  }

  /**
   * Makes a freed record hold a new block of the same namespace. The store
   * recycles records so that a full pool's save/evict churn allocates
   * nothing per block. Throws if the record still holds anything (a store
   * bug, never bad input): a recycled record must never carry old bytes.
   */
  recycle(
    key: string,
    hash: string,
    createdAt: number,
    bucket: number,
    hashBytes?: Uint8Array,
  ): void {
    let clean = this.pins === 0 && this.pending === 0 && this.filled === 0 && !this.linked &&
      this.chainNext === null;
    for (let i = 0; clean && i < this.slots.length; i++) clean = this.slots[i] === SLOT_EMPTY;
    for (let i = 0; clean && i < this.offsets.length; i++) clean = this.offsets[i] === NO_OFFSET;
    if (!clean) throw new Error(`block record ${this.key} recycled while still in use`);
    this.key = key;
    this.hash = hash;
    this.hashLength = this.#setHashBytes(hash, hashBytes);
    this.createdAt = createdAt;
    this.bucket = bucket;
    this.gen++;
    this.runPrev = null;
    this.runPrevGen = 0;
    this.state = "inflight";
    this.cls = "retained";
    this.checksum = NO_CHECKSUM;
    this.lastWriter = undefined;
    this.discarded = false;
  }

  /** Stores the hash's bytes: copied when the caller has them (`hex` is their hex), else decoded. */
  #setHashBytes(hex: string, bytes: Uint8Array | undefined): number {
    if (!bytes) return hexBytesInto(hex, this.hashBytes);
    this.hashBytes.set(bytes);
    return bytes.length;
  }

  /** True when this block's content hash is `hash` (bytes, or lower-case hex). */
  hashIs(hash: BlockHash): boolean {
    if (typeof hash === "string") return hash === this.hash;
    if (hash.length !== this.hashLength) return false;
    const mine = this.hashBytes;
    for (let i = 0; i < hash.length; i++) if (hash[i] !== mine[i]) return false;
    return true;
  }

  /** Slots a sealed block holds. */
  get slotCount(): number {
    return this.slots.length;
  }

  /** Index of slot (layer, rankSlot). */
  slotIndex(layer: number, rankSlot: number): number {
    return slotIndex(layer, rankSlot, rankSlots(this.layout));
  }
}

/**
 * All blocks, found by (namespace, numeric hash bucket) with collisions
 * chained through `chainNext`, plus the inflight ones in creation order (so
 * stale collection scans only the old end).
 */
export class BlockIndex {
  readonly #byNamespace = new Map<string, Map<number, Block>>();
  readonly #inflight = new Set<Block>();
  #size = 0;
  #sealed = 0;

  /** Blocks of any state. */
  get size(): number {
    return this.#size;
  }

  /** Sealed blocks. */
  get sealedCount(): number {
    return this.#sealed;
  }

  /** Inflight blocks. */
  get inflightCount(): number {
    return this.#inflight.size;
  }

  /** The block of `hash` in `namespace` (bucket = hashBucket(hash, seed)), or undefined. */
  find(namespace: string, hash: BlockHash, bucket: number): Block | undefined {
    return BlockIndex.findIn(this.#byNamespace.get(namespace), hash, bucket);
  }

  /** The buckets of one namespace, for many lookups with {@link BlockIndex.findIn}. */
  buckets(namespace: string): ReadonlyMap<number, Block> | undefined {
    return this.#byNamespace.get(namespace);
  }

  /** {@link BlockIndex.find} in buckets already resolved by {@link BlockIndex.buckets}. */
  static findIn(
    buckets: ReadonlyMap<number, Block> | undefined,
    hash: BlockHash,
    bucket: number,
  ): Block | undefined {
    let b = buckets?.get(bucket);
    while (b && !b.hashIs(hash)) b = b.chainNext ?? undefined;
    return b;
  }

  /** True when this very block is indexed. */
  has(b: Block): boolean {
    for (
      let x = this.#byNamespace.get(b.namespace)?.get(b.bucket);
      x;
      x = x.chainNext ?? undefined
    ) {
      if (x === b) return true;
    }
    return false;
  }

  /** Adds a new inflight block. */
  addInflight(b: Block): void {
    if (this.find(b.namespace, b.hash, b.bucket)) {
      throw new Error(`block ${b.key} is already indexed`);
    }
    let m = this.#byNamespace.get(b.namespace);
    if (!m) this.#byNamespace.set(b.namespace, m = new Map());
    b.chainNext = m.get(b.bucket) ?? null;
    m.set(b.bucket, b);
    this.#inflight.add(b);
    this.#size++;
  }

  /** Moves an inflight block to sealed. */
  seal(b: Block): void {
    if (b.state !== "inflight") throw new Error(`block ${b.key} is already sealed`);
    b.state = "sealed";
    b.lastWriter = undefined;
    this.#inflight.delete(b);
    this.#sealed++;
  }

  /** Drops a block of any state (no-op when it is not indexed). */
  remove(b: Block): void {
    const m = this.#byNamespace.get(b.namespace);
    let prev: Block | null = null;
    for (let x = m?.get(b.bucket) ?? null; x; prev = x, x = x.chainNext) {
      if (x !== b) continue;
      if (prev) prev.chainNext = b.chainNext;
      else if (b.chainNext) m!.set(b.bucket, b.chainNext);
      else m!.delete(b.bucket);
      b.chainNext = null;
      this.#size--;
      if (b.state === "inflight") this.#inflight.delete(b);
      else this.#sealed--;
      return;
    }
  }

  /** Inflight blocks, oldest first. */
  inflight(): IterableIterator<Block> {
    return this.#inflight.values();
  }

  /** Every block (any state). */
  *all(): IterableIterator<Block> {
    for (const m of this.#byNamespace.values()) {
      for (const head of m.values()) {
        for (let b: Block | null = head; b; b = b.chainNext) yield b;
      }
    }
  }
}
