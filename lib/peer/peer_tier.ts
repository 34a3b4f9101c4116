/**
 * The peer tier behind the {@link Tier} port: blocks another node holds,
 * found through the block index on Redis and read one-sided over the
 * transfer layer into this node's pool (docs/peer.md, "How a fetch goes").
 *
 * A fetch (one per request id; a request starting at the first missing block
 * of a running fetch joins it): 1. longest-prefix lookup in the index; 2. a
 * transfer lock on the owner with the longest run (lock_call.ts, over its
 * peer RPC socket): its first chunk's blocks alone when the prefix is longer
 * than two chunks, the rest while that chunk reads; 3. each locked part read
 * in chunks of {@link PIPELINE_CHUNK_BYTES} into pool space here, the
 * "reclaimable" class (read.ts: one batch per chunk, planned while earlier
 * chunks are on the wire, each block's CRC32C computed as it lands and
 * checked against the owner's before the block is committed); 4. the locks
 * released in the background (a lost release lets them expire; a lock call
 * that got no answer releases its lock's id too, lock_call.ts).
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
import { type LockedPart, lockPart } from "./lock_call.ts";
import type { PeerLinks } from "./link.ts";
import { SealChecksums } from "./seal_checksums.ts";
import { type OwnerLink, XferPeers } from "./xfer_peers.ts";
import { monotonicNow } from "../clock.ts";
import { LookupMemo } from "./lookup_memo.ts";
import {
  type FailFn,
  fetchFailures,
  type FetchTotals,
  fetchTotals,
  type PeerTierStats,
} from "./fetch_stats.ts";
import { LayoutWarnings } from "./layout_warnings.ts";

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
/**
 * Most blocks one fetch locks and reads (2 GiB of Llama-3.1-8B blocks): it
 * bounds the lock answer (extents of a block of 80 layers × TP 8 × K/V are
 * 20 KiB), which must fit the owner's --max-message-size (64 MiB default).
 * A longer prefix is fetched up to here; the engine loads that part.
 */
const MAX_FETCH_BLOCKS = 1024;
/** What names a fetch in its logs: namespace, first block, the request that started it. */
type FetchIds = Record<string, string>;
/** An owner as the index names it. */
type Owner = LookupResult["owners"][number];

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
  /** (owner, namespace) whose lock refused this node's layout, logged (bounded). */
  readonly #warnedLayouts = new LayoutWarnings();
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

  /**
   * Steps 1–2: the longest owner from the index, a transfer peer to it (the
   * handshake, once per owner, names its peer RPC socket), the lock of the
   * prefix's first part (its first chunk when the lock is split, else all of
   * it). Undefined (the failure counted) on a failure.
   */
  async #lockFromOwner(index: PeerIndex, blocks: TierBlocks, fail: FailFn, ids: FetchIds) {
    const { namespace, hashes, layout } = blocks;
    const found = await index.lookup(namespace, hashes);
    const tLookup = performance.now();
    if (!found.available) return fail("index-down");
    this.#memo.record(this.#key(namespace, hashes[0]), found.length);
    const owner = found.owners[0];
    if (!owner || owner.length === 0) return fail("no-owner");
    let link: OwnerLink;
    try {
      link = await this.#xferPeers.get(owner.addr);
    } catch (e) {
      return fail("connect", {
        owner: owner.nodeId,
        addr: owner.addr,
        error: (e as Error).message,
      });
    }
    const tConnect = performance.now();
    const want = hashes.slice(0, Math.min(owner.length, MAX_FETCH_BLOCKS));
    const expect = {
      payloadBytes: this.#o.host.payloadBytes(namespace),
      transport: this.#o.transport,
      layoutSummary: layout.summary,
    };
    const target = { addr: owner.addr, rpcAddr: link.rpcAddr, nodeId: owner.nodeId };
    const lock = async (part: Uint8Array[]) => {
      const ask = {
        namespace,
        blockHashes: part,
        layoutFingerprint: layout.fingerprint,
        requester: index.nodeId,
        lockTtlMs: this.#lockTtl,
        shiftedExtents: true,
      };
      const l = await lockPart(this.#o.links, target, ask, expect, this.#rpcTimeout, this.#o.log);
      if ("res" in l) return { ...l, hashes: part.slice(0, l.res.checksums.length) };
      if (l.abandon) this.#track(l.abandon); // the owner may grant it yet: it ends it then
      // Its socket is gone (a restart, maybe on another port): handshake again next time.
      if (l.socketGone) void this.#xferPeers.drop(owner.addr, link.peer);
      if (l.fields.miss_reason === "other-layout") this.#warnOtherLayout(l.fields, namespace, ids);
      fail(l.why, l.fields);
    };
    const per = Math.max(1, Math.floor(this.#chunkBytes / (expect.payloadBytes ?? 1)));
    const head = this.#o.splitLock !== false && want.length > 2 * per ? per : want.length;
    const first = await lock(want.slice(0, head));
    if (!first) return;
    const tLock = performance.now();
    // The rest only where the first part is whole (a shorter answer: the held prefix ends there).
    const rest = first.hashes.length === head && head < want.length
      ? () => lock(want.slice(head))
      : undefined;
    return { owner, peer: link.peer, first, rest, tLookup, tConnect, tLock };
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
    const locked = await this.#lockFromOwner(index, blocks, fail, ids);
    if (!locked) return;
    const { owner, peer, first, rest, tLookup, tConnect, tLock } = locked;
    if (this.#o.beforeRead) await this.#o.beforeRead();
    // Part 1 reads while part 2 (if any) is locked; its chunks queue behind part 1's on the wire.
    const releases = [first.release];
    const reads = [this.#read(first, namespace, owner, peer)];
    reads[0].catch(() => {}); // handled below; may fail while part 2 is locked
    let tLock2 = 0;
    if (rest) {
      const second = await rest();
      tLock2 = performance.now();
      if (second) {
        releases.push(second.release);
        reads.push(this.#read(second, namespace, owner, peer));
      }
    }
    const releaseAll = () => Promise.all(releases.map((r) => r()));
    let read: ReadOutcome;
    try {
      read = mergeReads(await Promise.all(reads));
    } catch (e) {
      // Every chunk's space was settled before a part threw; the other part's too once it ended.
      await Promise.allSettled(reads);
      await releaseAll();
      throw e;
    }
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
    const ms = (a: number, b: number) => Math.round((b - a) * 100) / 100;
    this.#o.log.info("peer fetch done", {
      owner: owner.nodeId,
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
