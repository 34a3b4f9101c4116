/**
 * The cross-node block index on Redis: which other nodes hold a sealed block
 * `(namespace, hash)`, and who holds the longest prefix of a hash chain.
 *
 * Every call is ONE round trip (one script call, lib/index/scripts.ts) with a
 * deadline, whatever the number of blocks. Redis being down never reaches the
 * caller as an exception: advertise/withdraw answer `false`, lookup answers a
 * miss, the error is counted and logged once per outage
 * (lib/index/availability.ts), and the node keeps serving from its own tiers.
 *
 * Liveness: the node heartbeats one field per namespace it advertised into;
 * block entries carry the node's incarnation (random, new per process start
 * and per re-join). When Redis answers again after an outage, or reports
 * that this node's registration was lost (Redis restarted, failover, a stall
 * past the TTL), the node re-joins under a new incarnation — which makes all
 * its older entries dead at once, including any whose withdraw was lost —
 * and re-advertises what it holds (lib/index/rejoin.ts). A new process under
 * the same node id voids what its previous life advertised: every join is
 * recorded in the node's own key, which the first re-join reads; a live one
 * at another address keeps the id (`NodeIdConflict`, lib/index/rejoin.ts).
 *
 * Bad input (namespace, hash) throws {@link IndexInputError}: it is the
 * caller's bug, not an outage.
 *
 * @module
 */

import { Buffer } from "node:buffer";
import { Availability } from "./availability.ts";
import { Logger } from "../log.ts";
import { IndexInputError } from "./errors.ts";
import {
  checkNodeToken,
  namespaceTag,
  nodeSetKey,
  nodeSetPrefix,
  nodesKey,
  packHashes,
} from "./keys.ts";
import type { IndexMetrics, IndexOp } from "./metrics.ts";
import { checkRedisTarget, type IndexRedis, indexRedisClient } from "./connection.ts";
import type { IndexRedisTarget } from "./connection.ts";
import { execBatch, heartbeatCommands, reachCommand } from "./batch.ts";
import { withinOrThrow } from "../timer_limit.ts";
import { advertiseArgs } from "./scripts.ts";
import { NodeIdConflict, Rejoin } from "./rejoin.ts";
import { JoinOrder } from "./join_order.ts";

/** Deadline of one index call: a local Redis answers in ~0.1-1 ms; past this, serve locally. */
export const DEFAULT_INDEX_TIMEOUT_MS = 250;
/** A node whose heartbeat stops is dead for lookups after this long. */
export const DEFAULT_NODE_TTL_MS = 15_000;
/** Blocks per re-advertise call: one 10K-token save, 625 blocks. */
export const DEFAULT_REPUBLISH_BATCH = 625;
/** Heartbeats per node TTL: two may be lost before the node is taken for dead. */
const HEARTBEATS_PER_TTL = 3;
/** Random bytes of an incarnation id. */
const INCARNATION_BYTES = 8;

/** A block this node holds, as `listSealed()` reports it. */
export interface SealedBlock {
  namespace: string;
  hash: Uint8Array;
}

/** Another node that holds a prefix of the looked-up hashes. */
export interface PeerOwner {
  nodeId: string;
  /** What to dial (the node's `--advertise-addr`). */
  addr: string;
  /** How many blocks from the first one this node holds without a gap. */
  length: number;
}

/** The answer to {@link RedisBlockIndex.lookup}. */
export interface LookupResult {
  /** Longest prefix in which every block has at least one live owner (other than this node). */
  length: number;
  /** Owners holding at least the first block, longest run first. */
  owners: PeerOwner[];
  /** False when Redis did not answer in time: the answer is a miss, not knowledge. */
  available: boolean;
}

