/**
 * Save planning: where a save (or a whole-block fill) copies to, in named
 * steps, each a function over the store's state:
 *
 *   columns → dedup → fitRoom → admit → allocate (evicting) → createBlocks → record
 *
 * - **dedup**, **fitRoom**, **admit** (lib/storage/save_candidates.ts): which
 *   hashes still need bytes (none a recent discard named), and how many of
 *   them the pool takes;
 * - **allocate**: evict until the bytes are free, then one run for the whole
 *   plan when its blocks need every column and one free extent holds them,
 *   else one allocation per (column, segment) for all blocks; fragmentation
 *   across namespaces keeps evicting until the items fit, or rolls back and
 *   refuses (at once, with nothing more evicted, when no eviction could place
 *   them);
 * - **createBlocks**: new (or recycled) block records, slots marked PENDING,
 *   offsets recorded, run links between consecutive new blocks.
 *
 * Per-block work is flat typed-array loops; no per-block arrays.
 *
 * @module
 */

import { Block, type CacheClass, NO_OFFSET, SLOT_PENDING } from "./block.ts";
import { InvalidArgumentError, PoolExhaustedError } from "./errors.ts";
import type { BlockHash } from "./keys.ts";
import type { NamespaceState } from "./namespaces.ts";
import { evictBytes, evictionCanPlace, evictOne } from "./eviction.ts";
import { slotColumn, slotIndex } from "./offsets.ts";
import { checkRequest, layerList, type StoreState } from "./state.ts";
import { admit, type Candidates, dedup, fitRoom, type PlanTarget } from "./save_candidates.ts";

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
  /** Cache class when sealed; "reclaimable" for blocks fetched from a peer. Default "retained". */
  cacheClass?: CacheClass;
  /**
   * The pool part (NUMA node) the saving device copies to fastest; the bytes
   * go there when it has room, else anywhere. Default: any part.
   */
  poolPart?: number;
  /**
   * A second pass over the riders of this request's first plan (`SavePlan.riders`),
   * once the copies they rode on settled: their accesses and dedups were counted
   * then; a rider that needs its own copy now is no longer counted as deduplicated.
   */
  again?: boolean;
}

/** A whole-block fill (SSD prefetch, peer fetch): every layer and rank slot of each block. */
export interface FillRequest {
  namespace: string;
  /** Who fills (e.g. `"ssd"` or the peer's node id); recorded for cleanup like an instance. */
  instance: string;
  hashes: readonly BlockHash[];
  /** Default "retained" (SSD); use "reclaimable" for blocks fetched from a peer. */
  cacheClass?: CacheClass;
}

/**
 * Where a save copies to. The plan covers `layers × rankSlots` slot columns
 * (one rank slot for an engine Save; every rank slot for a whole-block fill
 * from SSD or a peer). Offsets are column-major (lib/storage/offsets.ts) so
 * one layer's blocks are adjacent and merge into long DMA ranges:
 *
 * `offsets[offsetIndex(plan, li, ri, seg, b, rankSlots.length)]`
 *   `= offsets[((li * rankSlots.length + ri) * segments + seg) * blockCount + b]`
 *
 * is the pool byte offset of planned block `b`, layer `layers[li]`, rank slot
 * `rankSlots[ri]`, segment `seg` — or -1 when that slot is already held or in
 * flight (a duplicate) and must not be copied.
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
  /**
   * Hashes refused because a discard named them less than `DISCARD_TTL_MS`
   * ago, or their block is being discarded (lib/storage/discard.ts).
   */
  readonly discarded: number;
  /**
   * Request indexes (into `hashes`) of deduplicated hashes whose missing slots another
   * copy is writing (PENDING): counted in `deduplicated`, they land only if that copy
   * does. Plan them again (`again: true`) once it settled. Usually empty.
   */
  readonly riders: Int32Array;
}

/** The answer to {@link KvStore.beginSave}. */
export type SaveBegin =
  | { readonly ok: true; readonly plan: SavePlan }
  | { readonly ok: false; readonly error: PoolExhaustedError };

/** Internal form of a plan: the public fields plus the blocks, for completion. */
export interface PlanRecord extends SavePlan {
  readonly blocks: Block[];
  readonly cacheClass: CacheClass;
  /** Pool bytes reserved (items rounded up to the unit). */
  readonly poolBytes: number;
  settled: boolean;
}

/** The riders of a plan that has none (most): one shared empty list. */
const NO_RIDERS = new Int32Array(0);

/** Plans an engine Save of one rank (see {@link KvStore.beginSave}). */
export function planSave(st: StoreState, req: SaveRequest): SaveBegin {
  const { namespace, instance } = req;
  const ns = st.namespaces.require(namespace, instance);
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
  const layers = layerList(namespace, instance, L, req.layers, req.rank);
  const rankSlot = L.collapseTp ? 0 : req.rank;
  const target = planTarget(ns, namespace, instance, req.rank, layers, [rankSlot], req.cacheClass);
  return plan(st, { ...target, part: req.poolPart, again: req.again }, req.hashes);
}

