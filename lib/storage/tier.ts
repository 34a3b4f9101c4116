/**
 * The `Tier` port: what a storage tier below the pinned pool (SSD now, a
 * peer node later) offers the server, and what the pool offers a tier back.
 * The shape follows LMCache's storage backend (`contains` / `put` /
 * `prefetch` / `get`): a tier is asked whether it holds a prefix, is handed
 * sealed blocks to keep, is asked to bring a prefix back into RAM, and is
 * polled for that fetch.
 *
 * Two sides, both ports:
 *  - {@link Tier}: implemented by each tier (lib/ssd/ssd_tier_port.ts,
 *    lib/peer/peer_tier.ts). The server reaches tiers only through
 *    {@link LowerTiers} (lib/storage/lower_tiers.ts), which the composition
 *    root builds once.
 *  - {@link TierHost}: the RAM side a tier fills into and reads from,
 *    implemented over `KvStore` by lib/storage/tier_host.ts. Fills go through
 *    `beginFill` (whole blocks, every layer and rank slot); reads pin a batch
 *    under one transfer lock. A tier never sees the store itself.
 *
 * Blocks travel as a namespace plus the engine's hash bytes
 * ({@link TierBlocks}), with the namespace's layout identity: a tier that
 * keeps blocks beyond this process stores it with each block and serves a
 * block only to the layout that wrote it (lib/storage/layout.ts).
 *
 * Payload order: a block's bytes, as a tier stores them, are its slots in
 * store order — `(layer × rankSlots + rankSlot) × segments + segment` — each
 * `segmentBytes` long. {@link RamExtents} lists them in that order.
 *
 * @module
 */

import { hashMatches } from "./keys.ts";
import type { LayoutIdentity } from "./layout.ts";
import type { SaveCompletion, SavePlan } from "./store.ts";
import type { BlockRanges, PoolExtent } from "../transfer/ranges.ts";

/** Blocks of one namespace, by content hash, under that namespace's layout. */
export interface TierBlocks {
  readonly namespace: string;
  /** The engine's hash bytes, in prefix order. */
  readonly hashes: readonly Uint8Array[];
  /** The layout the blocks are cut by (stored with them, checked on every read). */
  readonly layout: LayoutIdentity;
}

/** A layout a tier holds blocks of, in one namespace (what a registration is checked against). */
export interface StoredLayout extends LayoutIdentity {
  blocks: number;
}

/** What {@link Tier.put} did with the offered blocks; it never waits. */
export interface TierPutResult {
  /**
   * `queued`: accepted for writing; `dropped`: the tier's queue was full
   * (counted; the blocks simply stay RAM-only); `nothing-to-write`: every
   * block is held or queued already.
   */
  readonly status: "queued" | "dropped" | "nothing-to-write";
  /** Blocks queued (or dropped). */
  readonly blocks: number;
  /** Blocks skipped because the tier holds or queues them already. */
  readonly duplicates: number;
}

/** Why a tier could not start a fetch. */
export type TierMissReason =
  | "not-held"
  | "other-layout"
  | "budget"
  | "queue-full"
  | "no-pool-space"
  /** The tier's io is stalled (a hung disk): it takes no work until that io completes. */
  | "degraded"
  | "closed";

/** The answer to {@link Tier.prefetch}. */
export type TierPrefetchAnswer =
  /** Reads started or joined: answer the query "loading"; poll with {@link Tier.take}. */
  | { readonly state: "loading" }
  | { readonly state: "miss"; readonly reason: TierMissReason };

/** The answer to {@link Tier.take}. */
export type TierTakeAnswer =
  /** Reads this request waits on still run. */
  | { readonly state: "loading" }
  /** Every read ended; verified blocks were committed into RAM as they landed. Forgotten now. */
  | { readonly state: "ready" }
  /** The tier knows no fetch of this request id (never started, already taken, or expired). */
  | { readonly state: "none" };

/** A tier's capacity and health, for /metrics and the operator. */
export interface TierHealth {
  /**
   * `up`: serving; `degraded`: open but taking no work until its stalled io
   * completes (puts dropped, fetches miss `degraded`; it comes back `up` by
   * itself); `closed`: shut down (puts dropped, fetches miss).
   */
  readonly state: "up" | "degraded" | "closed";
  readonly capacityBytes: number;
  readonly usedBytes: number;
  readonly blocks: number;
}