/** Options of {@link RedisBlockIndex}. */
export interface BlockIndexOptions extends IndexRedisTarget {
  /** This node's id in the index (unique per live node). */
  nodeId: string;
  /** What peers dial to fetch from this node. */
  advertiseAddr: string;
  /** What this node holds now; read on re-advertise (after an outage or a lost registration). */
  listSealed: () => Iterable<SealedBlock>;
  /**
   * Whether this node still holds a block: a re-advertise checks each batch at send time (it
   * awaits batch after batch, and a block evicted meanwhile, its withdraw already sent, must
   * not be advertised again). Default: every block listed is held.
   */
  isHeld?: (namespace: string, hash: Uint8Array) => boolean;
  /** Deadline of each call in ms. Default {@link DEFAULT_INDEX_TIMEOUT_MS}. */
  timeoutMs?: number;
  /** Node liveness TTL in ms. Default {@link DEFAULT_NODE_TTL_MS}. */
  nodeTtlMs?: number;
  /** Heartbeat period in ms. Default nodeTtlMs / 3. */
  heartbeatMs?: number;
  /** Blocks per re-advertise call. Default {@link DEFAULT_REPUBLISH_BATCH}. */
  republishBatch?: number;
  /** Where outages and re-registrations are logged (default: nowhere). */
  log?: Logger;
  metrics?: IndexMetrics;
  /** Random bytes for incarnation ids. Default `crypto.getRandomValues`. */
  randomBytes?: (n: number) => Uint8Array;
}

/** Counters for tests and /health. */
export interface BlockIndexStats {
  up: boolean;
  outages: number;
  incarnation: string;
  /** Namespaces this node has joined under its current incarnation. */
  namespaces: number;
  republishedBlocks: number;
  rejoins: number;
  errors: number;
  /** While another live process holds this node id (this node is kept out): its address. */
  conflictWith: string | null;
}

/**
 * The block index of one node.
 *
 * @example
 * ```ts
 * const index = new RedisBlockIndex({
 *   url: "redis://127.0.0.1:6379", nodeId: "node-a:50055", advertiseAddr: "10.0.0.1:50055",
 *   listSealed: () => held.values(),
 * });
 * index.start();
 * await index.advertise(ns, hashes);            // one round trip for the whole save
 * const { length, owners } = await index.lookup(ns, queryHashes);
 * await index.close();
 * ```
 */
export class RedisBlockIndex {
  readonly nodeId: string;
  readonly advertiseAddr: string;
  readonly #redis: IndexRedis;
  readonly #cluster: boolean;
  readonly #timeoutMs: number;
  readonly #nodeTtlMs: number;
  readonly #heartbeatMs: number;
  readonly #batch: number;
  readonly #listSealed: () => Iterable<SealedBlock>;
  readonly #isHeld: (namespace: string, hash: Uint8Array) => boolean;
  readonly #log: Logger;
  readonly #metrics: IndexMetrics | undefined;
  readonly #random: (n: number) => Uint8Array;
  readonly #avail: Availability;
  #incarnation: string;
  /** Namespaces joined under the current incarnation (heartbeated). */
  #joined = new Set<string>();
  /** Cluster only: every namespace called on; the heartbeat probes those not joined. */
  readonly #tried = new Set<string>();
  /** Cluster only: a withdraw goes after the join of its namespace under way. */
  readonly #joins = new JoinOrder();
  readonly #rejoinPass: Rejoin;
  readonly #conflict: NodeIdConflict;
  #heartbeatTimer: ReturnType<typeof setInterval> | undefined;
  #started = false;
  #closed = false;
  #republished = 0;
  #rejoins = 0;
  #errors = 0;

