/**
 * The owner's side of a peer fetch: transfer locks granted to other nodes.
 * A node that missed a prefix asks this node (`QueryBlocksForTransfer`) to
 * pin the blocks it holds; the lock answer carries, per block, its pool
 * ranges in payload order and its CRC32C, so the requester can READ the
 * bytes one-sided and verify them.
 *
 * Lock lifetime (docs/peer.md):
 *  - granted: the longest prefix held sealed under the asked layout is pinned
 *    with one store transfer lock ({@link TierHost.pin}); eviction cannot
 *    free or reuse its ranges while it is held;
 *  - released by the requester (`ReleaseTransferLock`) once its READ ended,
 *    successful or not;
 *  - or expired: a requester that vanished (SIGKILL, partition) never
 *    releases, so every lock has a TTL (asked by the requester, capped here)
 *    and a timer unpins it. The store's own lock TTL (the lease TTL) stays
 *    behind it as a backstop;
 *  - or abandoned: the requester's lock call reached its deadline before the
 *    answer (this node slow: its event loop busy, checksums to compute), so
 *    nobody will READ or release what it grants. The requester names each
 *    lock (`LockRequest.lockId`) and releases that id when its call got no
 *    answer (lock_call.ts): a lock granted by then is released; a release
 *    that comes first (the grant still computing checksums, or its request
 *    not read yet) is remembered for a while ({@link ABANDONED_KEEP_MS}), and
 *    the grant it names unpins at once and answers `abandoned`. Cheaper than
 *    a deadline carried in the request: no clock is compared, no round trip
 *    is added on success, and it covers the time a request waits unread in
 *    the socket, which this node cannot measure.
 *
 * An expired lock's ranges may be reused at once. A requester still reading
 * them then gets another block's bytes — and the checksum, taken from the
 * block's bytes after its seal and not from the pool at read time, refuses
 * them: the requester's fetch deadline is shorter than the TTL it asks for,
 * so this is the slow path of a broken requester, never silent data.
 *
 * Checksums: recorded after the seal by the peer tier's checksum stage (one
 * native call per sealed batch); a block whose checksum is not recorded yet
 * (its batch was dropped by a full queue, or it sealed a moment ago) gets
 * it computed here, in one native call for the whole lock, and recorded.
 *
 * Damaged blocks: a requester whose READ landed blocks with other checksums
 * than answered names them in its release; they are checked again here
 * while still pinned, and those whose bytes changed are condemned
 * (damage_report.ts).
 *
 * @module
 */

import type { TierHost } from "../storage/tier.ts";
import type { TierRam } from "../storage/lower_tiers.ts";
import { blockLayoutIdentity } from "../storage/layout.ts";
import type { PoolExtent } from "../transfer/ranges.ts";
import type { Logger } from "../log.ts";
import { hashHex } from "../storage/keys.ts";
import { packExtents } from "./extents_wire.ts";
import { monotonicNow } from "../clock.ts";
import { LayoutWarnings } from "./layout_warnings.ts";
import { checkReport, type ReportedLock, type ReportedRelease } from "./damage_report.ts";

/** Default lock TTL when the requester asks for none. */
export const DEFAULT_PEER_LOCK_TTL_MS = 10_000;
/** Most a requester may ask for: a longer lock only delays the reuse of a dead requester's pins. */
export const MAX_PEER_LOCK_TTL_MS = 120_000;
/** Bytes of a lock id: random, chosen by the requester (or here, for one that predates it). */
export const PEER_LOCK_ID_BYTES = 16;
/**
 * How long a release of a lock not held here is remembered, so the grant it
 * names (still running, or its request not read yet) is abandoned: the
 * longest TTL a lock can have. A request delayed longer than that before it
 * is handled is granted, and expires as a lock whose requester vanished.
 */
export const ABANDONED_KEEP_MS = MAX_PEER_LOCK_TTL_MS;
/** Releases of locks not held that are remembered at most (the oldest forgotten first). */
export const MAX_ABANDONED = 4096;
/** Expiry sweep period bounds (a quarter of the TTL, within these). */
const MIN_SWEEP_MS = 20;
const MAX_SWEEP_MS = 1_000;

/** Computes CRC32C per block of pool ranges (ffi/uring.ts `poolChecksums` over the pool). */
export type ChecksumFn = (blocks: readonly (readonly PoolExtent[])[]) => Promise<Uint32Array>;

