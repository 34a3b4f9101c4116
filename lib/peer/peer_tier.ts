/**
 * The peer tier behind the {@link Tier} port: blocks another node holds,
 * found through the block index on Redis and read one-sided over the
 * transfer layer into this node's pool (docs/peer.md, "How a fetch goes").
 *
 * A fetch (one per request id; a request starting at the first missing block
 * of a running fetch joins it): 1. longest-prefix lookup in the index; 2. a
 * transfer lock on the owner with the longest run (lock_call.ts, over its
 * peer RPC socket; one that is dead or misses is passed over for the next
 * the index names, owner_walk.ts): its first chunk's blocks alone when the
 * prefix is longer than two chunks, the rest, of the same owner, while that
 * chunk reads; 3. each locked part read in chunks of
 * {@link PIPELINE_CHUNK_BYTES} into pool space here, the
 * "reclaimable" class (read.ts: one batch per chunk, planned while earlier
 * chunks are on the wire, each block's CRC32C computed as it lands and
 * checked against the owner's before the block is committed); 4. the locks
 * released in the background (a lost release lets them expire; a lock call
 * that got no answer, or one it could not decode, releases its lock's id
 * too, lock_call.ts).
 *
 * Memory safety (the original system's #403): a fill's pool space is freed only after its
 * batch's completion record, which the transport posts once nothing can write into the batch's
 * ranges (docs/transfer.md). Every failure is a miss — never bytes — counted by reason.
 *
 * @module
 */

import {
  type StoredLayout,
  type Tier,
  type TierBlocks,
  type TierHealth,
  tierHolder,
  type TierHost,
  type TierPrefetchAnswer,
  type TierPutResult,
  type TierTakeAnswer,
} from "../storage/tier.ts";
import { hashHex } from "../storage/keys.ts";
import type { StageMetrics } from "../pipeline/stage.ts";
import type { LookupResult } from "../index/block_index.ts";
import type { XferEndpoint, XferPeer } from "../../ffi/xfer.ts";
import type { Logger } from "../log.ts";
import type { ChecksumFn } from "./locks.ts";
import { mergeReads, readLockedPrefix, type ReadOutcome } from "./read.ts";
import type { LockedPart } from "./lock_call.ts";
import type { PeerLinks } from "./link.ts";
import { SealChecksums } from "./seal_checksums.ts";
import { XferPeers } from "./xfer_peers.ts";
import { monotonicNow } from "../clock.ts";
import { LookupMemo } from "./lookup_memo.ts";
import {
  type FailFn,
  fetchFailures,
  type FetchTotals,
  fetchTotals,
  type PeerTierStats,
} from "./fetch_stats.ts";
import { type Owner, OwnerWalk } from "./owner_walk.ts";

/** Name of the peer tier: metric label and hit attribution; its fills are `tierHolder(PEER_TIER_NAME)`. */
export const PEER_TIER_NAME = "peer";
/** Default deadline of a whole fetch's READ batch. */
export const DEFAULT_PEER_FETCH_TIMEOUT_MS = 5_000;
/** Deadline of the lock and release RPCs and of a transport connect. */
export const DEFAULT_PEER_RPC_TIMEOUT_MS = 2_000;
/** Finished fetches nobody polled are forgotten after this long (their blocks stay cached). */
const FORGET_AFTER_MS = 60_000;
/** Bytes per READ batch: each still stripes over every stream; commits overlap later reads. */
export const PIPELINE_CHUNK_BYTES = 32 << 20;
/** ms from `a` to `b` (`performance.now()` marks), two decimals: a log field. */
const ms = (a: number, b: number) => Math.round((b - a) * 100) / 100;
/** What names a fetch in its logs: namespace, first block, the request that started it. */
type FetchIds = Record<string, string>;

/** What the tier needs from the block index (a RedisBlockIndex fits). */
export interface PeerIndex {
  readonly nodeId: string;
  lookup(namespace: string, hashes: readonly Uint8Array[]): Promise<LookupResult>;
  stats(): { up: boolean };
}