/**
 * A storage tier below RAM.
 *
 * Contract:
 *  - `has` is a lookup (no I/O, no side effects).
 *  - `put` never waits; it decides at once (queue or drop with a count). The
 *    tier pins the blocks in RAM ({@link TierHost.pin}) only when their
 *    write starts; a block RAM evicted before that is skipped.
 *  - `prefetch` starts or joins reads of the longest prefix of `blocks` the
 *    tier holds under their layout; pool space comes from
 *    {@link TierHost.fill}. A verified block is committed into RAM the moment
 *    it lands — an ordinary cached block for every query, whoever asked.
 *    Reads of one block are shared: a request that asks for a block being
 *    read for another request joins that read.
 *  - `take` polls a request id: `loading`, then `ready` exactly once;
 *    `settled` is the same fetch's end as a promise (for a caller that waits
 *    instead of polling).
 *  - A block that fails verification is a miss, never bytes.
 *
 * @example
 * ```ts
 * const blocks = { namespace, hashes, layout };
 * tier.put(blocks);                                   // after seal: write-behind
 * if (tier.has(blocks) > 0) tier.prefetch("req-1", blocks); // "loading"
 * tier.take("req-1");                                 // loading … ready
 * ```
 */
export interface Tier {
  /** Short name: metric label and hit attribution (`ssd`, `peer`). */
  readonly name: string;
  /** How messages name where blocks are (`SSD`, `peer nodes`). */
  readonly label: string;
  /** How many of `blocks.hashes`, from the first, the tier holds under `blocks.layout`. */
  has(blocks: TierBlocks): number;
  /** Offers sealed blocks for writing behind. Never waits. */
  put(blocks: TierBlocks): TierPutResult;
  /** Starts (or joins) bringing the held prefix of `blocks` into RAM for `requestId`. */
  prefetch(requestId: string, blocks: TierBlocks): TierPrefetchAnswer;
  /** Polls the fetch of `requestId`. */
  take(requestId: string): TierTakeAnswer;
  /**
   * Resolves (never rejects) once nothing of `requestId`'s fetch runs any
   * more, so {@link Tier.take} no longer answers `loading`; undefined when
   * this tier runs no fetch for it. Does not forget the request (`take` does).
   */
  settled(requestId: string): Promise<void> | undefined;
  /**
   * Forgets `hashes` of `namespace` (a Save's discard: garbage computed over
   * a failed load): never served again, and a write of them queued or
   * running is not kept when it lands. Never waits; a tier that outlives a
   * restart makes the drop outlive it too (the SSD tier pads the records over,
   * lib/ssd/drops.ts). Returns the blocks forgotten. A tier keeping nothing
   * between fetches does nothing.
   */
  drop(namespace: string, hashes: readonly Uint8Array[]): number;
  /** The layouts `namespace`'s blocks here were written with (they outlive a restart). */
  storedLayouts(namespace: string): readonly StoredLayout[];
  health(): TierHealth;
  /** Resolves when every write accepted so far has ended (tests, shutdown). */
  flush(): Promise<void>;
  /** Finishes accepted work and releases the tier's resources. Idempotent. */
  close(): Promise<void>;
}

/**
 * Pool space planned for one whole block a tier fetches. The tier calls
 * exactly one of `commit` (the bytes are the block's: seal it) or `abort`
 * (not delivered: free the space).
 */
export interface RamFill {
  /** Where the block's payload goes, in payload order, adjacent ranges merged. */
  readonly extents: readonly PoolExtent[];
  readonly payloadBytes: number;
  commit(): void;
  abort(): void;
}

/**
 * Pool space planned for a run of whole blocks in ONE plan (the peer tier's
 * chunk): `blocks[i]` is the asked `hashes[i]`, a prefix of them (planning
 * stops at the first block that is held, being saved, or does not fit). The
 * tier calls `settle` exactly once, saying per block whether its bytes are
 * its own (sealed) or not (freed).
 */
export interface RamFillBatch {
  /** Blocks planned: the asked `hashes[0 .. count)`. */
  readonly count: number;
  /** Bytes of one block's payload. */
  readonly payloadBytes: number;
  /**
   * Where each block's payload goes, in payload order, adjacent ranges
   * merged: flat, no object per range or per block (the peer tier pairs
   * them with the owner's in one walk).
   */
  readonly ranges: BlockRanges;
  settle(ok: (i: number) => boolean): void;
}

/** Pool ranges of one pinned block, in payload order. */
export interface RamExtents {
  /** Built from {@link RamPin.ranges} when read (each read builds it again). */
  readonly extents: readonly PoolExtent[];
  readonly payloadBytes: number;
  /** CRC32C of the payload recorded after the seal, or undefined when none was recorded yet. */
  readonly checksum: number | undefined;
}