/** Plans a whole-block fill (see {@link KvStore.beginFill}). */
export function planFill(st: StoreState, req: FillRequest): SaveBegin {
  const ns = st.namespaces.require(req.namespace, req.instance);
  checkRequest(req.hashes.length, { namespace: req.namespace, instance: req.instance });
  const layers = Array.from({ length: ns.layout.layers }, (_, i) => i);
  const ranks = Array.from({ length: ns.rankSlots }, (_, i) => i);
  const target = planTarget(ns, req.namespace, req.instance, -1, layers, ranks, req.cacheClass);
  return plan(st, target, req.hashes);
}

function planTarget(
  ns: NamespaceState,
  namespace: string,
  instance: string,
  rank: number,
  layers: number[],
  rankSlotList: number[],
  cacheClass: CacheClass = "retained",
): PlanTarget {
  const R = rankSlotList.length;
  const colSlot = new Int32Array(layers.length * R);
  for (let li = 0; li < layers.length; li++) {
    for (let ri = 0; ri < R; ri++) {
      colSlot[li * R + ri] = slotIndex(layers[li], rankSlotList[ri], ns.rankSlots);
    }
  }
  return { ns, namespace, instance, rank, layers, rankSlotList, colSlot, cacheClass };
}

function plan(st: StoreState, t: PlanTarget, hashes: readonly BlockHash[]): SaveBegin {
  const cand = dedup(st, t, hashes);
  // Every hash of a second pass was counted deduplicated by the first: those that
  // still are stay counted once; the rest (copied now, or refused) no longer are.
  if (t.again) st.c.deduplicated -= hashes.length - cand.deduplicated;
  else st.c.deduplicated += cand.deduplicated;
  st.c.discardRefused += cand.discarded;
  const slotBytes = t.ns.layout.segments * t.ns.strideBytes;
  const room = fitRoom(st, cand, slotBytes);
  const admitted = admit(st, t, cand, room.count, room.total, slotBytes);
  const { count, total } = admitted;
  if (count === 0) {
    if (room.refusedForRoom > 0) return refuse(st, t, room.firstBytes);
    return { ok: true, plan: record(st, t, cand, 0, new Float64Array(0), 0, [], admitted, 0) };
  }
  const placed = allocate(st, t, cand, count, total);
  if (!placed) return refuse(st, t, total);
  const blocks = createBlocks(st, t, hashes, cand, count, placed.offsets, placed.follows);
  st.inflightCopyBytes += total;
  const p = record(
    st,
    t,
    cand,
    count,
    placed.offsets,
    total,
    blocks,
    admitted,
    room.refusedForRoom,
  );
  return { ok: true, plan: p };
}

/**
 * Step 4: evict until `total` bytes are free, then one run for the plan
 * ({@link allocateOneRun}) or else one allocation per (column, segment) for
 * all `count` blocks. Returns the plan's offsets and
 * `follows[k]` (every item of block k sits one stride after block k-1's), or
 * null after rolling back when the items cannot be placed.
 */
