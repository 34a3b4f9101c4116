/**
 * Steps 1–2 of a peer fetch (peer_tier.ts): the index's owners of the
 * prefix, asked in its order — longest run from the first missing block
 * first — until one locks the prefix's first part. The first owner is asked
 * as it always was; the fetch passes to the next only when the failure was
 * the owner's own doing:
 *
 * - `connect`: its handshake or transfer connect failed (dead — SIGKILLed,
 *   its index entries not expired yet — or unreachable);
 * - `lock-rpc`: its lock call got no answer, its socket is gone, or its
 *   answer could not be decoded;
 * - `owner-miss`: it no longer holds the blocks (evicted since it advertised
 *   them) — but not `other-layout`, this node's layout being refused, which
 *   every owner of the namespace would refuse alike.
 *
 * Anything else ends the fetch as before: the index down, no owner, an
 * answer refused for this node's block payload or transport (`bad-answer`).
 * At most {@link MAX_OWNERS_PER_FETCH} owners are asked, none once the
 * fetch's deadline (its READ deadline, counted from its start) has passed; a
 * later owner's connection must be made, and its lock call answered, within
 * what is left of it (a link made later is not asked for a lock). The split
 * lock's second part is asked of the owner that granted the first, with the
 * RPC deadline (the walk is over), as every release is; its failure is never
 * passed over. A failure after the lock (no pool room, the
 * READ) is the fetch's.
 *
 * Each owner passed over is logged once (its node id, address, reason, and
 * the fetch's namespace, first block and request) and counted apart
 * (`pegaflow_peer_fetch_owners_skipped_total{reason}`), not as the fetch's
 * failure (fetch_stats.ts). Nothing is added where the first owner answers:
 * the walk's work happens on a failure only.
 *
 * Suspects. An owner frozen or overloaded (SIGSTOP, a hung event loop) keeps
 * its index entries, and so its place first in the order: every fetch would
 * pay the whole lock deadline before the next owner. So an owner that failed
 * by its own doing — `connect`, or `lock-rpc` where it had the whole RPC
 * deadline or its socket is gone; not a miss, which is per prefix, nor a
 * link or lock cut short by the fetch's own deadline — is remembered by
 * address for {@link SUSPECT_OWNER_MS} ({@link SuspectOwners}), logged once
 * when it becomes suspect and counted (`pegaflow_peer_owners_suspected_total`).
 * Each walk asks the healthy owners first, in the index's order, then the
 * suspects, in that order too — even a suspect holding a longer run: it
 * failed moments ago, asking it first costs up to an RPC deadline (2 s) per
 * fetch, most likely for nothing, while the blocks the healthy owner lacks
 * cost the engine a recompute of them, less than that. A suspect is still
 * asked when the healthy owners fail (or where all owners are suspects), is
 * first again once its mark expires, and is cleared by any lock it grants.
 * With no suspect the order is the index's, with no allocation.
 *
 * @module
 */

import type { TierBlocks, TierHost } from "../storage/tier.ts";
import type { LookupResult } from "../index/block_index.ts";
import type { Logger } from "../log.ts";
import type {
  FailFn,
  OwnerSkipReason,
  OwnerSuspectReason,
  PeerFetchFailure,
} from "./fetch_stats.ts";
import { lockPart } from "./lock_call.ts";
import type { PeerLinks } from "./link.ts";
import { LayoutWarnings } from "./layout_warnings.ts";
import { monotonicNow } from "../clock.ts";
import { withinOrThrow } from "../timer_limit.ts";
import type { OwnerLink, XferPeers } from "./xfer_peers.ts";

/**
 * Most owners one fetch asks: the longest and two more. Each failing one can
 * cost an RPC deadline (2 s), so a fetch whose owners all died ends within
 * its own deadline without trying a whole list of stale entries.
 */
export const MAX_OWNERS_PER_FETCH = 3;
/**
 * How long an owner that failed by its own doing is asked after the healthy
 * ones: long enough that a frozen owner costs one lock deadline per 10 s,
 * not one per fetch; short enough that an owner back from a pause (a GC, a
 * burst) serves its longer runs again soon — it is asked first once its
 * mark expires, or at once where a lock it grants clears it.
 */
export const SUSPECT_OWNER_MS = 10_000;
/**
 * Most owners remembered as suspects (the oldest marks are forgotten first):
 * a cluster's worth of dead entries without the map growing with churn.
 */
export const MAX_SUSPECT_OWNERS = 1024;
/**
 * Most blocks one fetch locks and reads (2 GiB of Llama-3.1-8B blocks): it
 * bounds the lock answer (extents of a block of 80 layers × TP 8 × K/V are
 * 20 KiB), which must fit the owner's --max-message-size (64 MiB default).
 * A longer prefix is fetched up to here; the engine loads that part.
 */
