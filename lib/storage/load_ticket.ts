/**
 * Load tickets: consuming a lease for one rank, and what the load reads.
 *
 * A ticket encodes its blocks as runs: blocks saved together in one request
 * are linked (`Block.runPrev`, every item exactly one stride after the
 * predecessor's), so a lease splits into runs of linked blocks and only each
 * run's first record is read — 64 numbers for a 625-block prefix saved in one
 * request, instead of 40,000 offsets out of 625 records a 1.3 GB copy has
 * just pushed out of the CPU caches. A ticket pins its blocks until
 * {@link finishTicket}, so a load in flight keeps them after the lease ends.
 *
 * @module
 */

import type { Block } from "./block.ts";
import { InvalidArgumentError, LeaseError, StaleHandleError } from "./errors.ts";
import type { Lease, LeaseId } from "./lease.ts";
import { offsetColumn, slotColumn } from "./offsets.ts";
import { layerList, type StoreState } from "./state.ts";

/**
 * What a load reads: the same column-major layout as a save plan with one
 * rank slot (lib/storage/offsets.ts): `offsets[(li * segments + seg) * blockCount + b]`.
 * Holds its blocks until {@link KvStore.loadDone}.
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

/** Internal form of a ticket: the public fields plus the pinned blocks. */
export interface TicketRecord extends LoadTicket {
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

/** Options of {@link KvStore.consumeLease}. */
export interface ConsumeOptions {
  tpRank?: number;
  layers?: readonly number[];
  count?: number;
}

/**
 * Refuses a load of a lease whose first `count` blocks hold one discarded
 * since the lease was granted (discard.ts: garbage computed over another
 * rank's failed load, e.g. MLA's one shared slot): the engine recomputes
 * instead of loading it. A load already running when the discard came keeps
 * reading (its copy cannot be recalled); the lease's other ranks are refused
 * the same way. Before the rank's consume is spent.
 */
function refuseDiscarded(l: Lease<Block>, count: number, instance: string, rank: number): void {
  for (let i = 0; i < count; i++) {
    const b = l.blocks[i];
    if (!b.discarded) continue;
    throw new LeaseError(
      "block-discarded",
      `lease ${l.id}: block ${i} (hash ${b.hash}) was discarded after the lease was granted (computed over a failed load); recompute it`,
      { namespace: l.namespace, instance, rank, lease: l.id, block: b.hash },
    );
  }
}

/** Consumes `lease` for `rank` and returns its ticket (see {@link KvStore.consumeLease}). */
export function consumeTicket(
  st: StoreState,
  lease: LeaseId,
  instance: string,
  rank: number,
  opts: ConsumeOptions,
): LoadTicket {
  let layers: number[] = [];
  let tpRank = 0;
  // Validate the request against the lease's layout before the rank spends its consume.
  const { lease: l, last } = st.leases.consume(lease, instance, rank, (l) => {
    const c = opts.count;
    if (c !== undefined && !(Number.isSafeInteger(c) && c >= 0 && c <= l.blocks.length)) {
      throw new InvalidArgumentError(
        `lease ${l.id} holds ${l.blocks.length} blocks; a load names at most that many targets, got ${c}`,
        { namespace: l.namespace, instance, rank, lease: l.id, expected: l.blocks.length, got: c },
      );
    }
    refuseDiscarded(l, c ?? l.blocks.length, instance, rank);
    const L = st.namespaces.require(l.namespace, instance).layout;
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
    layers = layerList(l.namespace, instance, L, opts.layers, rank);
  });
  const ns = st.namespaces.require(l.namespace, instance);
  const L = ns.layout;
  const rankSlot = L.collapseTp ? 0 : tpRank;
  const S = L.segments;
  // The ticket covers the prefix the load names; the lease keeps pinning all
  // of its blocks until it ends (last consume, release, expiry).
  const blocks = opts.count === undefined || opts.count === l.blocks.length
    ? l.blocks
    : l.blocks.slice(0, opts.count);
  const n = blocks.length;
  const heads = runHeads(st, blocks);
  const runs = heads.runs;
  const runOffsets = new Float64Array(layers.length * S * runs);
  for (let r = 0; r < runs; r++) {
    const rec = blocks[heads.at[r]].offsets;
    for (let li = 0; li < layers.length; li++) {
      for (let seg = 0; seg < S; seg++) {
        runOffsets[slotColumn(li, seg, S) * runs + r] =
          rec[offsetColumn(layers[li], rankSlot, ns.rankSlots, seg, S)];
      }
    }
  }
  for (let k = 0; k < n; k++) st.pin(blocks[k]);
  if (last) endLease(st, l, blocks);
  st.loadsInflight++;
  const ticket = new Ticket(
    l.namespace,
    instance,
    rank,
    l.id,
    Int32Array.from(layers),
    S,
    L.segmentBytes,
    n,
    Array.from(blocks, (b) => b.hash), // PACKED: docs/server.md, V8 flags
    heads.at.slice(0, runs + 1),
    runOffsets,
    ns.strideBytes,
    n * layers.length * S * L.segmentBytes,
    // The lease's list is never mutated (a lease only ever goes away whole).
    blocks,
  );
  st.tickets.add(ticket);
  return ticket;
}

/**
 * Where each run of linked blocks starts (`at[r]`; `at[runs]` = block count),
 * in the state's scratch array. A link is followed only when the predecessor
 * is the block right before it in the lease and its generation still matches.
 */
function runHeads(st: StoreState, blocks: readonly Block[]): { at: Int32Array; runs: number } {
  const n = blocks.length;
  if (st.runHeads.length < n + 1) st.runHeads = new Int32Array(n + 1);
  const heads = st.runHeads;
  let runs = 0;
  if (n > 0) heads[runs++] = 0;
  for (let k = 1; k < n; k++) {
    const b = blocks[k];
    const p = blocks[k - 1];
    if (b.runPrev !== p || b.runPrevGen !== p.gen) heads[runs++] = k;
  }
  heads[runs] = n;
  return { at: heads, runs };
}

/**
 * The last consume ends the lease's pins (the ticket holds its own). An
 * `onEvict` that throws there (a doomed block past the ticket's prefix,
 * discard.ts) fails this load: the ticket's pins go too, so nothing stays pinned.
 */
function endLease(st: StoreState, l: Lease<Block>, ticketBlocks: readonly Block[]): void {
  try {
    st.unpinLease(l);
  } catch (e) {
    try {
      st.unpinAll(ticketBlocks);
    } catch {
      // The first error is the one reported.
    }
    throw e;
  }
}

/** Ends a load exactly once (see {@link KvStore.loadDone}): unpins its blocks. */
export function finishTicket(st: StoreState, ticket: LoadTicket): void {
  const t = ticket as TicketRecord;
  if (!st.tickets.has(t) || t.settled) {
    throw new StaleHandleError(`load ticket was already completed or is not from this store`, {
      namespace: ticket.namespace,
      instance: ticket.instance,
      rank: ticket.rank,
      lease: ticket.lease,
    });
  }
  t.settled = true;
  st.tickets.delete(t);
  st.loadsInflight--;
  st.unpinAll(t.blocks);
}
