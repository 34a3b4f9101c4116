/**
 * Freeing pool bytes: LRU eviction of sealed blocks (victims freed as merged
 * runs), one sealed block out of LRU order (a discard), and dropping inflight
 * blocks (failed, stale, orphaned or discarded saves).
 * Every freed record goes back to its namespace for reuse.
 *
 * @module
 */

import { type Block, NO_OFFSET, SLOT_EMPTY, SLOT_FILLED } from "./block.ts";
import type { NamespaceState } from "./namespaces.ts";
import { slotColumn } from "./offsets.ts";
import type { StoreState } from "./state.ts";

/**
 * Evicts LRU victims until at least `bytes` are freed or nothing is
 * evictable; returns the number of blocks evicted. Victims are freed as
 * merged runs: blocks saved together sit side by side in each slot's run
 * and leave the LRU in that order, so item j of victim k+1 usually starts
 * where item j of victim k ends. Freeing 625 blocks × 64 items then costs
 * ~64 allocator calls, not 40,000 — and one when their save placed its
 * columns back to back (lib/storage/save_plan.ts): touching runs are freed
 * together whenever a victim of another save breaks them.
 *
 * @example
 * ```ts
 * evictBytes(state, 2 << 20); // frees at least one 2 MiB block, if any is evictable
 * ```
 */
export function evictBytes(st: StoreState, bytes: number): number {
  let freed = 0;
  let evicted = 0;
  let runNs: NamespaceState | undefined;
  let runStart = new Float64Array(0);
  let runEnd = new Float64Array(0);
  const flush = () => {
    if (runNs) freeRuns(st, runNs.strideBytes, runStart, runEnd);
  };
  // A throwing onEvict stops here, but the runs taken so far are still freed.
  try {
    while (freed < bytes) {
      const b = st.lru.victim();
      if (!b) break;
      const ns = st.namespaces.require(b.namespace);
      if (ns !== runNs) {
        flush();
        runNs = ns;
        runStart = new Float64Array(b.offsets.length).fill(NO_OFFSET);
        runEnd = new Float64Array(b.offsets.length).fill(NO_OFFSET);
      }
      const stride = ns.strideBytes;
      st.lru.remove(b);
      // A victim of another save: free the runs so far together (they may touch).
      if (!continuesRuns(b.offsets, runStart, runEnd, stride)) flush();
      for (let j = 0; j < b.offsets.length; j++) {
        const off = b.offsets[j];
        if (runStart[j] === NO_OFFSET) {
          runStart[j] = off;
          runEnd[j] = off + stride;
        } else if (off === runEnd[j]) runEnd[j] += stride;
        else runStart[j] = off;
        b.offsets[j] = NO_OFFSET;
      }
      b.slots.fill(SLOT_EMPTY);
      b.filled = 0;
      st.index.remove(b);
      st.namespaces.recycle(b);
      freed += ns.blockBytes;
      evicted++;
      st.c.evictions++;
      st.c.evictedBytes += ns.blockBytes;
      st.onEvict?.(b.namespace, b.hash);
    }
  } finally {
    flush();
  }
  return evicted;
}

/** Whether every item of a victim at `offsets` extends its column's run (or starts one). */
function continuesRuns(
  offsets: Float64Array,
  starts: Float64Array,
  ends: Float64Array,
  stride: number,
): boolean {
  for (let j = 0; j < offsets.length; j++) {
    if (starts[j] !== NO_OFFSET && offsets[j] !== ends[j] && offsets[j] + stride !== starts[j]) {
      return false;
    }
  }
  return true;
}

/**
 * Frees the runs `[starts[j], ends[j])` (disjoint; NO_OFFSET where none) and
 * clears them. Runs that touch are freed as one: a save placed as one run
 * (lib/storage/save_plan.ts) has its columns back to back, so its blocks
 * leaving together free one run, not one per column. Disjoint intervals
 * sorted by start and by end pair up index by index, so the two sorted
 * copies give the runs in address order.
 */
