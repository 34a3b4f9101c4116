/**
 * Eviction and admission over sealed blocks.
 *
 * **LRU with pins taken out of the list.** A sealed block is in one of two
 * intrusive LRU lists (reclaimable — fetched from a peer — is evicted before
 * retained; the peer tier, lib/peer/, fills its blocks reclaimable) only while
 * nothing pins it. A lease, an in-flight load or a
 * transfer lock unlinks it; the last unpin links it back at the MRU end. So
 * the LRU tail is always evictable, eviction is O(1) per block, and a pinned
 * block can never be chosen — there is nothing to skip.
 *
 * **TinyLFU admission** (optional). When a save would have to evict, a new
 * block is admitted only if its estimated access frequency beats the LRU
 * victim's; a one-off scan cannot flush the hot set. Frequencies live in a
 * count-min sketch: 4 rows, 8-bit saturating counters, all halved after
 * 8 × capacity increments so old popularity fades.
 *
 * @module
 */

import type { Block, CacheClass } from "./block.ts";

/** An intrusive doubly linked list over blocks (head = most recent). */
class LruList {
  head: Block | null = null;
  tail: Block | null = null;
  size = 0;

  pushHead(b: Block): void {
    b.prev = null;
    b.next = this.head;
    if (this.head) this.head.prev = b;
    this.head = b;
    if (!this.tail) this.tail = b;
    this.size++;
  }

  unlink(b: Block): void {
    if (b.prev) b.prev.next = b.next;
    else this.head = b.next;
    if (b.next) b.next.prev = b.prev;
    else this.tail = b.prev;
    b.prev = b.next = null;
    this.size--;
  }
}

/**
 * LRU over unpinned sealed blocks, two classes.
 *
 * @example
 * ```ts
 * const lru = new LruCache((b) => blockBytes);
 * lru.insert(block); lru.pin(block); lru.victim(); // never `block` while pinned
 * ```
 */
export class LruCache {
  readonly #lists: Record<CacheClass, LruList> = {
    reclaimable: new LruList(),
    retained: new LruList(),
  };
  #evictableBytes = 0;

  constructor(readonly bytesOf: (b: Block) => number) {}

  /** Bytes of unpinned sealed blocks (what eviction could free). */
  get evictableBytes(): number {
    return this.#evictableBytes;
  }

  /** Unpinned sealed blocks. */
  get evictableCount(): number {
    return this.#lists.reclaimable.size + this.#lists.retained.size;
  }

  /** Adds a newly sealed block at the MRU end (or leaves it out while pinned). */
  insert(b: Block, cls: CacheClass = "retained"): void {
    b.cls = cls;
    if (b.pins === 0) this.#link(b);
  }

  /** Marks a hit: moves the block to the MRU end of its class. */
  touch(b: Block): void {
    if (!b.linked) return;
    this.#unlink(b);
    this.#link(b);
  }

  /** One more holder; the block leaves the LRU (cannot be evicted). */
  pin(b: Block): void {
    if (b.pins++ === 0 && b.linked) this.#unlink(b);
  }

  /** One holder fewer; at zero a sealed block rejoins the LRU at the MRU end. */
  unpin(b: Block): void {
    if (b.pins <= 0) throw new Error(`unpin of unpinned block ${b.key}`);
    if (--b.pins === 0 && b.state === "sealed") this.#link(b);
  }

  /** Takes a block out for good (evicted or dropped). */
  remove(b: Block): void {
    if (b.linked) this.#unlink(b);
  }

  /** The block eviction would take next: LRU of reclaimable, else LRU of retained. */
  victim(): Block | null {
    return this.#lists.reclaimable.tail ?? this.#lists.retained.tail;
  }

  #link(b: Block): void {
    this.#lists[b.cls].pushHead(b);
    b.linked = true;
    this.#evictableBytes += this.bytesOf(b);
  }

  #unlink(b: Block): void {
    this.#lists[b.cls].unlink(b);
    b.linked = false;
    this.#evictableBytes -= this.bytesOf(b);
  }
}

/** Rows of the count-min sketch (independent hash positions per key). */
export const SKETCH_DEPTH = 4;
/** Counters saturate here (8-bit). */
export const SKETCH_MAX = 255;
/** All counters are halved after this many increments per unit of capacity (TinyLFU's sample). */
export const SKETCH_RESET_FACTOR = 8;