const MAX_FETCH_BLOCKS = 1024;

/** An owner as the index names it. */
export type Owner = LookupResult["owners"][number];
/** What names a fetch in its logs: namespace, first block, the request that started it. */
type FetchIds = Record<string, string>;

/** What the walk asks of the block index (peer_tier.ts's `PeerIndex` fits). */
export interface OwnerIndex {
  /** This node's id: the requester named in each lock. */
  readonly nodeId: string;
  lookup(namespace: string, hashes: readonly Uint8Array[]): Promise<LookupResult>;
}

/** What the walk needs of its tier (built once per tier). */
export interface OwnerWalkOptions {
  host: Pick<TierHost, "payloadBytes">;
  links: PeerLinks;
  xferPeers: XferPeers;
  transport: string;
  log: Logger;
  fetchTimeoutMs: number;
  rpcTimeoutMs: number;
  lockTtlMs: number;
  chunkBytes: number;
  splitLock: boolean;
  /** The tier's count of owners passed over, by reason. */
  skipped: Record<OwnerSkipReason, number>;
  /** The tier's count of owners marked suspect, by reason. */
  suspected: Record<OwnerSuspectReason, number>;
  /** How long a suspect stays one (default {@link SUSPECT_OWNER_MS}). */
  suspectMs?: number;
  /** Each lookup's held length, for the tier's `has` (no I/O there). */
  looked(namespace: string, first: Uint8Array, length: number): void;
  /** Keeps a background release (a lock call that got no answer) for flush and close. */
  track(p: Promise<unknown>): void;
}

/** Where one fetch stands in its owner list (built on a failure only). */
export interface OwnerTurn {
  owners: readonly Owner[];
  /** The index of the owner that just failed. */
  i: number;
  /** When the fetch's deadline passes (`performance.now()` ms). */
  deadline: number;
}

function isSkipReason(why: PeerFetchFailure): why is OwnerSkipReason {
  return why === "connect" || why === "lock-rpc" || why === "owner-miss";
}

/**
 * Whether the fetch passes over owner `turn.i` after it failed with `why`
 * (module doc): true once it is counted in `skipped` and logged, false when
 * the fetch must end here (the caller counts the failure).
 *
 * @example
 * ```ts
 * if (passOver({ owners, i, deadline }, "connect", fields, stats.ownersSkipped, log, ids)) continue;
 * return fail("connect", fields);
 * ```
 */
export function passOver(
  turn: OwnerTurn,
  why: PeerFetchFailure,
  fields: Record<string, string>,
  skipped: Record<OwnerSkipReason, number>,
  log: Logger,
  ids: FetchIds,
): boolean {
  if (!isSkipReason(why) || fields.miss_reason === "other-layout") return false;
  const next = turn.owners[turn.i + 1];
  if (!next || next.length === 0 || turn.i + 1 >= MAX_OWNERS_PER_FETCH) return false;
  if (performance.now() >= turn.deadline) return false;
  skipped[why]++;
  log.info("peer fetch passed over an owner; asking the next one the index names", {
    ...ids,
    reason: why,
    ...fields,
    next_owner: next.nodeId,
    next_addr: next.addr,
  });
  return true;
}

/**
 * The lock deadline for owner `i`: the RPC deadline for the first; for a
 * later one no more than what is left of the fetch's deadline (at least 1 ms:
 * {@link passOver} let it start before the deadline).
 */
export function lockDeadlineMs(i: number, rpcTimeoutMs: number, deadline: number): number {
  if (i === 0) return rpcTimeoutMs;
  return Math.max(1, Math.min(rpcTimeoutMs, Math.floor(deadline - performance.now())));
}

/**
 * Owners (by address: what the link and the lock go to) that failed by their
 * own doing lately, each with when its mark expires (`monotonicNow()` ms);
 * bounded, the oldest mark forgotten first. Marks all last the same time, so
 * the map's order (a re-mark moves to the end) is their expiry order.
 *
 * @example
 * ```ts
 * const suspects = new SuspectOwners(10_000);
 * const order = suspects.order(found.owners); // the same array where none is a suspect
 * const until = suspects.mark("10.0.0.2:50055"); // undefined: it was one already
 * suspects.clear("10.0.0.2:50055");
 * ```
 */
export class SuspectOwners {
  /** How long a mark lasts (ms). */
  readonly ms: number;
  readonly #until = new Map<string, number>();