function freeRuns(st: StoreState, stride: number, starts: Float64Array, ends: Float64Array): void {
  const s = starts.slice().sort();
  const e = ends.slice().sort();
  starts.fill(NO_OFFSET);
  ends.fill(NO_OFFSET);
  let i = 0;
  while (i < s.length && s[i] === NO_OFFSET) i++;
  while (i < s.length) {
    const from = s[i];
    while (i + 1 < s.length && e[i] === s[i + 1]) i++;
    st.allocator.free(from, stride, (e[i] - from) / stride);
    i++;
  }
}

/**
 * Whether evicting every evictable block could place `items` items of
 * `strideBytes` at all: the free extents and the evictable blocks' items,
 * joined where they touch within one pool part, counted in whole items
 * (what the allocator can take from them). With namespaces of different
 * item sizes, a hole between pinned items can stay too small however much
 * is evicted; a save that no eviction can place is then refused before the
 * cache is flushed for nothing. O(evictable items · log): only for the slow
 * path, after an allocation failed with the save's bytes already free.
 *
 * @example
 * ```ts
 * if (!evictionCanPlace(state, 8192, 64)) return refuse(); // evict nothing more
 * ```
 */
export function evictionCanPlace(st: StoreState, strideBytes: number, items: number): boolean {
  const ranges = st.allocator.freeExtents();
  for (const b of st.index.all()) {
    if (!b.linked) continue; // pinned or inflight: stays where it is
    const stride = st.namespaces.require(b.namespace).strideBytes;
    for (const off of b.offsets) ranges.push([off, stride]);
  }
  ranges.sort((x, y) => x[0] - y[0]);
  // An item never spans a part, and neither does a free extent: runs join within one part.
  let fit = 0;
  let start = -1;
  let end = -1;
  let part = -1;
  for (const [off, len] of ranges) {
    const p = st.allocator.partOf(off);
    if (off === end && p === part) {
      end += len;
      continue;
    }
    if (start >= 0) fit += Math.floor((end - start) / strideBytes);
    start = off;
    end = off + len;
    part = p;
  }
  if (start >= 0) fit += Math.floor((end - start) / strideBytes);
  return fit >= items;
}

/** Evicts the LRU victim; false when nothing is evictable. */
export function evictOne(st: StoreState): boolean {
  return evictBytes(st, 1) > 0;
}

/** Frees an inflight block that has no copy in flight. */
export function dropInflight(st: StoreState, b: Block): void {
  freeFilledSlots(st, b);
  st.index.remove(b);
  st.namespaces.recycle(b);
}

/** Frees every FILLED slot of an inflight block (PENDING ones are their copy's to complete). */
export function freeFilledSlots(st: StoreState, b: Block): void {
  const S = b.layout.segments;
  for (let si = 0; si < b.slots.length; si++) {
    if (b.slots[si] !== SLOT_FILLED) continue;
    for (let seg = 0; seg < S; seg++) {
      const j = slotColumn(si, seg, S);
      st.allocator.free(b.offsets[j], b.layout.segmentBytes);
      b.offsets[j] = NO_OFFSET;
    }
    b.slots[si] = SLOT_EMPTY;
  }
  b.filled = 0;
}

/**
 * Evicts one sealed, unpinned block out of LRU order (a discard names it):
 * freed item by item (a rare path), withdrawn through `onEvict` like any
 * evicted block. Throws for a pinned or inflight block (a store bug).
 */
export function evictSealed(st: StoreState, b: Block): void {
  if (b.state !== "sealed" || b.pins > 0) {
    throw new Error(`block ${b.key} is ${b.state} with ${b.pins} pins: not evictable`);
  }
  st.lru.remove(b);
  const bytes = b.layout.segmentBytes;
  for (let j = 0; j < b.offsets.length; j++) {
    st.allocator.free(b.offsets[j], bytes);
    b.offsets[j] = NO_OFFSET;
  }
  b.slots.fill(SLOT_EMPTY);
  b.filled = 0;
  st.index.remove(b);
  st.namespaces.recycle(b);
  st.onEvict?.(b.namespace, b.hash);
}