/** Options of {@link PeerTier}. */
export interface PeerTierOptions {
  host: TierHost;
  /** The index (undefined until it is opened: the tier then misses). */
  index: () => PeerIndex | undefined;
  endpoint: XferEndpoint;
  /** The endpoint's transport ("tcp" | "rdma"): owners must use the same. */
  transport: string;
  links: PeerLinks;
  checksum: ChecksumFn;
  log: Logger;
  fetchTimeoutMs?: number;
  rpcTimeoutMs?: number;
  /** Bytes per READ batch of a fetch (pipelined). Default {@link PIPELINE_CHUNK_BYTES}. */
  chunkBytes?: number;
  /**
   * Lock the first chunk's blocks alone and READ them while the rest is
   * locked (a prefix of more than two chunks). Default true.
   */
  splitLock?: boolean;
  /**
   * Lock TTL asked of owners; default: the READ deadline plus one RPC
   * deadline (the lock answer's transit before the READ starts).
   */
  lockTtlMs?: number;
  /**
   * How long an owner that failed by its own doing is asked after the
   * healthy ones (owner_walk.ts). Default `SUSPECT_OWNER_MS` (10 s).
   */
  ownerSuspectMs?: number;
  /**
   * Test hook (env `PEGAFLOW_TEST_PEER_READ_DELAY_MS`): awaited after the
   * owner locked the blocks and the transfer peer is connected, right before
   * the READ is submitted, so a test can freeze or kill a node mid-fetch.
   */
  beforeRead?: () => Promise<void>;
  stageMetrics?: (stage: string) => StageMetrics;
  /** Called with each fetch's duration in seconds (a histogram). */
  onFetchDuration?: (seconds: number) => void;
}

interface Fetch {
  readonly done: Promise<void>;
  ended: boolean;
  endedAt: number;
}

/**
 * {@link Tier} over the block index and the transfer layer.
 *
 * @example
 * ```ts
 * const peer = new PeerTier({ host: storeTierHost(store), index: () => idx, endpoint, links, checksum, log });
 * new LowerTiers({ ram: store, tiers: [ssdTier, peer] });
 * ```
 */
export class PeerTier implements Tier {
  readonly name = PEER_TIER_NAME;
  readonly label = "peer nodes";
  readonly #o: PeerTierOptions;
  readonly #fetchTimeout: number;
  readonly #rpcTimeout: number;
  readonly #lockTtl: number;
  readonly #chunkBytes: number;
  readonly #requests = new Map<string, Fetch>();
  /** Running fetches by namespace + first hash: a request starting there joins. */
  readonly #running = new Map<string, Fetch>();
  readonly #xferPeers: XferPeers;
  readonly #memo = new LookupMemo();
  readonly #checksums: SealChecksums;
  /** Lock releases in the background (and those of calls that got no answer), for flush and close. */
  readonly #pending = new Set<Promise<unknown>>();
  readonly #stats: FetchTotals = fetchTotals();
  /** Steps 1–2 of each fetch: the index's owners, asked in order until one locks. */
  readonly #walk: OwnerWalk;
  #closed = false;

