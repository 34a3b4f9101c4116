/**
 * Re-join: what a node does once it has drawn a new incarnation (at its first connect, after an
 * outage, after Redis lost its registration; lib/index/block_index.ts draws it). Lookups read only
 * the incarnation a namespace's registry names, so registering the new one in a namespace voids
 * every older entry of the node there at once. A pass, one at a time:
 *
 * 1. Once per process: void what an earlier process under this node id left (a restart after a
 *    crash). Every join advertise first adds the namespace's tag to the node's record
 *    `pf:{@<node>}:namespaces` (lib/index/keys.ts), whose TTL the heartbeat keeps above the
 *    node's registrations; the pass reads it and registers the new incarnation with an empty set
 *    in each namespace this process has not joined itself, then drops those tags from it.
 * 2. Re-advertise what the node holds (`listSealed`), in batches, each checked against `isHeld`
 *    when sent: a block evicted while earlier batches were on the wire had its withdraw sent.
 * 3. Void the namespaces this process joined under an older incarnation and holds nothing of
 *    now (withdrawals lost in an outage would be served until the old registration's deadline).
 *
 * A void registration is not heartbeated: it expires with its empty set. The pass stops at the
 * first failure or when the incarnation changes; the next recovery runs it again.
 *
 * A join (a void included) is refused while another live process, at another advertise address,
 * holds the node id in that namespace (a copied `--node-id`): that process keeps the id, and
 * this node is kept out of the index ({@link NodeIdConflict}) until its registration expires.
 *
 * @module
 */

import { Buffer } from "node:buffer";
import type { SealedBlock } from "./block_index.ts";
import type { IndexRedis } from "./connection.ts";
import { type BatchCommand, execBatch } from "./batch.ts";
import { namespaceTag, nodeNamespacesKey, tagNodesKey } from "./keys.ts";
import type { IndexMetrics, IndexOp } from "./metrics.ts";
import type { Logger } from "../log.ts";
import { ADVERTISE_LUA, advertiseArgs } from "./scripts.ts";

/**
 * The node's record lives this many node TTLs past its last refresh (a join or a heartbeat):
 * every registration it lists lives at most one TTL past the heartbeat that refreshed both.
 */
const RECORD_TTLS = 2;
const NO_HASHES = { hashBytes: 1, blob: Buffer.alloc(0) };

/** What a re-join needs from the index (lib/index/block_index.ts). */
export interface RejoinHost {
  redis: IndexRedis;
  nodeId: string;
  advertiseAddr: string;
  nodeTtlMs: number;
  /** Blocks per re-advertise call. */
  batch: number;
  listSealed: () => Iterable<SealedBlock>;
  isHeld: (namespace: string, hash: Uint8Array) => boolean;
  /** The incarnation now; a pass stops once it changes (the newer re-join runs its own). */
  incarnation: () => string;
  /** Closed, or kept out of the index by a node id conflict: no pass runs. */
  stopped: () => boolean;
  /** Namespaces joined under the current incarnation. */
  joined: ReadonlySet<string>;
  advertise: (namespace: string, hashes: readonly Uint8Array[]) => Promise<boolean>;
  /** Runs one Redis call under the index's deadline; undefined when it failed (counted). */
  call: <T>(op: IndexOp, blocks: number, f: () => Promise<T>) => Promise<T | undefined>;
  republished: (blocks: number) => void;
  /** A join under `inc` in `tag`'s namespace was refused: `otherAddr`'s process holds the id. */
  refused: (tag: string, otherAddr: string, inc: string) => void;
}

/**
 * The re-join passes of one index.
 *
 * @example
 * ```ts
 * const rejoin = new Rejoin(host);
 * await Promise.all([rejoin.record(namespaceTag(ns)), joinAdvertise]); // each join advertise
 * rejoin.stale(joinedBefore); // a new incarnation was drawn
 * await rejoin.run();
 * ```
 */
export class Rejoin {
  readonly #host: RejoinHost;
  /** Namespaces joined under an older incarnation and not since: their old entries still count. */
  readonly #stale = new Set<string>();
  /** Tags this process sent a join to: that join voided earlier processes' entries there. */
  readonly #recorded = new Set<string>();
  #pastVoided = false;
  #running: Promise<void> | undefined;
  #again = false;

