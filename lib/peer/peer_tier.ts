/**
 * The peer tier behind the {@link Tier} port: blocks another node holds,
 * found through the block index on Redis and read one-sided over the
 * transfer layer into this node's pool (docs/peer.md).
 *
 * A fetch (one per request id; a request whose first missing block is being
 * fetched for another request joins that fetch):
 *  1. longest-prefix lookup in the index (one round trip, its own deadline);
 *  2. `QueryBlocksForTransfer` on the owner with the longest run, over its
 *     peer RPC socket (link.ts): it pins the prefix it still holds under a
 *     transfer lock and answers each block's pool ranges and CRC32C;
 *  3. pool space for each block here (`TierHost.fill`, whole blocks, the
 *     "reclaimable" class: evicted before blocks saved here);
 *  4. the prefix is read in chunks of {@link PIPELINE_CHUNK_BYTES}: ONE
 *     transfer batch per chunk (owner ranges paired with ours in payload
 *     order, a deadline each), planned and submitted while the earlier
 *     chunks are on the wire;
 *  5. each block is one checksum group of its chunk's batch: the transport
 *     computes its CRC32C on the receiving thread as the bytes land (no
 *     second pass over memory) and hands them back with the completion;
 *     a block whose CRC32C matches the owner's is committed (sealed: the
 *     next poll is a RAM hit) and its checksum recorded, one that does not
 *     is freed and counted;
 *  6. the lock is released in the background once every block is settled
 *     (a lost release only lets it expire on the owner).
 *
 * Memory safety (the original system's #403): a fill's pool space is freed
 * only after the transport's completion record for its batch, posted (on
 * success, failure, timeout or close) once no thread or NIC can still write
 * into the batch's ranges (docs/transfer.md): a late response never lands in
 * memory handed to another block. Every batch has a deadline, so it comes.
 *
 * Every failure is a miss — never bytes: no owner, owner lost the blocks
 * (evicted between lookup and lock), owner died mid-read (the connection
 * reports it), deadline, checksum mismatch. Each is counted by reason.
 *
 * @module
 */

import type {
  StoredLayout,
  Tier,
  TierBlocks,
  TierHealth,
  TierHost,
  TierPrefetchAnswer,
  TierPutResult,
  TierTakeAnswer,
} from "../storage/tier.ts";
import { hashHex } from "../storage/keys.ts";
import type { StageMetrics } from "../pipeline/stage.ts";
import type { LookupResult } from "../index/block_index.ts";
import type { XferEndpoint } from "../../ffi/xfer.ts";
import type { QueryBlocksForTransferResponse } from "../../proto/pegaflow.ts";
import type { Logger } from "../log.ts";
import type { ChecksumFn } from "./locks.ts";
import { readLockedPrefix, type ReadOutcome } from "./read.ts";
import { remoteExtents } from "./extents_wire.ts";
import { type PeerLinks, PeerRpcError } from "./link.ts";
import { SealChecksums } from "./seal_checksums.ts";
import { type OwnerLink, XferPeers } from "./xfer_peers.ts";

/** Name of the peer tier: metric label, hit attribution, filler of its blocks. */
export const PEER_TIER_NAME = "peer";
/** Default deadline of a whole fetch's READ batch. */
export const DEFAULT_PEER_FETCH_TIMEOUT_MS = 5_000;
/** Deadline of the lock and release RPCs and of a transport connect. */
export const DEFAULT_PEER_RPC_TIMEOUT_MS = 2_000;
/** Finished fetches nobody polled are forgotten after this long (their blocks stay cached). */
const FORGET_AFTER_MS = 60_000;
/**
 * Bytes per READ batch of a fetch: big enough that each batch still stripes
 * over every stream at full rate, small enough that committing one chunk's
 * blocks overlaps the next chunks' reads.
 */
export const PIPELINE_CHUNK_BYTES = 32 << 20;
/**
 * Most blocks one fetch locks and reads (2 GiB of Llama-3.1-8B blocks): it
 * bounds the lock answer (extents of a block of 80 layers × TP 8 × K/V are
 * 20 KiB), which must fit the owner's --max-message-size (64 MiB default).
 * A longer prefix is fetched up to here; the engine loads that part.
 */
const MAX_FETCH_BLOCKS = 1024;
/** A lookup result answers `has` for this long. */
const LOOKUP_MEMO_MS = 1_000;

/** What the tier needs from the block index (a RedisBlockIndex fits). */
export interface PeerIndex {
  readonly nodeId: string;
  lookup(namespace: string, hashes: readonly Uint8Array[]): Promise<LookupResult>;
  stats(): { up: boolean };
}

/** Why a fetch brought nothing (or less than the owner locked). */
export type PeerFetchFailure =
  | "index-down"
  | "no-owner"
  | "owner-miss"
  | "lock-rpc"
  | "bad-answer"
  | "no-pool-space"
  | "connect"
  | "transfer"
  | "timeout"
  | "checksum";