  constructor(opts: PeerTierOptions) {
    this.#o = opts;
    this.#fetchTimeout = opts.fetchTimeoutMs ?? DEFAULT_PEER_FETCH_TIMEOUT_MS;
    this.#rpcTimeout = opts.rpcTimeoutMs ?? DEFAULT_PEER_RPC_TIMEOUT_MS;
    this.#lockTtl = opts.lockTtlMs ?? this.#fetchTimeout + this.#rpcTimeout;
    this.#chunkBytes = opts.chunkBytes ?? PIPELINE_CHUNK_BYTES;
    this.#checksums = new SealChecksums(
      opts.host,
      opts.checksum,
      opts.stageMetrics?.("peer.checksum"),
    );
    this.#xferPeers = new XferPeers(opts.endpoint, this.#rpcTimeout, opts.log, {
      transport: opts.transport,
      trade: (addr, peerInfo) =>
        opts.links.connect(addr, {
          requester: opts.index()?.nodeId ?? "",
          transport: opts.transport,
          peerInfo,
        }, this.#rpcTimeout),
    });
    this.#walk = new OwnerWalk({
      host: opts.host,
      links: opts.links,
      xferPeers: this.#xferPeers,
      transport: opts.transport,
      log: opts.log,
      fetchTimeoutMs: this.#fetchTimeout,
      rpcTimeoutMs: this.#rpcTimeout,
      lockTtlMs: this.#lockTtl,
      chunkBytes: this.#chunkBytes,
      splitLock: opts.splitLock !== false,
      skipped: this.#stats.ownersSkipped,
      suspected: this.#stats.ownersSuspected,
      suspectMs: opts.ownerSuspectMs,
      looked: (ns, first, length) => this.#memo.record(this.#key(ns, first), length),
      track: (p) => this.#track(p),
    });
  }

  /** The held prefix as the last lookup of this prefix answered it (no I/O). */
  has(blocks: TierBlocks): number {
    if (blocks.hashes.length === 0) return 0;
    const held = this.#memo.length(this.#key(blocks.namespace, blocks.hashes[0]));
    return Math.min(held, blocks.hashes.length);
  }

  /**
   * Sealed blocks: their checksums are computed (one native call per batch)
   * and recorded, for the locks peers will ask for. The index advertiser
   * publishes the blocks themselves. Never waits.
   */
  put(blocks: TierBlocks): TierPutResult {
    const n = blocks.hashes.length;
    if (this.#closed || !this.#checksums.submit(blocks.namespace, blocks.hashes)) {
      return { status: "dropped", blocks: n, duplicates: 0 };
    }
    return { status: "queued", blocks: n, duplicates: 0 };
  }

  prefetch(requestId: string, blocks: TierBlocks): TierPrefetchAnswer {
    if (this.#closed) return { state: "miss", reason: "closed" };
    if (this.#requests.has(requestId)) return { state: "loading" };
    const index = this.#o.index();
    if (!index || !index.stats().up || blocks.hashes.length === 0) {
      return { state: "miss", reason: "not-held" };
    }
    if (this.#o.host.payloadBytes(blocks.namespace) === undefined) {
      return { state: "miss", reason: "not-held" };
    }
    this.#sweep();
    const key = this.#key(blocks.namespace, blocks.hashes[0]);
    let f = this.#running.get(key);
    if (!f) {
      const fetch: Fetch = {
        ended: false,
        endedAt: 0,
        done: this.#fetch(index, blocks, requestId).finally(() => {
          fetch.ended = true;
          fetch.endedAt = monotonicNow();
          if (this.#running.get(key) === fetch) this.#running.delete(key);
        }),
      };
      this.#running.set(key, f = fetch);
    }
    this.#requests.set(requestId, f);
    return { state: "loading" };
  }

  take(requestId: string): TierTakeAnswer {
    const f = this.#requests.get(requestId);
    if (!f) return { state: "none" };
    if (!f.ended) return { state: "loading" };
    this.#requests.delete(requestId);
    return { state: "ready" };
  }

  settled(requestId: string): Promise<void> | undefined {
    const f = this.#requests.get(requestId);
    if (!f || f.ended) return undefined;
    return f.done.then(() => {}, () => {});
  }

  /** A peer tier holds no copy of its own (it fetches from the owner): nothing to forget. */
  drop(): number {
    return 0;
  }

  /** A peer tier keeps nothing across restarts. */
  storedLayouts(): readonly StoredLayout[] {
    return [];
  }

  health(): TierHealth {
    return { state: this.#closed ? "closed" : "up", capacityBytes: 0, usedBytes: 0, blocks: 0 };
  }

  /** Keeps `p` (a background release) until it settles, for flush and close. */
  #track(p: Promise<unknown>): void {
    this.#pending.add(p);
    p.finally(() => this.#pending.delete(p));
  }

  /** Resolves when every checksum job, fetch and lock release started so far has ended. */
  async flush(): Promise<void> {
    await this.#checksums.flush();
    while (this.#pending.size > 0) await Promise.all(this.#pending);
    await Promise.all([...this.#running.values()].map((f) => f.done));
  }

  /** Lets running fetches end (each has a deadline), then closes the transfer peers. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await this.#checksums.close();
    await Promise.all([...this.#running.values()].map((f) => f.done));
    while (this.#pending.size > 0) await Promise.all(this.#pending);
    await this.#xferPeers.close();
  }

  stats(): PeerTierStats {
    return {
      ...this.#stats,
      failures: { ...this.#stats.failures },
      ownersSkipped: { ...this.#stats.ownersSkipped },
      ownersSuspected: { ...this.#stats.ownersSuspected },
      checksumsAtSeal: this.#checksums.recorded,
      checksumDropped: this.#checksums.dropped,
      inflight: this.#running.size,
    };
  }

  #key(namespace: string, first: Uint8Array): string {
    return `${namespace}\n${hashHex(first)}`;
  }

  #sweep(): void {
    const old = monotonicNow() - FORGET_AFTER_MS;
    for (const [id, f] of this.#requests) if (f.ended && f.endedAt < old) this.#requests.delete(id);
    this.#memo.sweep();
  }

  /** One fetch; never rejects (every failure is counted and is a miss). */
  async #fetch(index: PeerIndex, blocks: TierBlocks, requestId: string): Promise<void> {
    const t0 = performance.now();
    this.#stats.fetches++;
    // The request that started it (others may join): every failure's log names all three.
    const ids = {
      namespace: blocks.namespace,
      first_block: hashHex(blocks.hashes[0]),
      request: requestId,
    };
    try {
      // Counted once per fetch, under its first failure's reason.
      await this.#fetchOnce(index, blocks, fetchFailures(this.#stats, this.#o.log, ids), ids);
    } catch (e) {
      // A bug, not an outage: log it loudly; the request still ends as a miss.
      this.#o.log.error("peer fetch failed", { ...ids, error: (e as Error).message });
    } finally {
      this.#o.onFetchDuration?.((performance.now() - t0) / 1000);
    }
  }

  /** Reads one locked part into pool space here (read.ts). */
  #read(part: LockedPart & { hashes: Uint8Array[] }, ns: string, owner: Owner, peer: XferPeer) {
    return readLockedPrefix(this.#o.host, peer, {
      namespace: ns,
      owner: owner.nodeId,
      hashes: part.hashes,
      remote: part.remote,
      payloadBytes: part.res.payloadBytes,
      checksums: part.res.checksums,
    }, {
      filler: tierHolder(PEER_TIER_NAME),
      chunkBytes: this.#chunkBytes,
      // Not past the owner's lock: once it expired, the owner may reuse the ranges.
      deadlineMs: Math.min(this.#fetchTimeout, Math.floor(part.expiresAt - monotonicNow())),
      log: this.#o.log,
      dropPeer: () => void this.#xferPeers.drop(owner.addr, peer),
    });
  }

  async #fetchOnce(index: PeerIndex, blocks: TierBlocks, fail: FailFn, ids: FetchIds) {
    const { namespace } = blocks;
    const t0 = performance.now();
    const locked = await this.#walk.lockFirst(index, blocks, fail, ids, t0);
    if (!locked) return;
    const { owner, peer, first, rest, tLookup, tConnect, tLock, skipped } = locked;
    if (this.#o.beforeRead) await this.#o.beforeRead();
    // Part 1 reads while part 2 (if any) is locked; its chunks queue behind part 1's on the wire.
    const releases = [first.release];
    const reads = [this.#read(first, namespace, owner, peer)];
    reads[0].catch(() => {}); // handled below; may fail while part 2 is locked
    let tLock2 = 0;
    if (rest) {
      const second = await rest();
      tLock2 = performance.now();
      // Its failure is counted, never passed over: the first part is this owner's.
      if ("why" in second) fail(second.why, second.fields);
      else {
        releases.push(second.release);
        reads.push(this.#read(second, namespace, owner, peer));
      }
    }
    const { read, releaseAll } = await readParts(reads, releases);
    this.#stats.readBytes += read.readBytes;
    // Nothing read past the owner's lock counts as a timeout; other refusals as the transfer's.
    const refusal = read.expired ? "timeout" : "transfer";
    if (read.chunks === 0) {
      await releaseAll();
      return read.refused !== undefined
        ? fail(refusal, { owner: owner.nodeId, error: read.refused })
        : fail("no-pool-space", { owner: owner.nodeId });
    }
    const { good, bad, failed, readEnd, planned, tSubmit, tPlanned } = read;
    const tVerify = performance.now();
    this.#stats.readSeconds += readEnd / 1e3;
    // The blocks are committed: the answer need not wait for the release's round trip.
    this.#track(releaseAll());
    // Checksums were recorded as each chunk committed (read.ts); those still held are advertised.
    if (good.length > 0) this.#o.host.committed(namespace, good);
    if (failed && peer.state().broken !== 0) void this.#xferPeers.drop(owner.addr, peer);
    if (failed) {
      fail(failed.statusName === "PF_ETIMEDOUT" ? "timeout" : "transfer", {
        owner: owner.nodeId,
        status: failed.statusName,
      });
    }
    // A later batch refused before anything moved (ranges outside the owner's pool, a broken peer).
    if (read.refused !== undefined) fail(refusal, { owner: owner.nodeId, error: read.refused });
    if (bad > 0) this.#stats.failures.checksum += bad;
    if (good.length > 0) this.#stats.fetchesOk++;
    this.#stats.blocks += good.length;
    this.#stats.bytes += good.length * first.res.payloadBytes;
    this.#o.log.info("peer fetch done", {
      owner: owner.nodeId,
      owners_skipped: skipped,
      namespace,
      blocks: good.length,
      planned,
      bad,
      chunks: read.chunks,
      bytes: good.length * first.res.payloadBytes,
      lookup_ms: ms(t0, tLookup),
      connect_ms: ms(tLookup, tConnect),
      lock_ms: ms(tConnect, tLock),
      lock_rest_ms: tLock2 ? ms(tLock, tLock2) : 0,
      plan_ms: ms(tSubmit, tPlanned),
      read_ms: Math.round(readEnd * 100) / 100,
      verify_tail_ms: ms(tSubmit + readEnd, tVerify),
      total_ms: ms(t0, tVerify),
    });
  }
}

/**
 * Every part's READ (one per lock, in prefix order), merged; `releaseAll`
 * ends each lock, its release naming that part's blocks that failed their
 * checksum (the owner checks them: damage_report.ts). A part that threw:
 * once every part ended, each lock is released — a part that ended still
 * reports its damaged blocks — and the error is rethrown.
 */
async function readParts(
  reads: readonly Promise<ReadOutcome>[],
  releases: readonly LockedPart["release"][],
) {
  let parts: readonly (ReadOutcome | undefined)[] = [];
  const releaseAll = () => Promise.all(releases.map((r, i) => r(parts[i]?.badBlocks)));
  try {
    const all = await Promise.all(reads);
    parts = all;
    return { read: mergeReads(all), releaseAll };
  } catch (e) {
    // Every chunk's space was settled before a part threw; the other part's too once it ended.
    parts = (await Promise.allSettled(reads)).map((s) =>
      s.status === "fulfilled" ? s.value : undefined
    );
    await releaseAll();
    throw e;
  }
}
