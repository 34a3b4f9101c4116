/**
 * Allocator over the pinned pool's byte range `[0, capacity)` (the server adds
 * the pool's base address). TypeScript decides where bytes go; C only copies.
 *
 * Design: an offset allocator in fixed units (default 4 KiB, so every slot
 * starts on an O_DIRECT-friendly boundary) with coalescing free extents, and
 * **multi-extent allocations of whole items**:
 *
 * - A request is "`count` items of `itemBytes`" — one save's K (or V) of one
 *   layer for all its blocks. Items are laid out back to back at a stride of
 *   `itemBytes` rounded up to the unit, so a run of consecutive items is one
 *   contiguous byte range and the copy engine merges it into one long DMA.
 * - The allocator first looks for one free extent that holds all items
 *   (size-binned, good fit). Only when none exists does it split the items
 *   over several extents, largest first, so a fragmented pool still satisfies
 *   the request as long as enough whole-item holes exist. An allocation fails
 *   only when the free units cannot hold `count` items.
 * - Each item can be freed on its own (blocks are evicted one by one); freed
 *   ranges coalesce with their neighbours in O(1) through two boundary maps
 *   (start → length, end → start). A one-bit-per-unit map (1 MiB for 30 GiB
 *   at 4 KiB units) catches a double or partial free exactly.
 *
 * Why this meets "cannot fail while enough evictable bytes exist": all items
 * of one namespace have the same size, so every hole left by an evicted item
 * fits any new item of that namespace. Free units + evictable units ≥ needed
 * units therefore implies success after eviction. With several namespaces of
 * different item sizes a hole smaller than an item can remain; eviction then
 * continues until the items fit, or the save is refused (nothing leaks).
 *
 * **Parts** (NUMA, lib/numa.ts): the pool may be cut into consecutive parts,
 * one per NUMA node. Free extents never coalesce across a part boundary, and
 * `allocate(…, part)` places the items in that part when it can hold them,
 * else anywhere (a full node spills over rather than refusing the save).
 *
 * @module
 */

/** Default allocation unit: 4 KiB keeps every slot aligned for O_DIRECT SSD I/O. */
export const DEFAULT_UNIT_BYTES = 4096;

/** How many entries of the exact-size bin are scanned for a fit before moving up a bin. */
const EXACT_BIN_SCAN_LIMIT = 16;

/** A run of `items` consecutive items starting at byte `offset` of the pool. */
export interface Extent {
  readonly offset: number;
  readonly items: number;
}

/** Construction options of a {@link PoolAllocator}. */
export interface AllocatorOptions {
  /** Bytes managed (rounded down to whole units). */
  capacityBytes: number;
  /** Allocation unit, a power of two ≥ 512. Default {@link DEFAULT_UNIT_BYTES}. */
  unitBytes?: number;
  /**
   * Sizes of consecutive parts of the pool (NUMA nodes), each a multiple of
   * the unit; the last part also takes whatever the sizes leave. Default: one.
   */
  parts?: readonly number[];
}

/**
 * Offset allocator with coalescing free extents and multi-extent allocations.
 *
 * @example
 * ```ts
 * const a = new PoolAllocator({ capacityBytes: 1 << 30 });
 * const runs = a.allocate(64, 32 * 1024); // 64 K-segments of 32 KiB: one 2 MiB run when possible
 * for (const r of runs!) for (let i = 0; i < r.items; i++) a.free(r.offset + i * a.strideOf(32 * 1024), 32 * 1024);
 * ```
 */
export class PoolAllocator {
  readonly unitBytes: number;
  readonly capacityBytes: number;
  readonly #units: number;
  readonly #freeByStart = new Map<number, number>();
  readonly #freeByEnd = new Map<number, number>();
  /** bins[p][i]: starts of part p's free extents whose length in units is in [2^i, 2^(i+1)). */
  readonly #bins: Set<number>[][] = [];
  /** First unit of each part (ascending; [0] when the pool is one part). */
  readonly #partStart: number[] = [0];
  /** Free units per part. */
  readonly #partFree: number[];
  /** Every part's index, in order (no array per allocate call). */
  readonly #allParts: readonly number[];
  /** One bit per unit, set while allocated: exact double-free detection for 1 bit per 4 KiB. */
  readonly #used: Uint32Array;
  #freeUnits = 0;