  constructor(ms: number) {
    this.ms = ms;
  }

  /**
   * `owners` with the suspects moved after the healthy ones, each part in
   * its order (owners of no run left out); `owners` itself where none is a
   * suspect.
   */
  order(owners: readonly Owner[]): readonly Owner[] {
    if (this.#until.size === 0) return owners;
    this.#expire(monotonicNow());
    if (this.#until.size === 0 || !owners.some((x) => this.#until.has(x.addr))) return owners;
    const held = owners.filter((x) => x.length > 0);
    const healthy = held.filter((x) => !this.#until.has(x.addr));
    return healthy.concat(held.filter((x) => this.#until.has(x.addr)));
  }

  /** Marks `addr` for the suspect period; when it ends, or undefined where `addr` was one already. */
  mark(addr: string): number | undefined {
    const now = monotonicNow();
    this.#expire(now);
    const was = this.#until.delete(addr);
    const until = now + this.ms;
    this.#until.set(addr, until);
    for (const [old] of this.#until) {
      if (this.#until.size <= MAX_SUSPECT_OWNERS) break;
      this.#until.delete(old);
    }
    return was ? undefined : until;
  }

  /** Clears `addr` (it answered); true where it was a suspect. */
  clear(addr: string): boolean {
    return this.#until.size !== 0 && this.#until.delete(addr);
  }

  #expire(now: number): void {
    for (const [addr, until] of this.#until) {
      if (until > now) return;
      this.#until.delete(addr);
    }
  }
}

/** A link not made within what was left of the fetch's deadline: no failure of the owner's. */
class LateLink extends Error {}

/**
 * Steps 1–2 of every fetch of one tier.
 *
 * @example
 * ```ts
 * const walk = new OwnerWalk({ host, links, xferPeers, transport: "tcp", log, ...limits, skipped, looked, track });
 * const locked = await walk.lockFirst(index, blocks, fail, ids, performance.now());
 * if (locked) read(locked.first, locked.owner, locked.peer);
 * ```
 */
export class OwnerWalk {
  readonly #o: OwnerWalkOptions;
  /** (owner, namespace) whose lock refused this node's layout, logged (bounded). */
  readonly #warnedLayouts = new LayoutWarnings();
  /** Owners asked after the healthy ones for a while (module doc). */
  readonly #suspects: SuspectOwners;

  constructor(opts: OwnerWalkOptions) {
    this.#o = opts;
    this.#suspects = new SuspectOwners(opts.suspectMs ?? SUSPECT_OWNER_MS);
  }

  /**
   * The longest owner from the index, a transfer peer to it (the handshake,
   * once per owner, names its peer RPC socket), the lock of the prefix's
   * first part (its first chunk when the lock is split, else all of it),
   * and `rest`, the lock of the rest from the same owner. An owner that
   * fails by its own doing is passed over for the next, and suspects are
   * asked after the healthy owners (module doc).
   * Undefined (the failure counted) on a failure. `t0`: the fetch's start.
   */
  async lockFirst(index: OwnerIndex, blocks: TierBlocks, fail: FailFn, ids: FetchIds, t0: number) {
    const { namespace, hashes } = blocks;
    const o = this.#o;
    const found = await index.lookup(namespace, hashes);
    const tLookup = performance.now();
    if (!found.available) return fail("index-down");
    o.looked(namespace, hashes[0], found.length);
    if (!found.owners[0] || found.owners[0].length === 0) return fail("no-owner");
    const owners = this.#suspects.order(found.owners);
    const deadline = t0 + o.fetchTimeoutMs;
    const payloadBytes = o.host.payloadBytes(namespace);
    const per = Math.max(1, Math.floor(o.chunkBytes / (payloadBytes ?? 1)));
    for (let i = 0;; i++) {
      const owner = owners[i];
      let link: OwnerLink;
      try {
        link = await this.#connect(owner.addr, i, deadline);
      } catch (e) {
        const fields = { owner: owner.nodeId, addr: owner.addr, error: (e as Error).message };
        if (!(e instanceof LateLink)) this.#suspect("connect", fields, ids);
        if (passOver({ owners, i, deadline }, "connect", fields, o.skipped, o.log, ids)) continue;
        return fail("connect", fields);
      }
      const tConnect = performance.now();
      const want = hashes.slice(0, Math.min(owner.length, MAX_FETCH_BLOCKS));
      const lock = this.#locker(index.nodeId, blocks, owner, link, payloadBytes, ids);
      const head = o.splitLock && want.length > 2 * per ? per : want.length;
      const first = await lock(want.slice(0, head), lockDeadlineMs(i, o.rpcTimeoutMs, deadline));
      if ("why" in first) {
        const { why, fields } = first;
        if (passOver({ owners, i, deadline }, why, fields, o.skipped, o.log, ids)) continue;
        return fail(why, fields);
      }
      const tLock = performance.now();
      // The rest only where the first part is whole (a shorter answer: the held prefix ends
      // there), of the owner that granted the first part, with the RPC deadline (the walk is over).
      const rest = first.hashes.length === head && head < want.length
        ? () => lock(want.slice(head), o.rpcTimeoutMs)
        : undefined;
      return { owner, peer: link.peer, first, rest, tLookup, tConnect, tLock, skipped: i };
    }
  }

  /**
   * The link to the owner at `addr`. A later owner's (`i` > 0) must be made
   * within the fetch's deadline, else it rejects: a link made after it would
   * be asked for a lock with no time left (the handshake goes on, kept for
   * the next fetch).
   */
  async #connect(addr: string, i: number, deadline: number): Promise<OwnerLink> {
    const linked = this.#o.xferPeers.get(addr);
    if (i === 0) return await linked;
    const left = Math.max(0, deadline - performance.now());
    return await withinOrThrow(
      linked,
      left,
      () =>
        new LateLink(
          `no transfer connection within the fetch's deadline (${Math.round(left)} ms left)`,
        ),
    );
  }

  /**
   * The lock call on `owner` with its deadline: a granted part with its
   * hashes, or the failure (its side effects done here; the caller counts it
   * or passes the owner over). Releases get the RPC deadline.
   */
  #locker(
    requester: string,
    blocks: TierBlocks,
    owner: Owner,
    link: OwnerLink,
    payloadBytes: number | undefined,
    ids: FetchIds,
  ) {
    const o = this.#o;
    const { namespace, layout } = blocks;
    const expect = { payloadBytes, transport: o.transport, layoutSummary: layout.summary };
    const target = { addr: owner.addr, rpcAddr: link.rpcAddr, nodeId: owner.nodeId };
    return async (part: Uint8Array[], rpcMs: number) => {
      const ask = {
        namespace,
        blockHashes: part,
        layoutFingerprint: layout.fingerprint,
        requester,
        lockTtlMs: o.lockTtlMs,
        shiftedExtents: true,
      };
      const l = await lockPart(o.links, target, ask, expect, rpcMs, o.log, o.rpcTimeoutMs);
      if ("res" in l) {
        if (this.#suspects.clear(owner.addr)) {
          const who = { owner: owner.nodeId, addr: owner.addr };
          o.log.info("peer owner answers again; no longer suspect", { ...ids, ...who });
        }
        return { ...l, hashes: part.slice(0, l.res.checksums.length) };
      }
      // Its own doing where it had the whole deadline (not one cut short by the fetch's).
      if (l.why === "lock-rpc" && (l.socketGone || rpcMs >= o.rpcTimeoutMs)) {
        this.#suspect("lock-rpc", l.fields, ids);
      }
      if (l.abandon) o.track(l.abandon); // the owner may grant it yet: it ends it then
      // Its socket is gone (a restart, maybe on another port): handshake again next time.
      if (l.socketGone) void o.xferPeers.drop(owner.addr, link.peer);
      if (l.fields.miss_reason === "other-layout") this.#warnOtherLayout(l.fields, namespace, ids);
      return l;
    };
  }

  /**
   * Marks the owner `fields` names (its `addr`) suspect; the first mark since it was healthy is
   * counted and logged with its ids, the reason, and until when.
   */
  #suspect(reason: OwnerSuspectReason, fields: Record<string, string>, ids: FetchIds): void {
    const until = this.#suspects.mark(fields.addr);
    if (until === undefined) return;
    const o = this.#o;
    o.suspected[reason]++;
    o.log.warn("peer owner failed by its own doing; asked after the healthy owners for a while", {
      ...ids,
      ...fields,
      reason,
      suspect_ms: this.#suspects.ms,
      suspect_until: new Date(until).toISOString(),
    });
  }

  /**
   * The owner holds the prefix under another layout of the same namespace: a configuration
   * error nothing here can fix (every fetch from it misses), logged once per owner and namespace.
   */
  #warnOtherLayout(fields: Record<string, string>, namespace: string, ids: FetchIds): void {
    const key = `${fields.addr}\n${namespace}`;
    if (!this.#warnedLayouts.first(key)) return;
    this.#o.log.warn(
      "peer fetch refused: the owner's engine uses another KV layout under this namespace; " +
        "its blocks are never loaded here (give each layout its own namespace)",
      { ...ids, ...fields },
    );
  }
}