/** What a requester asks for. */
export interface LockRequest {
  namespace: string;
  hashes: readonly Uint8Array[];
  layoutFingerprint: string;
  requester: string;
  /** 0 = the default. */
  ttlMs: number;
  /** The requester reads shifted extents (lib/peer/extents_wire.ts); absent: every extent. */
  shiftedExtents?: boolean;
  /**
   * The lock's id, chosen by the requester ({@link PEER_LOCK_ID_BYTES}): a
   * release of it abandons the lock whenever it comes. Absent or empty: one
   * is picked here.
   */
  lockId?: Uint8Array;
}

/** Why nothing was locked ("abandoned": its requester released it before it was granted). */
export type LockMissReason = "not-held" | "other-layout" | "unknown-namespace" | "abandoned";

/** The answer to a {@link LockRequest}. */
export type LockAnswer =
  | {
    readonly kind: "locked";
    readonly lockId: Uint8Array;
    readonly ttlMs: number;
    readonly payloadBytes: number;
    /** Per locked block (the held prefix, in request order). */
    readonly checksums: Uint32Array;
    readonly extentCounts: Uint32Array;
    /** The blocks' own extents back to back: u64 pool offset, u64 bytes, little-endian. */
    readonly extents: Uint8Array;
    /** Per block, the shift of a block sent as its predecessor's extents moved (or empty). */
    readonly extentShifts: Float64Array;
  }
  | { readonly kind: "miss"; readonly reason: LockMissReason };

/** Counters for /metrics. */
export interface PeerLockStats {
  /** Locks held now. */
  held: number;
  granted: number;
  released: number;
  timedOut: number;
  /** Blocks locked (granted locks' prefixes). */
  lockedBlocks: number;
  /** Answers that locked nothing, by reason. */
  misses: Record<LockMissReason, number>;
  /** Checksums computed at lock time (not recorded after the seal). */
  checksumsAtLock: number;
  /** Blocks requesters reported damaged, by what the check here found. */
  reportedBad: { condemned: number; intact: number };
}

interface HeldLock extends ReportedLock {
  readonly expiresAt: number;
  readonly release: () => void;
}

/** Options of {@link PeerLockTable}. */
export interface PeerLockTableOptions {
  host: TierHost;
  ram: TierRam;
  checksum: ChecksumFn;
  log: Logger;
  /** TTL when the requester asks for none. Default {@link DEFAULT_PEER_LOCK_TTL_MS}. */
  defaultTtlMs?: number;
  /** Milliseconds now. Default `monotonicNow` (lib/clock.ts): a system clock set forward must not expire locks mid-READ. */
  clock?: () => number;
  /**
   * Drops blocks found damaged here from RAM and every tier below (the
   * server: `discardEverywhere`, lib/storage/lower_tiers.ts). Called while
   * the lock still pins them. Absent: a damaged block is only logged.
   */
  condemn?: (namespace: string, hashes: readonly Uint8Array[]) => void;
}

/**
 * Transfer locks this node granted to peers.
 *
 * @example
 * ```ts
 * const locks = new PeerLockTable({ host: storeTierHost(store), ram: store, checksum, log });
 * const a = await locks.grant({ namespace, hashes, layoutFingerprint, requester: "node-b", ttlMs: 5000 });
 * // … the requester READs a.extents …
 * locks.release(a.lockId);
 * ```
 */