  constructor(opts: AllocatorOptions) {
    const unit = opts.unitBytes ?? DEFAULT_UNIT_BYTES;
    if (!Number.isInteger(unit) || unit < 512 || (unit & (unit - 1)) !== 0) {
      throw new RangeError(`allocator unit must be a power of two ≥ 512 bytes, got ${unit}`);
    }
    if (!Number.isSafeInteger(opts.capacityBytes) || opts.capacityBytes < unit) {
      throw new RangeError(
        `allocator capacity must be an integer ≥ one unit (${unit} bytes), got ${opts.capacityBytes}`,
      );
    }
    this.unitBytes = unit;
    this.#units = Math.floor(opts.capacityBytes / unit);
    this.capacityBytes = this.#units * unit;
    this.#used = new Uint32Array(Math.ceil(this.#units / 32));
    let at = 0;
    for (const [i, bytes] of (opts.parts ?? []).slice(0, -1).entries()) {
      if (!Number.isSafeInteger(bytes) || bytes <= 0 || bytes % unit !== 0) {
        throw new RangeError(
          `allocator part ${i}: ${bytes} bytes is not a positive multiple of the unit ${unit}`,
        );
      }
      at += bytes / unit;
      if (at >= this.#units) {
        throw new RangeError(
          `allocator parts overrun the capacity of ${this.capacityBytes} bytes at part ${i}`,
        );
      }
      this.#partStart.push(at);
    }
    this.#partFree = this.#partStart.map(() => 0);
    this.#allParts = this.#partStart.map((_, p) => p);
    const nbins = Math.ceil(Math.log2(this.#units + 1)) + 1;
    for (let p = 0; p < this.#partStart.length; p++) {
      this.#bins.push(Array.from({ length: nbins }, () => new Set<number>()));
      this.#addFree(this.#partStart[p], this.#partEnd(p) - this.#partStart[p]);
    }
  }

  /** Number of parts (1 unless the pool is split across NUMA nodes). */
  get partCount(): number {
    return this.#partStart.length;
  }

  /** The part holding byte `offset`. */
  partOf(offset: number): number {
    return this.#partOfUnit(Math.floor(offset / this.unitBytes));
  }

  /** Free bytes of part `p`. */
  partFreeBytes(p: number): number {
    return (this.#partFree[p] ?? 0) * this.unitBytes;
  }

  /** Allocated bytes of each part, in part order. */
  partUsedBytes(): number[] {
    return this.#partStart.map((s, p) =>
      (this.#partEnd(p) - s - this.#partFree[p]) * this.unitBytes
    );
  }

  /** Bytes between the starts of consecutive items of `itemBytes` (rounded up to the unit). */
  strideOf(itemBytes: number): number {
    return this.#strideUnits(itemBytes) * this.unitBytes;
  }

  /** Free bytes now. */
  get freeBytes(): number {
    return this.#freeUnits * this.unitBytes;
  }

  /** Allocated bytes now. */
  get usedBytes(): number {
    return this.capacityBytes - this.freeBytes;
  }

  /** Number of free extents (a fragmentation measure). */
  get freeExtentCount(): number {
    return this.#freeByStart.size;
  }

  /** Bytes of the largest free extent. */
  largestFreeBytes(): number {
    let max = 0;
    for (const bins of this.#bins) {
      for (let b = bins.length - 1; b >= 0; b--) {
        if (bins[b].size === 0) continue;
        for (const s of bins[b]) max = Math.max(max, this.#freeByStart.get(s)!);
        break;
      }
    }
    return max * this.unitBytes;
  }

  /** Upper bound check without allocating: do the free units hold `count` items at all? */
  mightFit(count: number, itemBytes: number): boolean {
    return count * this.#strideUnits(itemBytes) <= this.#freeUnits;
  }

  /**
   * Allocates `count` items of `itemBytes`: one run when a free extent holds
   * them all, else several runs (largest extents first). With `part`, the
   * items go to that part when it can hold them, else anywhere. Returns null,
   * with nothing allocated, when the free extents cannot hold `count` whole
   * items.
   */
  allocate(count: number, itemBytes: number, part?: number): Extent[] | null {
    if (!Number.isSafeInteger(count) || count < 1) {
      throw new RangeError(`allocate: count must be an integer ≥ 1, got ${count}`);
    }
    const su = this.#strideUnits(itemBytes);
    if (count * su > this.#freeUnits) return null;
    const all = this.#allParts;
    const mine = this.#partsOf(part);
    if (mine === all) return this.#allocateIn(all, count, su);
    return this.#allocateIn(mine, count, su) ??
      this.#allocateIn([part!, ...all.filter((p) => p !== part)], count, su);
  }

  /**
   * `count` items of `itemBytes` as ONE run, or null with nothing allocated
   * when no free extent holds them all (never split: the caller then
   * allocates piece by piece). With `part`, only that part's extents: a run
   * that does not fit there is not spilled whole into another part (piece
   * by piece, {@link allocate} keeps what fits in the part there).
   * Returns the run's byte offset; item i starts at `offset + i * strideOf(itemBytes)`.
   */
  allocateRun(count: number, itemBytes: number, part?: number): number | null {
    if (!Number.isSafeInteger(count) || count < 1) {
      throw new RangeError(`allocateRun: count must be an integer ≥ 1, got ${count}`);
    }
    const need = count * this.#strideUnits(itemBytes);
    if (need > this.#freeUnits) return null;
    const start = this.#carveFit(this.#partsOf(part), need);
    return start === undefined ? null : start * this.unitBytes;
  }

  /** The parts `part` names: `[part]`, or every part when it names none (or there is one). */
  #partsOf(part: number | undefined): readonly number[] {
    const all = this.#allParts;
    return part === undefined || all.length === 1 || !(part in this.#partFree) ? all : [part];
  }

  /** Carves `need` units from the first single free extent that holds them, in `parts` order. */
  #carveFit(parts: readonly number[], need: number): number | undefined {
    for (const p of parts) {
      const start = this.#findFit(need, p);
      if (start !== undefined) {
        this.#carve(start, need);
        return start;
      }
    }
    return undefined;
  }

  /** {@link allocate} over the parts `parts` (in preference order). */
  #allocateIn(parts: readonly number[], count: number, su: number): Extent[] | null {
    const need = count * su;
    let free = 0;
    for (const p of parts) free += this.#partFree[p];
    if (need > free) return null;
    const single = this.#carveFit(parts, need);
    if (single !== undefined) return [{ offset: single * this.unitBytes, items: count }];
    // No single extent fits: gather whole-item pieces from the largest extents down.
    const picks: number[] = [];
    const takes: number[] = [];
    let remaining = count;
    for (const p of parts) {
      const bins = this.#bins[p];
      for (let b = bins.length - 1; b >= 0 && remaining > 0; b--) {
        if (2 ** (b + 1) <= su) break; // every extent in this bin and below is shorter than one item
        for (const start of bins[b]) {
          const fit = Math.floor(this.#freeByStart.get(start)! / su);
          if (fit === 0) continue;
          const take = Math.min(fit, remaining);
          picks.push(start);
          takes.push(take);
          remaining -= take;
          if (remaining === 0) break;
        }
      }
    }
    if (remaining > 0) return null;
    const out: Extent[] = [];
    for (let i = 0; i < picks.length; i++) {
      this.#carve(picks[i], takes[i] * su);
      out.push({ offset: picks[i] * this.unitBytes, items: takes[i] });
    }
    return out;
  }

  /**
   * Frees `items` consecutive items of `itemBytes` starting at byte `offset`
   * (one item by default). Coalesces with free neighbours.
   * Throws on a misaligned, out-of-range or already-free range (a caller bug).
   */
  free(offset: number, itemBytes: number, items = 1): void {
    const su = this.#strideUnits(itemBytes);
    const n = su * items;
    const start = offset / this.unitBytes;
    if (!Number.isInteger(start) || start < 0 || start + n > this.#units || n < 1) {
      throw new RangeError(
        `free: range [${offset}, +${n * this.unitBytes}) is misaligned or outside the pool ` +
          `(capacity ${this.capacityBytes}, unit ${this.unitBytes})`,
      );
    }
    if (!this.#allUsed(start, n)) {
      throw new RangeError(
        `free: range at ${offset} (+${n * this.unitBytes}) is already free, in part or whole`,
      );
    }
    this.#mark(start, n, false);
    // A run of items may span parts (eviction frees neighbouring victims as one
    // run): each part's piece becomes a free extent of that part.
    for (let s = start; s < start + n;) {
      const end = Math.min(start + n, this.#partEnd(this.#partOfUnit(s)));
      this.#release(s, end - s);
      s = end;
    }
  }

  /** Makes units [start, start+n) of one part free, coalescing with that part's free neighbours. */
  #release(start: number, n: number): void {
    let s = start;
    let len = n;
    // Neighbours across a part boundary stay apart (an extent is one node's memory).
    const leftStart = this.#isPartStart(s) ? undefined : this.#freeByEnd.get(s);
    if (leftStart !== undefined) {
      len += this.#freeByStart.get(leftStart)!;
      this.#removeFree(leftStart);
      s = leftStart;
    }
    const rightLen = this.#isPartStart(start + n) ? undefined : this.#freeByStart.get(start + n);
    if (rightLen !== undefined) {
      this.#removeFree(start + n);
      len += rightLen;
    }
    this.#addFree(s, len);
  }

  /** Free extents as sorted `[offsetBytes, bytes]` pairs (for tests and debugging). */
  freeExtents(): [number, number][] {
    return [...this.#freeByStart].sort((a, b) => a[0] - b[0]).map((
      [s, l],
    ) => [s * this.unitBytes, l * this.unitBytes]);
  }

  #strideUnits(itemBytes: number): number {
    if (!Number.isSafeInteger(itemBytes) || itemBytes < 1) {
      throw new RangeError(`item size must be a positive integer of bytes, got ${itemBytes}`);
    }
    return Math.ceil(itemBytes / this.unitBytes);
  }

  /** Start of a free extent of part p of ≥ `need` units, preferring the smallest bin; undefined if none. */
  #findFit(need: number, p: number): number | undefined {
    const bins = this.#bins[p];
    const b0 = Math.floor(Math.log2(need));
    if (b0 >= bins.length) return undefined;
    let scanned = 0;
    for (const start of bins[b0]) {
      if (this.#freeByStart.get(start)! >= need) return start;
      if (++scanned >= EXACT_BIN_SCAN_LIMIT) break;
    }
    for (let b = b0 + 1; b < bins.length; b++) {
      if (bins[b].size === 0) continue; // no iterator for an empty bin (most of them)
      return bins[b].values().next().value;
    }
    return undefined;
  }

  #partEnd(p: number): number {
    return p + 1 < this.#partStart.length ? this.#partStart[p + 1] : this.#units;
  }

  #isPartStart(unit: number): boolean {
    if (this.#partStart.length === 1) return false;
    return this.#partStart.includes(unit);
  }

  #partOfUnit(unit: number): number {
    let p = 0;
    while (p + 1 < this.#partStart.length && this.#partStart[p + 1] <= unit) p++;
    return p;
  }

  /**
   * Takes `n` units from the front of the free extent at `start`. The rest
   * keeps its end, so only its start moves: the same maps and bins as
   * {@link #removeFree} then {@link #addFree}, without their churn.
   *
   * The new start is added before the old one is deleted (the same contents
   * and insertion order either way): a delete that empties a Map or Set makes
   * V8 shrink it, a runtime call that allocates a new table. With one free
   * extent (a pool with room) every carve emptied `#freeByStart` and its bin;
   * in the server those tables live in the old generation, where each new one
   * is allocated too (page faults, garbage until the next mark-compact). Added
   * first, a table is rebuilt only when its deleted entries fill it.
   */
  #carve(start: number, n: number): void {
    const len = this.#freeByStart.get(start)!;
    if (len === n) this.#removeFree(start);
    else {
      const p = this.#partOfUnit(start);
      const bins = this.#bins[p];
      this.#freeByStart.set(start + n, len - n);
      this.#freeByStart.delete(start);
      this.#freeByEnd.set(start + len, start + n);
      bins[Math.floor(Math.log2(len - n))].add(start + n);
      bins[Math.floor(Math.log2(len))].delete(start);
      this.#freeUnits -= n;
      this.#partFree[p] -= n;
    }
    this.#mark(start, n, true);
  }

  /** Sets or clears the bits of units [start, start+n): whole 32-bit words in the middle. */
  #mark(start: number, n: number, used: boolean): void {
    const end = start + n;
    let u = start;
    for (; u < end && (u & 31) !== 0; u++) this.#bit(u, used);
    const word = used ? 0xffffffff : 0;
    for (; u + 32 <= end; u += 32) this.#used[u >>> 5] = word;
    for (; u < end; u++) this.#bit(u, used);
  }