  constructor(host: RejoinHost) {
    this.#host = host;
  }

  /** A new incarnation was drawn: what the old one joined counts until joined again or voided. */
  stale(namespaces: Iterable<string>): void {
    for (const ns of namespaces) this.#stale.add(ns);
  }

  /**
   * Adds a namespace's tag to the node's record; send it before the join advertise on the same
   * connection (on Cluster, await it first: another master), so that Redis never holds entries a
   * later process cannot find.
   */
  record(tag: string): Promise<unknown> {
    const { redis, nodeId, nodeTtlMs } = this.#host;
    this.#recorded.add(tag);
    const key = nodeNamespacesKey(nodeId);
    return Promise.all([redis.sadd(key, tag), redis.pexpire(key, nodeTtlMs * RECORD_TTLS)]);
  }

  /** The refresh of the node's record, for a heartbeat's batch. */
  refresh(): BatchCommand {
    const key = nodeNamespacesKey(this.#host.nodeId);
    return { key, send: (p) => p.pexpire(key, this.#host.nodeTtlMs * RECORD_TTLS) };
  }

  /** Runs a pass; a request while one runs coalesces into one more pass after it (none once stopped). */
  run(): Promise<void> {
    if (this.#running) {
      this.#again = true;
      return this.#running;
    }
    if (this.#host.stopped()) return Promise.resolve();
    this.#running = (async () => {
      do {
        this.#again = false;
        await this.#once();
      } while (this.#again && !this.#host.stopped());
    })().finally(() => this.#running = undefined);
    return this.#running;
  }

  async #once(): Promise<void> {
    const h = this.#host;
    const inc = h.incarnation();
    const current = () => inc === h.incarnation() && !h.stopped();
    if (!this.#pastVoided) {
      if (!await this.#voidPast(inc) || !current()) return;
      this.#pastVoided = true;
    }
    const pending = new Map<string, Uint8Array[]>();
    const flush = async (ns: string, collected: Uint8Array[]): Promise<boolean> => {
      pending.delete(ns);
      // Collected across earlier batches' awaits: drop what was evicted since (its withdraw
      // went out already; an advertise after it would list the block here for good). What is
      // sent now goes before any later withdraw, on the same connection.
      const list = collected.filter((hash) => h.isHeld(ns, hash));
      if (list.length === 0) return current();
      const ok = await h.advertise(ns, list);
      if (ok) h.republished(list.length);
      return ok && current();
    };
    for (const b of h.listSealed()) {
      let list = pending.get(b.namespace);
      if (!list) pending.set(b.namespace, list = []);
      list.push(b.hash);
      if (list.length >= h.batch && !await flush(b.namespace, list)) return;
    }
    for (const [ns, list] of pending) if (!await flush(ns, list)) return;
    for (const ns of this.#stale) if (h.joined.has(ns)) this.#stale.delete(ns);
    const stale = [...this.#stale];
    if (stale.length === 0 || !current()) return;
    const voided = await h.call("advertise", 0, () => this.#void(stale.map(namespaceTag), inc));
    stale.forEach((ns, i) => voided?.[i] === 1 && this.#stale.delete(ns));
  }

  /**
   * The join a node kept out of the index retries (at each heartbeat): the current incarnation
   * registered with an empty set in one namespace (by tag), one call counted as an advertise.
   * True once the other process's registration there has expired; while it lives, nothing is
   * written (and its address is reported again).
   */
  async probe(tag: string): Promise<boolean> {
    const h = this.#host;
    const inc = h.incarnation();
    const res = await h.call("advertise", 0, () => this.#void([tag], inc));
    return res?.[0] === 1 && inc === h.incarnation();
  }

  /**
   * Step 1: voids the namespaces in the node's record that this process has not joined. Three
   * round trips, once per process: the record sits in its own slot on Cluster, and a script may
   * touch one slot only, so its tags come to the client before the voids go out (pipelined).
   */
  #voidPast(inc: string): Promise<boolean> {
    const { redis, nodeId } = this.#host;
    const key = nodeNamespacesKey(nodeId);
    return this.#host.call("advertise", 0, async () => {
      const past = (await redis.smembers(key)).filter((t) => !this.#recorded.has(t));
      if (past.length === 0) return true;
      const voided = await this.#void(past, inc);
      // A tag joined meanwhile stays: the join's record went out before this SREM.
      const drop = past.filter((t, i) => voided[i] === 1 && !this.#recorded.has(t));
      if (drop.length > 0) await redis.srem(key, ...drop);
      return voided.every((v) => v === 1);
    }).then((ok) => ok === true);
  }

  /**
   * Registers `inc` with an empty set in each namespace (by tag), pipelined (per slot on
   * Cluster, sent together): one round trip.
   * Each answer is 1, or the address of another live process that keeps the node id there
   * (reported to the host; nothing was written in that namespace).
   */
  async #void(tags: string[], inc: string): Promise<unknown[]> {
    const { redis, nodeId: node, advertiseAddr: addr, nodeTtlMs: ttlMs } = this.#host;
    const who = { node, inc, addr, ttlMs, join: true };
    const answers = await execBatch(
      redis,
      tags.map((tag) => ({
        key: tagNodesKey(tag),
        // EVAL, not EVALSHA: lib/index/connection.ts (evalAlways) says why
        send: (p) => p.eval(ADVERTISE_LUA, ...advertiseArgs(tag, who, NO_HASHES)),
      })),
      "void",
    );
    const other = answers.findIndex((v) => typeof v === "string");
    if (other >= 0) this.#host.refused(tags[other], answers[other] as string, inc);
    return answers;
  }
}

/**
 * Another live process holds this node id at another advertise address (a copied `--node-id`):
 * it keeps the id, and this node stays out of the index — it advertises nothing and retries the
 * join at each heartbeat ({@link Rejoin.probe}) — until that process's registration expires.
 * One error per episode; the `pegaflow_index_node_id_conflict` gauge is 1 meanwhile.
 *
 * @example
 * ```ts
 * const conflict = new NodeIdConflict(log, metrics, "node-a:50055", "10.0.0.1:50055");
 * if (conflict.isOther(answer) && conflict.refused(tag, answer)) drawNewIncarnation();
 * if (conflict.active && await rejoin.probe(conflict.tag!) && conflict.joined()) republish();
 * ```
 */
export class NodeIdConflict {
  #other: { tag: string; addr: string } | undefined;

  constructor(
    private readonly log: Logger,
    private readonly metrics: IndexMetrics | undefined,
    private readonly nodeId: string,
    private readonly advertiseAddr: string,
  ) {}

  /** True while this node is kept out of the index. */
  get active(): boolean {
    return this.#other !== undefined;
  }

  /** The address of the process that holds this node id while this node is kept out. */
  get otherAddr(): string | undefined {
    return this.#other?.addr;
  }

  /** Whether a script's answer names another live process, at another address, under this id. */
  isOther(answer: unknown): answer is string {
    return typeof answer === "string" && answer !== this.advertiseAddr;
  }

  /** The namespace (tag) whose registry last refused this node: where the retry joins. */
  get tag(): string | undefined {
    return this.#other?.tag;
  }

  /** `otherAddr`'s process holds the id in `tag`'s registry. True when an episode starts. */
  refused(tag: string, otherAddr: string): boolean {
    const starts = this.#other === undefined;
    this.#other = { tag, addr: otherAddr };
    if (!starts) return false;
    this.metrics?.conflict(true);
    this.log.error(
      "another live process holds this node id in the block index: this node advertises nothing until it is gone",
      {
        node: this.nodeId,
        advertise_addr: this.advertiseAddr,
        other_addr: otherAddr,
        registry: tagNodesKey(tag),
        fix: "give every node its own --node-id",
      },
    );
    return true;
  }

  /** The retried join was accepted: the other process's registration expired. True if kept out. */
  joined(): boolean {
    const other = this.#other;
    if (!other) return false;
    this.#other = undefined;
    this.metrics?.conflict(false);
    this.log.info(
      "joined the block index: the other process under this node id is gone; re-advertising what this node holds",
      {
        node: this.nodeId,
        advertise_addr: this.advertiseAddr,
        other_addr: other.addr,
        registry: tagNodesKey(other.tag),
      },
    );
    return true;
  }
}