function allocate(
  st: StoreState,
  t: PlanTarget,
  cand: Candidates,
  count: number,
  total: number,
): { offsets: Float64Array; follows: Uint8Array } | null {
  const { ns } = t;
  const C = t.colSlot.length;
  const S = ns.layout.segments;
  const need = cand.need;
  if (st.allocator.freeBytes < total) evictBytes(st, total - st.allocator.freeBytes);
  const whole = allocateOneRun(st, t, cand, count);
  if (whole) return whole;
  const offsets = new Float64Array(C * S * count).fill(NO_OFFSET);
  const follows = new Uint8Array(count).fill(1);
  follows[0] = 0;
  const allocated: [number, number][] = []; // [offset, items] runs, for rollback
  const itemBytes = ns.layout.segmentBytes;
  const rollback = () => {
    for (const [off, items] of allocated) st.allocator.free(off, itemBytes, items);
  };
  let itemsLeft = 0; // items of this plan not placed yet
  for (let k = 0; k < count; k++) itemsLeft += cand.needCount[k] * S;
  for (let c = 0; c < C; c++) {
    let m = 0;
    for (let k = 0; k < count; k++) m += need[k * C + c];
    if (m === 0) continue;
    for (let seg = 0; seg < S; seg++) {
      let runs = st.allocator.allocate(m, itemBytes, t.part);
      // Fragmentation across namespaces: keep evicting until the items fit
      // (an onEvict that throws leaves the columns placed so far freed) —
      // unless no eviction could place them: then refuse, evicting nothing more.
      if (runs === null && !evictionCanPlace(st, ns.strideBytes, itemsLeft)) {
        rollback();
        return null;
      }
      try {
        while (runs === null && evictOne(st)) runs = st.allocator.allocate(m, itemBytes, t.part);
      } catch (e) {
        rollback();
        throw e;
      }
      if (runs === null) {
        rollback();
        return null;
      }
      for (const r of runs) allocated.push([r.offset, r.items]);
      itemsLeft -= m;
      let r = 0;
      let inRun = 0;
      let prevK = -2;
      const base = slotColumn(c, seg, S) * count;
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
  return { offsets, follows };
}

/**
 * Step 4's common case: every block needs every column, and one free extent
 * holds the plan's items. Then the columns sit back to back in one run
 * (column i's blocks at `run + (i * count + k) * stride`: the layout the
 * column-by-column path makes when its runs happen to be adjacent), placed in
 * one allocator call instead of one per column, and freed as one run when
 * the blocks leave together (lib/storage/eviction.ts). Null: allocate column
 * by column.
 */
function allocateOneRun(
  st: StoreState,
  t: PlanTarget,
  cand: Candidates,
  count: number,
): { offsets: Float64Array; follows: Uint8Array } | null {
  const items = t.colSlot.length * t.ns.layout.segments;
  for (let k = 0; k < count; k++) if (cand.needCount[k] !== t.colSlot.length) return null;
  const run = st.allocator.allocateRun(items * count, t.ns.layout.segmentBytes, t.part);
  if (run === null) return null;
  const offsets = new Float64Array(items * count);
  for (let i = 0; i < offsets.length; i++) offsets[i] = run + i * t.ns.strideBytes;
  const follows = new Uint8Array(count).fill(1);
  follows[0] = 0;
  return { offsets, follows };
}

/** Step 5: block records for the candidates, slots in flight, offsets on the records, run links. */
function createBlocks(
  st: StoreState,
  t: PlanTarget,
  hashes: readonly BlockHash[],
  cand: Candidates,
  count: number,
  offsets: Float64Array,
  follows: Uint8Array,
): Block[] {
  const { ns, namespace } = t;
  const L = ns.layout;
  const S = L.segments;
  const C = t.colSlot.length;
  const { need, hexes, buckets, existing, hashIndex } = cand;
  const now = st.clock();
  const blocks: Block[] = new Array(count);
  // Run links only between new blocks this plan fills completely (every slot).
  const wholeBlocks = C === L.layers * ns.rankSlots;
  for (let k = 0; k < count; k++) {
    let b = existing[k];
    if (b) b.runPrev = null;
    else {
      // The engine's bytes are copied as they are (no decode of the hex just made).
      const h = hashes[hashIndex[k]];
      const bytes = typeof h === "string" ? undefined : h;
      b = ns.spare.pop();
      if (b) b.recycle(`${namespace}:${hexes[k]}`, hexes[k], now, buckets[k], bytes);
      else {
        b = new Block(
          `${namespace}:${hexes[k]}`,
          namespace,
          hexes[k],
          L,
          now,
          buckets[k],
          st.namespaces.offsetRecord(ns),
          bytes,
        );
      }
      st.index.addInflight(b);
      if (wholeBlocks && follows[k] && existing[k - 1] === undefined) {
        b.runPrev = blocks[k - 1];
        b.runPrevGen = blocks[k - 1].gen;
      }
    }
    b.lastWriter = t.instance;
    for (let c = 0; c < C; c++) {
      if (!need[k * C + c]) continue;
      const si = t.colSlot[c];
      b.slots[si] = SLOT_PENDING;
      b.pending++;
      for (let seg = 0; seg < S; seg++) {
        b.offsets[slotColumn(si, seg, S)] = offsets[slotColumn(c, seg, S) * count + k];
      }
    }
    blocks[k] = b;
  }
  return blocks;
}

/** Step 6: the plan handed out, registered as open until {@link completePlan}. */
function record(
  st: StoreState,
  t: PlanTarget,
  cand: Candidates,
  count: number,
  offsets: Float64Array,
  total: number,
  blocks: Block[],
  admitted: { admissionRejected: number },
  refusedForRoom: number,
): PlanRecord {
  const { ns } = t;
  const p: PlanRecord = {
    namespace: t.namespace,
    instance: t.instance,
    rankSlot: t.rank >= 0 ? t.rankSlotList[0] : -1,
    rankSlots: Int32Array.from(t.rankSlotList),
    layers: Int32Array.from(t.layers),
    segments: ns.layout.segments,
    segmentBytes: ns.layout.segmentBytes,
    blockCount: count,
    hashIndex: Int32Array.from(cand.hashIndex.slice(0, count)),
    offsets,
    bytes: (total / ns.strideBytes) * ns.layout.segmentBytes,
    deduplicated: cand.deduplicated,
    admissionRejected: admitted.admissionRejected,
    refusedForRoom,
    discarded: cand.discarded,
    riders: cand.riders.length > 0 ? Int32Array.from(cand.riders) : NO_RIDERS,
    blocks,
    cacheClass: t.cacheClass,
    poolBytes: total,
    settled: false,
  };
  st.plans.add(p);
  return p;
}

function refuse(st: StoreState, t: PlanTarget, bytes: number): SaveBegin {
  st.c.saveRefusals++;
  return {
    ok: false,
    error: new PoolExhaustedError(bytes, st.allocator.freeBytes, st.lru.evictableBytes, {
      namespace: t.namespace,
      instance: t.instance,
      rank: t.rank >= 0 ? t.rank : undefined,
    }),
  };
}