  #bit(u: number, used: boolean): void {
    if (used) this.#used[u >>> 5] |= 1 << (u & 31);
    else this.#used[u >>> 5] &= ~(1 << (u & 31));
  }

  #allUsed(start: number, n: number): boolean {
    const end = start + n;
    let u = start;
    for (; u < end && (u & 31) !== 0; u++) {
      if ((this.#used[u >>> 5] & (1 << (u & 31))) === 0) return false;
    }
    for (; u + 32 <= end; u += 32) if (this.#used[u >>> 5] !== 0xffffffff) return false;
    for (; u < end; u++) {
      if ((this.#used[u >>> 5] & (1 << (u & 31))) === 0) return false;
    }
    return true;
  }

  #addFree(start: number, len: number): void {
    const p = this.#partOfUnit(start);
    this.#freeByStart.set(start, len);
    this.#freeByEnd.set(start + len, start);
    this.#bins[p][Math.floor(Math.log2(len))].add(start);
    this.#freeUnits += len;
    this.#partFree[p] += len;
  }

  #removeFree(start: number): void {
    const p = this.#partOfUnit(start);
    const len = this.#freeByStart.get(start)!;
    this.#freeByStart.delete(start);
    this.#freeByEnd.delete(start + len);
    this.#bins[p][Math.floor(Math.log2(len))].delete(start);
    this.#freeUnits -= len;
    this.#partFree[p] -= len;
  }
}