export class PeerLockTable {
  readonly #o: PeerLockTableOptions;
  readonly #clock: () => number;
  readonly #defaultTtl: number;
  /** By {@link lockKey}: an id names a lock of its requester only. */
  readonly #held = new Map<string, HeldLock>();
  /** Released before they were held, by {@link lockKey} → forget at (ms); oldest first. */
  readonly #abandoned = new Map<string, number>();
  readonly #stats: Omit<PeerLockStats, "held"> = {
    granted: 0,
    released: 0,
    timedOut: 0,
    lockedBlocks: 0,
    misses: { "not-held": 0, "other-layout": 0, "unknown-namespace": 0, abandoned: 0 },
    checksumsAtLock: 0,
    reportedBad: { condemned: 0, intact: 0 },
  };
  readonly #timer: ReturnType<typeof setInterval>;
  /** (requester, namespace, layout) refused as another layout and logged (bounded). */
  readonly #warnedLayouts = new LayoutWarnings();
  #closed = false;

  constructor(opts: PeerLockTableOptions) {
    this.#o = opts;
    this.#clock = opts.clock ?? monotonicNow;
    this.#defaultTtl = opts.defaultTtlMs ?? DEFAULT_PEER_LOCK_TTL_MS;
    if (!(this.#defaultTtl > 0 && this.#defaultTtl <= MAX_PEER_LOCK_TTL_MS)) {
      throw new RangeError(
        `peer lock TTL ${this.#defaultTtl} ms; expected 1..${MAX_PEER_LOCK_TTL_MS}`,
      );
    }
    const sweep = Math.min(MAX_SWEEP_MS, Math.max(MIN_SWEEP_MS, this.#defaultTtl / 4));
    this.#timer = setInterval(() => this.expire(), sweep);
    Deno.unrefTimer(this.#timer as unknown as number);
  }

  /**
   * Locks the longest prefix of `req.hashes` held here under the asked
   * layout. Answers `abandoned` (nothing pinned) when its requester released
   * the lock's id before it was granted.
   */
  async grant(req: LockRequest): Promise<LockAnswer> {
    const { namespace, hashes, requester } = req;
    if (this.#closed) return this.#miss("not-held");
    const lockId = req.lockId?.length
      ? req.lockId
      : crypto.getRandomValues(new Uint8Array(PEER_LOCK_ID_BYTES));
    const key = lockKey(requester, lockId);
    // Its requester gave up before this request was handled here: pin nothing.
    if (this.#abandoned.delete(key)) return this.#miss("abandoned");
    const layout = this.#o.ram.layoutOf(namespace);
    if (!layout) return this.#miss("unknown-namespace");
    const mine = blockLayoutIdentity(layout);
    if (mine.fingerprint !== req.layoutFingerprint) {
      this.#warnOtherLayout(req, mine);
      return this.#miss("other-layout");
    }
    const pin = this.#o.host.pin(namespace, hashes, `peer:${requester}`);
    if (!pin) return this.#miss("not-held");
    let k = 0;
    while (k < pin.blocks.length && pin.blocks[k] !== undefined) k++;
    if (k === 0) {
      pin.release();
      return this.#miss("not-held");
    }
    const blocks = Array.from(pin.blocks.slice(0, k), (b) => b!); // PACKED: docs/server.md, V8
    let checksums: Uint32Array;
    try {
      checksums = await this.#checksumsOf(namespace, hashes, blocks);
    } catch (e) {
      pin.release();
      throw e;
    }
    // Closed, or abandoned while the checksums ran: the answer would go nowhere.
    const gone = this.#closed ? "not-held" : this.#abandoned.delete(key) ? "abandoned" : undefined;
    if (gone) {
      pin.release();
      return this.#miss(gone);
    }
    if (this.#held.has(key)) {
      pin.release();
      throw new Error(
        `requester ${requester} asked for lock ${hashHex(lockId)}, which it holds already`,
      );
    }
    // The pin's flat ranges of the leading k blocks, packed as they lie (no object per range).
    let packed: ReturnType<typeof packExtents>;
    try {
      packed = packExtents(pin.ranges, k, req.shiftedExtents === true);
    } catch (e) {
      pin.release(); // never a pin without a lock that ends it
      throw e;
    }
    const ttlMs = Math.min(MAX_PEER_LOCK_TTL_MS, req.ttlMs > 0 ? req.ttlMs : this.#defaultTtl);
    this.#held.set(key, {
      id: hashHex(lockId),
      requester,
      namespace,
      blocks: k,
      expiresAt: this.#clock() + ttlMs,
      release: pin.release,
      hashes: hashes.slice(0, k),
      pinned: blocks,
      checksums,
    });
    this.#stats.granted++;
    this.#stats.lockedBlocks += k;
    return {
      kind: "locked",
      lockId,
      ttlMs,
      payloadBytes: blocks[0].payloadBytes,
      checksums,
      ...packed,
    };
  }

  /**
   * Each block's checksum: recorded after its seal, or computed now for
   * those without one (one native call, off the JS thread, while the
   * caller's pin holds them) and recorded.
   */
  async #checksumsOf(
    namespace: string,
    hashes: readonly Uint8Array[],
    blocks: readonly { readonly checksum?: number; readonly extents: readonly PoolExtent[] }[],
  ): Promise<Uint32Array> {
    const checksums = new Uint32Array(blocks.length);
    const missing: number[] = [];
    for (let i = 0; i < blocks.length; i++) {
      const c = blocks[i].checksum;
      if (c === undefined) missing.push(i);
      else checksums[i] = c;
    }
    if (missing.length === 0) return checksums;
    const crcs = await this.#o.checksum(Array.from(missing, (i) => blocks[i].extents));
    for (let j = 0; j < missing.length; j++) checksums[missing[j]] = crcs[j];
    this.#o.host.recordChecksums(namespace, Array.from(missing, (i) => hashes[i]), crcs);
    this.#stats.checksumsAtLock += missing.length;
    return checksums;
  }

  /**
   * Ends a lock early. False when it is unknown, expired, or another
   * requester's; a release of a lock id not held is remembered, so a grant of
   * it still to come (its requester gave up waiting) is abandoned.
   */
  release(lockId: Uint8Array, requester: string): boolean {
    const key = lockKey(requester, lockId);
    const l = this.#held.get(key);
    if (!l) {
      // Only well-formed ids: a release names any bytes, and this set is bounded by count.
      if (lockId.length === PEER_LOCK_ID_BYTES && !this.#closed) this.#abandon(key);
      return false;
    }
    this.#held.delete(key);
    l.release();
    this.#stats.released++;
    return true;
  }

  /**
   * Ends a lock whose READ landed `failed` (indices into its locked prefix)
   * with other checksums than answered: those blocks are checksummed again
   * while still pinned, and the ones whose bytes changed here are condemned
   * (damage_report.ts). Throws `BadReportError` for an index outside the
   * lock or named twice, after releasing the lock. A lock not held (expired,
   * another requester's) is released as {@link release} would and nothing is
   * checked: its ranges may hold other blocks by now.
   */
  async releaseReported(
    lockId: Uint8Array,
    requester: string,
    failed: readonly number[],
  ): Promise<ReportedRelease> {
    const key = lockKey(requester, lockId);
    const l = failed.length > 0 ? this.#held.get(key) : undefined;
    if (!l) return { released: this.release(lockId, requester), condemned: 0 };
    this.#held.delete(key); // out of the sweep's reach: the pin ends below, once
    this.#stats.released++;
    try {
      const condemned = await checkReport(l, failed, this.#o.checksum, this.#o.log);
      this.#stats.reportedBad.condemned += condemned.length;
      this.#stats.reportedBad.intact += failed.length - condemned.length;
      if (condemned.length > 0) this.#o.condemn?.(l.namespace, condemned.map((i) => l.hashes[i]));
      return { released: true, condemned: condemned.length };
    } finally {
      l.release();
    }
  }

  #abandon(key: string): void {
    this.#abandoned.delete(key); // re-inserted last: the map stays in order of forgetting
    this.#abandoned.set(key, this.#clock() + ABANDONED_KEEP_MS);
    if (this.#abandoned.size > MAX_ABANDONED) {
      this.#abandoned.delete(this.#abandoned.keys().next().value!);
    }
  }

  /**
   * Unpins every lock past its TTL (the timer calls it), and forgets
   * releases remembered for {@link ABANDONED_KEEP_MS}. Returns how many locks
   * expired.
   */
  expire(): number {
    const now = this.#clock();
    for (const [key, until] of this.#abandoned) {
      if (until > now) break;
      this.#abandoned.delete(key);
    }
    let n = 0;
    for (const [key, l] of this.#held) {
      if (l.expiresAt > now) continue;
      this.#held.delete(key);
      l.release();
      n++;
      this.#o.log.warn("peer transfer lock expired: its requester never released it", {
        lock: l.id,
        requester: l.requester,
        namespace: l.namespace,
        blocks: l.blocks,
      });
    }
    this.#stats.timedOut += n;
    return n;
  }

  stats(): PeerLockStats {
    return {
      held: this.#held.size,
      ...this.#stats,
      misses: { ...this.#stats.misses },
      reportedBad: { ...this.#stats.reportedBad },
    };
  }

  /** Releases every lock and stops the timer. Idempotent. */
  close(): void {
    this.#closed = true;
    clearInterval(this.#timer);
    for (const l of this.#held.values()) l.release();
    this.#held.clear();
    this.#abandoned.clear();
  }

  /**
   * A requester whose engine cuts this namespace's blocks another way (same
   * namespace, other layers, TP size or segment bytes): nothing is lent,
   * and it is a configuration error both nodes' operators must see, so it
   * is logged once per (requester, namespace, layout), naming both layouts.
   */
  #warnOtherLayout(req: LockRequest, mine: { fingerprint: string; summary: string }): void {
    const key = `${req.requester}\n${req.namespace}\n${req.layoutFingerprint}`;
    if (!this.#warnedLayouts.first(key)) return;
    this.#o.log.warn(
      "peer lock refused: the requester's engine uses another KV layout under this namespace; " +
        "nothing is lent to it (give each layout its own namespace)",
      {
        requester: req.requester,
        namespace: req.namespace,
        requester_layout: req.layoutFingerprint,
        layout: mine.fingerprint,
        layout_summary: mine.summary,
      },
    );
  }

  #miss(reason: LockMissReason): LockAnswer {
    this.#stats.misses[reason]++;
    return { kind: "miss", reason };
  }
}

/** A lock's key here: its requester and its id (requesters pick ids, so an id is theirs alone). */
function lockKey(requester: string, lockId: Uint8Array): string {
  return `${requester}\n${hashHex(lockId)}`;
}