  constructor(opts: BlockIndexOptions) {
    checkNodeToken("node id", opts.nodeId);
    checkNodeToken("advertise address", opts.advertiseAddr);
    const where = checkRedisTarget(opts.url, opts.cluster ?? false);
    this.nodeId = opts.nodeId;
    this.advertiseAddr = opts.advertiseAddr;
    this.#timeoutMs = positive("timeoutMs", opts.timeoutMs ?? DEFAULT_INDEX_TIMEOUT_MS);
    this.#nodeTtlMs = positive("nodeTtlMs", opts.nodeTtlMs ?? DEFAULT_NODE_TTL_MS);
    this.#heartbeatMs = positive(
      "heartbeatMs",
      opts.heartbeatMs ?? Math.max(1, Math.floor(this.#nodeTtlMs / HEARTBEATS_PER_TTL)),
    );
    if (this.#heartbeatMs >= this.#nodeTtlMs) {
      throw new IndexInputError("heartbeatMs must be shorter than nodeTtlMs", {
        expected: `< ${this.#nodeTtlMs}`,
        got: this.#heartbeatMs,
      });
    }
    this.#batch = positive("republishBatch", opts.republishBatch ?? DEFAULT_REPUBLISH_BATCH);
    this.#listSealed = opts.listSealed;
    this.#isHeld = opts.isHeld ?? (() => true);
    this.#log = opts.log ?? new Logger("error", {}, () => {});
    this.#metrics = opts.metrics;
    this.#random = opts.randomBytes ?? ((n) => crypto.getRandomValues(new Uint8Array(n)));
    this.#incarnation = this.#newIncarnation();
    this.#avail = new Availability(this.#log, this.#metrics, () => this.#recovered(), where);
    this.#cluster = opts.cluster ?? false;
    this.#redis = indexRedisClient(opts.url, this.#timeoutMs, this.#cluster, opts.tlsCa);
    this.#conflict = new NodeIdConflict(this.#log, this.#metrics, this.nodeId, this.advertiseAddr);
    this.#rejoinPass = new Rejoin({
      redis: this.#redis,
      nodeId: this.nodeId,
      advertiseAddr: this.advertiseAddr,
      nodeTtlMs: this.#nodeTtlMs,
      batch: this.#batch,
      listSealed: this.#listSealed,
      isHeld: this.#isHeld,
      incarnation: () => this.#incarnation,
      stopped: () => this.#closed || this.#conflict.active,
      joined: this.#joined,
      advertise: (ns, hashes) => this.advertise(ns, hashes),
      call: (op, blocks, f) => this.#call(op, blocks, f),
      republished: (n) => {
        this.#republished += n;
        this.#metrics?.republished(n);
      },
      refused: (tag, other, inc) => inc === this.#incarnation && this.#exclude(tag, other),
    });
    // Connection errors repeat on every reconnect attempt: counted, logged once per outage.
    this.#redis.on("error", (e: Error) => this.#failed("connect", e));
    // Connected (again): one heartbeat proves it and, after an outage, starts the re-join.
    this.#redis.on("ready", () => void this.heartbeat());
  }

  /** Connects in the background and starts the heartbeat timer. Never throws. */
  start(): void {
    if (this.#started || this.#closed) return;
    this.#started = true;
    this.#redis.connect().catch((e: Error) => this.#failed("connect", e));
    this.#heartbeatTimer = setInterval(() => void this.heartbeat(), this.#heartbeatMs);
  }

  /** The current incarnation id (changes on every re-join). */
  get incarnation(): string {
    return this.#incarnation;
  }

  /** True while the last call to Redis succeeded. */
  get up(): boolean {
    return this.#avail.up;
  }

  /**
   * Advertises sealed blocks of one namespace: one round trip. Resolves true
   * when Redis took them, false when it was unreachable (counted; the blocks
   * are advertised again when it answers), this node's registration was
   * lost (a re-join with a full re-advertise is started) or another live
   * process holds this node id (nothing is sent; its join re-advertises them).
   */
  async advertise(namespace: string, hashes: readonly Uint8Array[]): Promise<boolean> {
    const p = packHashes(namespace, hashes);
    if (this.#closed || this.#conflict.active) return false;
    if (p.count === 0) return true;
    if (this.#cluster) this.#tried.add(namespace);
    const inc = this.#incarnation;
    const res = await this.#advertiseCall(namespace, inc, !this.#joined.has(namespace), p);
    if (res === undefined) return false;
    if (res === 1) {
      if (inc === this.#incarnation) this.#joined.add(namespace);
      return true;
    }
    if (inc === this.#incarnation) this.#lost(namespace, res);
    return false;
  }

  /**
   * Withdraws evicted blocks of one namespace: one round trip; false when Redis was unreachable
   * or another live process holds this node id (nothing is sent).
   */
  async withdraw(namespace: string, hashes: readonly Uint8Array[]): Promise<boolean> {
    const p = packHashes(namespace, hashes);
    if (this.#closed || this.#conflict.active) return false;
    if (p.count === 0) return true;
    if (this.#cluster) this.#tried.add(namespace);
    const inc = this.#incarnation;
    const send = () =>
      this.#redis.pfWithdraw(
        2,
        nodesKey(namespace),
        nodeSetKey(namespace, this.nodeId, inc),
        p.hashBytes,
        p.blob,
      );
    // Cluster: after the join under way, if any; else sent now, in call order.
    const joining = this.#joins.after(namespace);
    const res = await this.#call("withdraw", p.count, () => joining?.then(send) ?? send());
    return res !== undefined;
  }

  /**
   * The longest prefix of `hashes` that other live nodes hold, and who holds
   * it: one round trip. Never throws for an outage: it answers
   * `{length: 0, owners: [], available: false}`. A named owner may have lost
   * the blocks since (eviction races, failover): the fetch must verify.
   */
  async lookup(namespace: string, hashes: readonly Uint8Array[]): Promise<LookupResult> {
    const p = packHashes(namespace, hashes);
    if (this.#closed) return { length: 0, owners: [], available: false };
    if (p.count === 0) return { length: 0, owners: [], available: true };
    if (this.#cluster) this.#tried.add(namespace);
    const res = await this.#call("lookup", p.count, () =>
      this.#redis.pfLookup(
        1,
        nodesKey(namespace),
        this.nodeId,
        nodeSetPrefix(namespace),
        p.hashBytes,
        p.blob,
      ));
    if (res === undefined) return { length: 0, owners: [], available: false };
    const owners: PeerOwner[] = [];
    for (let i = 1; i + 2 < res.length; i += 3) {
      owners.push({ nodeId: String(res[i]), addr: String(res[i + 1]), length: Number(res[i + 2]) });
    }
    owners.sort((a, b) => b.length - a.length || (a.nodeId < b.nodeId ? -1 : 1));
    return { length: Number(res[0]), owners, available: true };
  }

  /**
   * Renews this node's liveness in every namespace it joined (one pipelined
   * round trip; a PING when it joined none, so a recovery is still seen).
   * A node kept out of the index retries its join instead. Runs on a timer;
   * exposed so tests and shutdown paths can force one.
   */
  async heartbeat(): Promise<void> {
    if (this.#closed) return;
    if (this.#conflict.active) {
      // Kept out: retry the join where refused (accepted once the other's registration expired).
      if (await this.#rejoinPass.probe(this.#conflict.tag!) && this.#conflict.joined()) {
        void this.republish();
      }
      return;
    }
    const inc = this.#incarnation;
    const namespaces = [...this.#joined];
    // Cluster: namespaces called on and not joined are probed too (no recovery while away).
    const away = [...this.#tried].filter((ns) => !this.#joined.has(ns));
    const res = await this.#call("heartbeat", 0, async () => {
      if (namespaces.length + away.length === 0) return [await this.#redis.ping()];
      const who = { node: this.nodeId, inc, addr: this.advertiseAddr, ttlMs: this.#nodeTtlMs };
      return await execBatch(this.#redis, [
        ...heartbeatCommands(who, namespaces), // first: the answers per namespace keep their places
        this.#rejoinPass.refresh(),
        ...away.map(reachCommand),
      ], "heartbeat");
    });
    if (res === undefined || inc !== this.#incarnation) return;
    // Another process holding the id in one namespace weighs more than a lost registration.
    const taken = namespaces.findIndex((_, i) => this.#conflict.isOther(res[i]));
    const lost = taken >= 0 ? taken : namespaces.findIndex((_, i) => res[i] !== 1);
    if (lost >= 0) this.#lost(namespaces[lost], res[lost]);
  }

  /**
   * Voids what an earlier process under this node id joined (once), advertises everything
   * `listSealed()` reports in batches of `republishBatch` per namespace, one call at a time (a
   * re-advertise of a million blocks never floods Redis or the event loop), and voids what this
   * process's older incarnations joined and it holds nothing of now (lib/index/rejoin.ts). Stops
   * at the first failure; the next recovery runs it again. Concurrent requests coalesce.
   */
  republish(): Promise<void> {
    return this.#rejoinPass.run();
  }

  /** Counters for tests and diagnostics. */
  stats(): BlockIndexStats {
    return {
      up: this.#avail.up,
      outages: this.#avail.outages,
      incarnation: this.#incarnation,
      namespaces: this.#joined.size,
      republishedBlocks: this.#republished,
      rejoins: this.#rejoins,
      errors: this.#errors,
      conflictWith: this.#conflict.otherAddr ?? null,
    };
  }

  /**
   * Stops the timers and closes the connection. Entries are left to expire
   * with the node TTL (a clean shutdown could delete them, but a crash cannot,
   * so expiry is the one path that is always exercised).
   */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    clearInterval(this.#heartbeatTimer);
    await this.#rejoinPass.run().catch(() => {}); // the pass under way, if any
    this.#redis.disconnect(false);
  }

  /**
   * One advertise script call; `join`: (re-)register `inc` instead of checking it, after
   * recording the namespace in the node's own key on the same connection (lib/index/rejoin.ts).
   */
  #advertiseCall(ns: string, inc: string, join: boolean, p: ReturnType<typeof packHashes>) {
    const tag = namespaceTag(ns);
    const who = { node: this.nodeId, inc, addr: this.advertiseAddr, ttlMs: this.#nodeTtlMs, join };
    return this.#call("advertise", p.count, async () => {
      const recorded = join ? this.#rejoinPass.record(tag) : undefined;
      const send = () => this.#redis.pfAdvertise(...advertiseArgs(tag, who, p));
      // One Redis runs the record's SADD first (one connection); Cluster keeps the record on
      // another master, so a join waits for it: never entries a later process cannot find.
      if (this.#cluster && recorded) return await this.#joins.join(ns, recorded, send);
      const [, res] = await Promise.all([recorded, send()]);
      return res;
    });
  }

  /** Runs one Redis call under the deadline; undefined when it failed (counted, maybe logged). */
  async #call<T>(op: IndexOp, blocks: number, f: () => Promise<T>): Promise<T | undefined> {
    const t0 = performance.now();
    try {
      const late = () => new Error(`index ${op}: no answer within ${this.#timeoutMs} ms`);
      const v = await withinOrThrow(f(), this.#timeoutMs, late);
      this.#metrics?.call(op, (performance.now() - t0) / 1e3, true, blocks);
      // On Cluster one master may answer while another does not: only a heartbeat, which
      // reaches every master the node uses, proves a recovery.
      if (!this.#cluster || op === "heartbeat") this.#avail.succeeded();
      return v;
    } catch (e) {
      this.#metrics?.call(op, (performance.now() - t0) / 1e3, false, blocks);
      this.#failed(op, e as Error);
      return undefined;
    }
  }

  #failed(op: IndexOp, e: Error): void {
    if (this.#closed) return;
    this.#errors++;
    this.#avail.failed(op, e);
  }

  /** Redis answered after failing (or for the first time): re-join and re-advertise. */
  #recovered(): void {
    // Kept out of the index: the join the heartbeat retries does it once accepted.
    if (this.#closed || this.#conflict.active) return;
    // Withdrawals sent during the outage were lost; a new incarnation voids every old entry.
    this.#rejoin();
    void this.republish();
  }

  /**
   * Redis no longer has this node's registration in `ns`: re-join and
   * re-advertise all. `answer` is the script's: the address of another live
   * process registered under this node id (a string), or 0 (lost, expired).
   */
  #lost(ns: string, answer: unknown): void {
    if (this.#conflict.isOther(answer)) return this.#exclude(namespaceTag(ns), answer); // kept out
    if (typeof answer === "string") {
      // At this node's own address a join cannot tell it from a restart of this node: the
      // two take the registration from each other (node ids must be unique among live nodes).
      this.#log.error("another live process uses this node id in the block index", {
        namespace: ns,
        node: this.nodeId,
        advertise_addr: this.advertiseAddr,
        other_addr: answer,
        fix: "give every node its own --node-id",
      });
    } else {
      this.#log.info("this node's index registration was lost; re-advertising what it holds", {
        namespace: ns,
        node: this.nodeId,
      });
    }
    this.#rejoin();
    void this.republish();
  }

  /** `other`'s process holds this node id in `tag`'s registry: a new incarnation, if news. */
  #exclude(tag: string, other: string): void {
    // What the old incarnation registered is no longer renewed: it expires unheard.
    if (!this.#closed && this.#conflict.refused(tag, other)) this.#rejoin();
  }

  #rejoin(): void {
    this.#incarnation = this.#newIncarnation();
    this.#rejoinPass.stale(this.#joined);
    this.#joined.clear();
    this.#rejoins++;
    this.#metrics?.rejoined();
  }

  #newIncarnation(): string {
    return Buffer.from(this.#random(INCARNATION_BYTES)).toString("hex");
  }
}

function positive(what: string, n: number): number {
  if (!Number.isSafeInteger(n) || n < 1) {
    throw new IndexInputError(`${what} must be an integer ≥ 1`, { got: String(n) });
  }
  return n;
}
