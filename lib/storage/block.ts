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

/** Geometry of one namespace's blocks in the pool. */
export interface BlockLayout {
  /** Layers per block (all PP stages together; layer ids are the sorted layer names). */
  layers: number;
  /** TP size of the engines using this namespace. */
  tpSize: number;
  /** True for MLA: KV is identical on every TP rank and stored once (one rank slot). */
  collapseTp: boolean;
  /** Items per slot: 2 for K/V split, 1 for MLA or cross-layer blocks. */
  segments: number;
  /** Bytes of one item (one layer's K or V of one block on one rank). */
  segmentBytes: number;
}

/** Most layers / ranks / segments accepted: far above any model, low enough to catch garbage. */
export const MAX_LAYERS = 4096;
export const MAX_TP = 1024;
export const MAX_SEGMENTS = 8;

/** Checks a layout; throws {@link InvalidArgumentError} naming the bad field. */
export function validateLayout(namespace: string, l: BlockLayout): void {
  const ints: [keyof BlockLayout, number][] = [
    ["layers", MAX_LAYERS],
    ["tpSize", MAX_TP],
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

/** Cache class: saved or prefetched here (kept longer) vs fetched from a peer (evicted first). */
export type CacheClass = "retained" | "reclaimable";

/** Marker for "no pool offset" in offset arrays. */
export const NO_OFFSET = -1;

/**
 * One block. Fields are public for the storage modules (index, cache, store)
 * that maintain its invariants; the store's facade never hands it out mutable.
 */
export class Block {
  state: "inflight" | "sealed" = "inflight";
  /** SLOT_* per (layer, rank slot), index `layer * rankSlots + rankSlot`. */
  readonly slots: Uint8Array;
  /** Pool byte offset per (slot, segment), index `slot * segments + seg`; NO_OFFSET when none. */
  readonly offsets: Float64Array;
  filled = 0;
  pending = 0;
  /** Leases + in-flight loads + transfer locks holding this block. */
  pins = 0;
  cls: CacheClass = "retained";
  /** Instances that wrote slots while inflight (for cleanup on unregister). */
  writers: Set<string> | undefined;
  /** Intrusive LRU links (owned by cache.ts). */
  prev: Block | null = null;
  next: Block | null = null;
  linked = false;

  constructor(
    readonly key: string,
    readonly namespace: string,
    readonly hash: string,
    readonly layout: BlockLayout,
    readonly createdAt: number,
  ) {
    const n = layout.layers * rankSlots(layout);
    this.slots = new Uint8Array(n);
    this.offsets = new Float64Array(n * layout.segments).fill(NO_OFFSET);
  }

  /** Slots a sealed block holds. */
  get slotCount(): number {
    return this.slots.length;
  }

  /** Index of slot (layer, rankSlot). */
  slotIndex(layer: number, rankSlot: number): number {
    return layer * rankSlots(this.layout) + rankSlot;
  }
}

/**
 * All blocks by key, plus the inflight ones in creation order (so stale
 * collection scans only the old end).
 */
export class BlockIndex {
  readonly #blocks = new Map<string, Block>();
  readonly #inflight = new Map<string, Block>();
  #sealed = 0;

  /** Blocks of any state. */
  get size(): number {
    return this.#blocks.size;
  }

  /** Sealed blocks. */
  get sealedCount(): number {
    return this.#sealed;
  }

  /** Inflight blocks. */
  get inflightCount(): number {
    return this.#inflight.size;
  }

  get(key: string): Block | undefined {
    return this.#blocks.get(key);
  }

  /** Adds a new inflight block. */
  addInflight(b: Block): void {
    if (this.#blocks.has(b.key)) throw new Error(`block ${b.key} is already indexed`);
    this.#blocks.set(b.key, b);
    this.#inflight.set(b.key, b);
  }

  /** Moves an inflight block to sealed. */
  seal(b: Block): void {
    if (b.state !== "inflight") throw new Error(`block ${b.key} is already sealed`);
    b.state = "sealed";
    b.writers = undefined;
    this.#inflight.delete(b.key);
    this.#sealed++;
  }

  /** Drops a block of any state. */
  remove(b: Block): void {
    if (this.#blocks.get(b.key) !== b) return;
    this.#blocks.delete(b.key);
    if (b.state === "inflight") this.#inflight.delete(b.key);
    else this.#sealed--;
  }

  /** Inflight blocks, oldest first. */
  inflight(): IterableIterator<Block> {
    return this.#inflight.values();
  }

  /** Every block (any state). */
  all(): IterableIterator<Block> {
    return this.#blocks.values();
  }
}