/** Counters for /metrics. */
export interface PeerTierStats {
  fetches: number;
  /** Fetches that committed at least one block. */
  fetchesOk: number;
  failures: Record<PeerFetchFailure, number>;
  blocks: number;
  bytes: number;
  /** Bytes and time of the READ batches that ended OK (the transport's own ns), for the wire rate. */
  readBytes: number;
  readSeconds: number;
  /** Checksums recorded after a seal (the checksum stage). */
  checksumsAtSeal: number;
  /** Seal batches the full checksum queue dropped (their checksums are computed at lock time). */
  checksumDropped: number;
  /** Fetches running now. */
  inflight: number;
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
  readonly #requests = new Map<string, Fetch>();
  /** Running fetches by namespace + first hash: a request starting there joins. */
  readonly #running = new Map<string, Fetch>();
  readonly #xferPeers: XferPeers;
  readonly #memo = new Map<string, { length: number; at: number }>();
  readonly #checksums: SealChecksums;
  /** Lock releases in the background, for flush and close. */
  readonly #pending = new Set<Promise<unknown>>();
  readonly #stats: Omit<PeerTierStats, "inflight" | "checksumsAtSeal" | "checksumDropped"> = {
    fetches: 0,
    fetchesOk: 0,
    failures: {
      "index-down": 0,
      "no-owner": 0,
      "owner-miss": 0,
      "lock-rpc": 0,
      "bad-answer": 0,
      "no-pool-space": 0,
      connect: 0,
      transfer: 0,
      timeout: 0,
      checksum: 0,
    },
    blocks: 0,
    bytes: 0,
    readBytes: 0,
    readSeconds: 0,
  };
  #closed = false;

  constructor(opts: PeerTierOptions) {
    this.#o = opts;
    this.#fetchTimeout = opts.fetchTimeoutMs ?? DEFAULT_PEER_FETCH_TIMEOUT_MS;
    this.#rpcTimeout = opts.rpcTimeoutMs ?? DEFAULT_PEER_RPC_TIMEOUT_MS;
    this.#lockTtl = opts.lockTtlMs ?? this.#fetchTimeout + this.#rpcTimeout;
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
    const m = this.#memo.get(this.#key(blocks.namespace, blocks.hashes[0]));
    return m && Date.now() - m.at < LOOKUP_MEMO_MS ? Math.min(m.length, blocks.hashes.length) : 0;
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
        done: this.#fetch(index, blocks).finally(() => {
          fetch.ended = true;
          fetch.endedAt = Date.now();
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
    const old = Date.now() - FORGET_AFTER_MS;
    for (const [id, f] of this.#requests) if (f.ended && f.endedAt < old) this.#requests.delete(id);
    for (const [k, m] of this.#memo) if (m.at < Date.now() - LOOKUP_MEMO_MS) this.#memo.delete(k);
  }

  #fail(why: PeerFetchFailure, fields: Record<string, string | number> = {}): void {
    this.#stats.failures[why]++;
    this.#o.log.debug("peer fetch brought nothing", { reason: why, ...fields });
  }

  /** One fetch; never rejects (every failure is counted and is a miss). */
  async #fetch(index: PeerIndex, blocks: TierBlocks): Promise<void> {
    const t0 = performance.now();
    this.#stats.fetches++;
    try {
      await this.#fetchOnce(index, blocks);
    } catch (e) {
      // A bug, not an outage: log it loudly; the request still ends as a miss.
      this.#o.log.error("peer fetch failed", {
        namespace: blocks.namespace,
        error: (e as Error).message,
      });
    } finally {
      this.#o.onFetchDuration?.((performance.now() - t0) / 1000);
    }
  }

  /**
   * Steps 1–2: the longest owner from the index, a transfer peer to it (the
   * handshake, once per owner, names its peer RPC socket), its lock, the
   * answer checked. Undefined (failure counted, lock released) on a failure.
   */
  async #lockFromOwner(index: PeerIndex, blocks: TierBlocks) {
    const { namespace, hashes, layout } = blocks;
    const found = await index.lookup(namespace, hashes);
    const tLookup = performance.now();
    if (!found.available) return this.#fail("index-down");
    this.#memo.set(this.#key(namespace, hashes[0]), { length: found.length, at: Date.now() });
    const owner = found.owners[0];
    if (!owner || owner.length === 0) return this.#fail("no-owner");
    let link: OwnerLink;
    try {
      link = await this.#xferPeers.get(owner.addr);
    } catch (e) {
      return this.#fail("connect", { owner: owner.nodeId, error: (e as Error).message });
    }
    const { peer, rpcAddr } = link;
    const tConnect = performance.now();
    const want = hashes.slice(0, Math.min(owner.length, MAX_FETCH_BLOCKS));
    const ask = {
      namespace,
      blockHashes: want,
      layoutFingerprint: layout.fingerprint,
      requester: index.nodeId,
      lockTtlMs: this.#lockTtl,
      shiftedExtents: true,
    };
    let res: QueryBlocksForTransferResponse;
    try {
      res = await this.#o.links.lock(owner.addr, ask, this.#rpcTimeout, rpcAddr);
    } catch (e) {
      // Its socket is gone (a restart, maybe on another port): handshake again next time.
      if (e instanceof PeerRpcError && e.socketGone) this.#xferPeers.drop(owner.addr, peer);
      return this.#fail("lock-rpc", { owner: owner.nodeId, error: (e as Error).message });
    }
    if (res.lockId.length === 0) {
      return this.#fail("owner-miss", { owner: owner.nodeId, reason: res.missReason });
    }
    const tLock = performance.now();
    const release = () =>
      this.#o.links.release(owner.addr, res.lockId, index.nodeId, this.#rpcTimeout, rpcAddr)
        .catch((e: Error) =>
          this.#o.log.debug("peer lock release failed; it expires on the owner", {
            owner: owner.nodeId,
            error: e.message,
          })
        );
    const local = this.#o.host.payloadBytes(namespace);
    const remote = remoteExtents(res);
    const mine = this.#o.transport;
    if (typeof remote === "string" || res.payloadBytes !== local || res.transport !== mine) {
      await release();
      const why = typeof remote === "string"
        ? remote
        : res.payloadBytes !== local
        ? `block payload ${res.payloadBytes} bytes, ${local} here`
        : `owner transport ${res.transport}, this node ${mine}`;
      return this.#fail("bad-answer", { owner: owner.nodeId, error: why });
    }
    return { owner, want, res, remote, release, peer, tLookup, tConnect, tLock };
  }

  async #fetchOnce(index: PeerIndex, blocks: TierBlocks): Promise<void> {
    const { namespace } = blocks;
    const t0 = performance.now();
    const locked = await this.#lockFromOwner(index, blocks);
    if (!locked) return;
    const { owner, want, res, remote, release, peer, tLookup, tConnect, tLock } = locked;
    if (this.#o.beforeRead) await this.#o.beforeRead();

    let read: ReadOutcome;
    try {
      read = await readLockedPrefix(this.#o.host, peer, {
        namespace,
        owner: owner.nodeId,
        hashes: want,
        remote,
        payloadBytes: res.payloadBytes,
        checksums: res.checksums,
      }, {
        filler: PEER_TIER_NAME,
        chunkBytes: this.#o.chunkBytes ?? PIPELINE_CHUNK_BYTES,
        deadlineMs: this.#fetchTimeout,
        log: this.#o.log,
        dropPeer: () => this.#xferPeers.drop(owner.addr, peer),
      });
    } catch (e) {
      await release(); // every chunk's space was settled before the throw
      throw e;
    }
    this.#stats.readBytes += read.readBytes;
    if (read.chunks === 0) {
      await release();
      return read.refused !== undefined
        ? this.#fail("transfer", { owner: owner.nodeId, error: read.refused })
        : this.#fail("no-pool-space", { owner: owner.nodeId });
    }
    const { good, goodCrcs, bad, failed, readEnd, planned, tSubmit, tPlanned } = read;
    const tVerify = performance.now();
    this.#stats.readSeconds += readEnd / 1e3;
    // The blocks are committed: the answer need not wait for the release's round trip.
    this.#track(release());
    if (good.length > 0) {
      this.#o.host.recordChecksums(namespace, good, goodCrcs);
      this.#o.host.committed(namespace, good); // advertised once per fetch
    }
    if (failed && peer.state().broken !== 0) this.#xferPeers.drop(owner.addr, peer);
    if (failed) {
      this.#fail(failed.statusName === "PF_ETIMEDOUT" ? "timeout" : "transfer", {
        owner: owner.nodeId,
        status: failed.statusName,
      });
    }
    if (bad > 0) this.#stats.failures.checksum += bad;
    if (good.length > 0) this.#stats.fetchesOk++;
    this.#stats.blocks += good.length;
    this.#stats.bytes += good.length * res.payloadBytes;
    const ms = (a: number, b: number) => Math.round((b - a) * 100) / 100;
    this.#o.log.info("peer fetch done", {
      owner: owner.nodeId,
      namespace,
      blocks: good.length,
      planned,
      bad,
      chunks: read.chunks,
      bytes: good.length * res.payloadBytes,
      lookup_ms: ms(t0, tLookup),
      connect_ms: ms(tLookup, tConnect),
      lock_ms: ms(tConnect, tLock),
      plan_ms: ms(tSubmit, tPlanned),
      read_ms: Math.round(readEnd * 100) / 100,
      verify_tail_ms: ms(tSubmit + readEnd, tVerify),
      total_ms: ms(t0, tVerify),
    });
  }
}