/** 32-bit FNV-1a of a string: cheap, stable across processes. */
export function fnv1a32(s: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) {
    h ^= s.charCodeAt(i);
    h = Math.imul(h, 0x01000193);
  }
  return h >>> 0;
}

/** A sketch key's first hash: a string is hashed, a number already is its 32-bit hash. */
function keyHash(key: string | number): number {
  return typeof key === "number" ? key >>> 0 : fnv1a32(key);
}

/** A second, independent 32-bit mix (murmur3 finalizer) for double hashing. */
function mix32(h: number): number {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/**
 * Count-min sketch with 4 rows of 8-bit counters and periodic halving.
 *
 * @example
 * ```ts
 * const s = new CountMinSketch(1000);
 * s.increment("ns:ab"); s.estimate("ns:ab"); // 1
 * ```
 */
export class CountMinSketch {
  readonly width: number;
  readonly sampleSize: number;
  readonly #table: Uint8Array;
  #additions = 0;
  #resets = 0;

  constructor(capacity: number) {
    if (!Number.isSafeInteger(capacity) || capacity < 1) {
      throw new RangeError(`sketch capacity must be an integer ≥ 1, got ${capacity}`);
    }
    // Width: a power of two ≥ capacity keeps the error of each row near 1/capacity.
    this.width = 2 ** Math.max(4, Math.ceil(Math.log2(capacity)));
    this.sampleSize = SKETCH_RESET_FACTOR * capacity;
    this.#table = new Uint8Array(SKETCH_DEPTH * this.width);
  }

  /** Times the counters were halved. */
  get resets(): number {
    return this.#resets;
  }

  /** Records one access of `key` (a string, or an already-hashed 32-bit number). */
  increment(key: string | number): void {
    const h1 = keyHash(key);
    const h2 = mix32(h1) | 1;
    let added = false;
    for (let i = 0; i < SKETCH_DEPTH; i++) {
      const idx = this.#slot(h1, h2, i);
      if (this.#table[idx] < SKETCH_MAX) {
        this.#table[idx]++;
        added = true;
      }
    }
    if (added && ++this.#additions >= this.sampleSize) this.#halve();
  }

  /** Estimated accesses of `key` (never below the truth since the last halving, up to 255). */
  estimate(key: string | number): number {
    const h1 = keyHash(key);
    const h2 = mix32(h1) | 1;
    let min = SKETCH_MAX;
    for (let i = 0; i < SKETCH_DEPTH; i++) min = Math.min(min, this.#table[this.#slot(h1, h2, i)]);
    return min;
  }

  /**
   * The counter of `row` for a key hashed to (h1, h2): double hashing. One
   * formula for increment and estimate, so an estimate reads exactly the
   * counters the increments bumped.
   */
  #slot(h1: number, h2: number, row: number): number {
    return row * this.width + ((h1 + Math.imul(row, h2)) & (this.width - 1));
  }

  #halve(): void {
    for (let i = 0; i < this.#table.length; i++) this.#table[i] >>= 1;
    this.#additions = Math.floor(this.#additions / 2);
    this.#resets++;
  }
}

/**
 * TinyLFU's admission rule over a {@link CountMinSketch}.
 *
 * @example
 * ```ts
 * const lfu = new TinyLfu(10_000);
 * lfu.record(key);
 * if (!lfu.admit(key, victim.key)) rejected++;
 * ```
 */
export class TinyLfu {
  readonly sketch: CountMinSketch;
  #rejections = 0;

  constructor(capacityBlocks: number) {
    this.sketch = new CountMinSketch(capacityBlocks);
  }

  /** Admission rejections so far. */
  get rejections(): number {
    return this.#rejections;
  }

  /** Records an access (a query or a save of the key, or of its 32-bit hash). */
  record(key: string | number): void {
    this.sketch.increment(key);
  }

  /** True when `candidate` is more popular than `victim`; counts a rejection otherwise. */
  admit(candidate: string | number, victim: string | number): boolean {
    if (this.sketch.estimate(candidate) > this.sketch.estimate(victim)) return true;
    this.#rejections++;
    return false;
  }
}