/**
 * Blocks pinned for a tier to read (write-behind): index-aligned with the
 * asked hashes, `undefined` where RAM no longer holds the block. Pinned until
 * `release()` (call it exactly once).
 */
export interface RamPin {
  readonly blocks: readonly (RamExtents | undefined)[];
  /**
   * The same ranges flat, index-aligned with the asked hashes (a block not
   * held has none): what a lock answer packs without an object per range.
   */
  readonly ranges: BlockRanges;
  release(): void;
}

/**
 * The name a tier holds pool blocks under (its transfer locks, the writer of
 * its fills): `tier:NAME`. An engine's instance id cannot contain ':'
 * (lib/engine/registration.ts `checkName`), so cleaning up an engine, which
 * drops what its id holds, never drops a tier's holds: an engine named `ssd`
 * once released the SSD writer's locks with its own leases.
 */
export function tierHolder(tier: string): string {
  return `tier:${tier}`;
}

/** Cache class of a filled block when it seals (see lib/storage/cache.ts). */
export type FillClass = "retained" | "reclaimable";

/**
 * The RAM side of a tier: what a tier may do to the pool.
 *
 * @example
 * ```ts
 * const pin = host.pin(namespace, hashes, tierHolder("ssd")); // one transfer lock for the batch
 * // … write pin.blocks[i].extents …
 * pin?.release();
 * const f = host.fill(namespace, hash, tierHolder("ssd"), "retained"); // beginFill of one block
 * // … read into f.extents …; f.commit() or f.abort()
 * ```
 */
export interface TierHost {
  /**
   * Plans pool space for one whole block (every layer and rank slot),
   * evicting as a save would. Null when it cannot be placed now (no room,
   * already held, or being saved by an engine: that save will complete it).
   */
  fill(
    namespace: string,
    hash: Uint8Array,
    filler: string,
    cacheClass: FillClass,
  ): RamFill | null;
  /**
   * Plans pool space for the leading run of `hashes` that can be placed
   * whole, in one plan (a handful of allocator calls per slot column instead
   * of per block). Null when not even the first can be. The caller
   * announces what it committed with {@link TierHost.committed}.
   */
  fillMany(
    namespace: string,
    hashes: readonly Uint8Array[],
    filler: string,
    cacheClass: FillClass,
  ): RamFillBatch | null;
  /** Payload bytes of one block of `namespace` (every slot), or undefined for an unknown namespace. */
  payloadBytes(namespace: string): number | undefined;
  /** Pins the sealed ones of `hashes` under one transfer lock; null when none is held. */
  pin(namespace: string, hashes: readonly Uint8Array[], requester: string): RamPin | null;
  /**
   * Records each block's CRC32C of its payload (index-aligned with `hashes`)
   * for later pins to carry; blocks no longer held are skipped.
   */
  recordChecksums(namespace: string, hashes: readonly Uint8Array[], crcs: ArrayLike<number>): void;
  /**
   * Blocks a tier committed through {@link TierHost.fillMany}, announced
   * once per run of batches (a peer fetch) instead of once per batch: the
   * node advertises them to the block index then (lib/index/attach.ts).
   * Only those still held sealed now are announced (and returned): one
   * evicted since its commit must not be advertised after its eviction.
   * Each `fill`'s commit is announced by the commit itself.
   */
  committed(namespace: string, hashes: readonly Uint8Array[]): readonly Uint8Array[];
}

/**
 * The hash bytes of the blocks a completion sealed, taken from the request
 * that was planned (`requestHashes[plan.hashIndex[k]]`): a completion lists
 * its sealed blocks in plan order (tests/storage/tier_host_test.ts pins it),
 * so one merge walk pairs them, with no lookup and no hex decoding. It runs
 * in the save worker right after the seal, so it never throws: a block it
 * could not pair would only stay RAM-only.
 *
 * @example
 * ```ts
 * const done = store.completeSave(plan, true);
 * tiers.sealed(namespace, sealedHashBytes(plan, hashes, done));
 * ```
 */
export function sealedHashBytes(
  plan: SavePlan,
  requestHashes: readonly Uint8Array[],
  done: SaveCompletion,
): Uint8Array[] {
  const out: Uint8Array[] = [];
  const sealed = done.sealedHashes;
  for (let k = 0, j = 0; k < plan.blockCount && j < sealed.length; k++) {
    const h = requestHashes[plan.hashIndex[k]];
    if (hashMatches(h, sealed[j])) {
      out.push(h);
      j++;
    }
  }
  return out;
}
