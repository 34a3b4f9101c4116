/**
 * The store's invariant checker ({@link KvStore.verify}): every invariant the
 * store relies on, checked from the records up, throwing an Error that names
 * the first violation. O(blocks × slots): for tests and a debug endpoint,
 * never the hot path.
 *
 * - pool bytes are partitioned exactly into free extents and owned slot
 *   items (no overlap, no leak); no free extent crosses a pool part (NUMA node);
 * - each block's pin count equals the leases, locks and loads holding it;
 *   pinned blocks are sealed and out of the LRU, unpinned sealed blocks are
 *   in it; evictable bytes and the pinned gauge add up;
 * - slot states agree with offsets and counts; a sealed block has every slot;
 *   a discarded block is inflight with copies still running and nothing filled,
 *   or sealed and pinned (its last unpin evicts it);
 * - every live run link matches the offsets (a load trusts it instead of
 *   reading the record);
 * - open plans cover exactly the pending slots and the in-flight bytes.
 *
 * @module
 */

import { type Block, NO_OFFSET, SLOT_EMPTY, SLOT_FILLED, SLOT_PENDING } from "./block.ts";
import { slotColumn } from "./offsets.ts";
import type { StoreState } from "./state.ts";

type Range = [offset: number, bytes: number, owner: string];

/** Throws naming the first broken invariant; returns when the store is consistent. */
export function verifyStore(st: StoreState): void {
  const ranges: Range[] = [];
  for (const [off, len] of st.allocator.freeExtents()) {
    const part = st.allocator.partOf(off);
    if (st.allocator.partOf(off + len - 1) !== part) {
      throw new Error(`free extent [${off}, +${len}) crosses the end of pool part ${part}`);
    }
    ranges.push([off, len, "free"]);
  }
  const pins = holders(st);
  let evictable = 0;
  let pinned = 0;
  let pending = 0;
  for (const b of st.index.all()) {
    const ns = st.namespaces.require(b.namespace);
    pending += checkSlots(b, ns.strideBytes, ranges);
    checkRunLink(st, b, ns.strideBytes);
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
    if (!st.index.has(b)) throw new Error(`a holder pins block ${b.key} that was freed`);
  }
  if (evictable !== st.lru.evictableBytes) {
    throw new Error(`evictable bytes ${st.lru.evictableBytes}, blocks say ${evictable}`);
  }
  if (pinned !== st.pinned) throw new Error(`pinned count ${st.pinned}, blocks say ${pinned}`);
  checkPlans(st, pending);
  checkPartition(ranges, st.allocator.capacityBytes);
}

/** How many holders (leases, locks, load tickets) pin each block. */
function holders(st: StoreState): Map<Block, number> {
  const pins = new Map<Block, number>();
  const count = (bs: readonly Block[]) => {
    for (const b of bs) pins.set(b, (pins.get(b) ?? 0) + 1);
  };
  for (const l of st.leases.all()) count(l.blocks);
  for (const l of st.locks.all()) count(l.blocks);
  for (const t of st.tickets) count(t.blocks);
  return pins;
}

/** Slot states against offsets and counts; adds owned items to `ranges`; returns pending slots. */
function checkSlots(b: Block, stride: number, ranges: Range[]): number {
  const S = b.layout.segments;
  let filled = 0;
  let pend = 0;
  for (let si = 0; si < b.slots.length; si++) {
    const st = b.slots[si];
    if (st === SLOT_FILLED) filled++;
    if (st === SLOT_PENDING) pend++;
    for (let seg = 0; seg < S; seg++) {
      const off = b.offsets[slotColumn(si, seg, S)];
      if ((st === SLOT_EMPTY) !== (off === NO_OFFSET)) {
        throw new Error(`block ${b.key} slot ${si}: state ${st} but offset ${off}`);
      }
      if (st !== SLOT_EMPTY) ranges.push([off, stride, b.key]);
    }
  }
  if (filled !== b.filled || pend !== b.pending) {
    throw new Error(
      `block ${b.key}: counts filled ${b.filled}/${filled} pending ${b.pending}/${pend}`,
    );
  }
  if (b.state === "sealed" && filled !== b.slotCount) {
    throw new Error(`block ${b.key} is sealed with ${filled}/${b.slotCount} slots`);
  }
  // A discarded block lives only until the copies running into it complete (inflight),
  // or until its last reader unpins it (sealed).
  if (
    b.discarded &&
    (b.state === "sealed" ? b.pins === 0 : filled !== 0 || pend === 0)
  ) {
    throw new Error(
      `discarded block ${b.key} is ${b.state}, filled ${filled}, pending ${pend}, pins ${b.pins}`,
    );
  }
  return pend;
}

/**
 * A valid run link to a live block is a promise consumeLease relies on instead
 * of reading offsets (a link to a freed record is never followed: a lease
 * only holds live blocks, and a recycled record has a new gen).
 */
function checkRunLink(st: StoreState, b: Block, stride: number): void {
  const p = b.runPrev;
  if (
    !p || p.gen !== b.runPrevGen || b.state !== "sealed" || p.state !== "sealed" ||
    !st.index.has(p)
  ) return;
  for (let j = 0; j < b.offsets.length; j++) {
    if (b.offsets[j] !== p.offsets[j] + stride) {
      throw new Error(
        `block ${b.key} is linked after ${p.key} but item ${j} is at ${b.offsets[j]}, ` +
          `not ${p.offsets[j]} + ${stride}`,
      );
    }
  }
}

/** Open plans cover exactly the pending slots and the bytes counted in flight. */
function checkPlans(st: StoreState, pending: number): void {
  let planned = 0;
  let plannedSlots = 0;
  for (const p of st.plans) {
    planned += p.poolBytes;
    const cols = p.layers.length * p.rankSlots.length;
    for (let c = 0; c < cols; c++) {
      for (let k = 0; k < p.blockCount; k++) {
        if (p.offsets[slotColumn(c, 0, p.segments) * p.blockCount + k] !== NO_OFFSET) {
          plannedSlots++;
        }
      }
    }
  }
  if (plannedSlots !== pending) {
    throw new Error(`${pending} slots are pending but open plans cover ${plannedSlots}`);
  }
  if (planned !== st.inflightCopyBytes) {
    throw new Error(`in-flight copy bytes ${st.inflightCopyBytes}, plans say ${planned}`);
  }
}

/** Free extents and owned items tile [0, capacity) with no overlap and no hole. */
function checkPartition(ranges: Range[], capacity: number): void {
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
  if (at !== capacity) throw new Error(`pool leak: bytes [${at}, ${capacity}) unaccounted`);
}
