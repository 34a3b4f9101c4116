/**
 * The KV engine: registration, Save, QueryPrefetch, Load, Release and
 * cleanup, on top of the block store (lib/storage), the transfer plan
 * (lib/transfer) and the native copy layer (ports.ts). Transport-free: the
 * gRPC service decodes requests into these calls and maps errors to
 * statuses through errors.ts.
 *
 * `KvEngine` is a facade over modules named for their jobs:
 *   register.ts  RegisterContext: checks, region mapping, topology seal
 *   save.ts      Save: validate, plan, ONE gather batch, seal
 *   load.ts      Load: load state, lease consume, ONE scatter batch
 *   query_load.ts QueryPrefetch with load_into: the hit's loads start before the answer
 *   namespaces.ts the namespace layout (the one owner) and the store layout it implies
 *
 * Save and Load run as credit-bounded pipeline stages (lib/pipeline):
 *   save: request → [save.gather: validate, dedup, allocate, ONE gather batch
 *         for all layers, await] → seal/admit (store.completeSave)
 *   load: request → [load.submit: consume lease, ONE scatter batch for all
 *         layers with progress words in the engine's load state] → completion
 *         releases the pins and closes the shm
 * Overflow policy of both queues: refuse with RESOURCE_EXHAUSTED (the engine
 * recomputes or retries; parking an RPC would only hide the overload).
 *
 * Cleanup order (lesson 2 of the original system): fence new work → drain the
 * instance's in-flight copies → close its IPC mappings → release its leases.
 *
 * @module
 */
import { Stage } from "../pipeline/stage.ts";
import { MAX_HASH_BYTES, MAX_PREFETCH_WAIT_MS } from "../limits.ts";
import type { Logger } from "../log.ts";
import type { KvStore } from "../storage/store.ts";
import { MAX_HASHES_PER_REQUEST } from "../storage/state.ts";
import { TransferPlanner } from "../transfer/plan.ts";
import { closeRegions, type EngineContext, type EngineMetrics, type TiersPort } from "./context.ts";
import { Code, EngineError, invalid, precondition } from "./errors.ts";
import { type Instance, requestWho } from "./instances.ts";
import { type LoadArgs, type LoadJob, type LoadResult, LoadRunner } from "./load.ts";
import type { NativePort } from "./ports.ts";
import { PrefetchWaits } from "./prefetch_waits.ts";
import {
  type LoadInto,
  queryAndLoad,
  type QueryAnswer,
  type QueryLoadPorts,
  type RankLoadOutcome,
} from "./query_load.ts";
import { registerRank, type RegisterResult } from "./register.ts";
import type { RegisterArgs } from "./registration.ts";
import {
  checkRequestId,
  NOTHING_SAVED,
  type SaveArgs,
  type SaveJob,
  type SaveResult,
  SaveRunner,
} from "./save.ts";
import { applyDiscards, discardOnly } from "./save_discard.ts";

export type { EngineMetrics, TiersPort } from "./context.ts";
export type { LoadArgs, LoadResult } from "./load.ts";
export type { LoadInto, QueryAnswer, RankLoadOutcome, RankLoadTarget } from "./query_load.ts";
export type { RegisterResult } from "./register.ts";
export type { SaveArgs, SaveResult } from "./save.ts";
export { PROTOCOL_VERSION, type RegisterArgs } from "./registration.ts";

export interface EngineOptions {
  native: NativePort;
  /** Optional tiers below RAM (SSD, peer). */
  tiers?: TiersPort;
  store: KvStore;
  log: Logger;
  metrics?: EngineMetrics;
  leaseTtlMs: number;
  /** Save requests copying at once / queued beyond that. */
  saveConcurrency?: number;
  saveQueueDepth?: number;
  loadConcurrency?: number;
  loadQueueDepth?: number;
  /** NUMA: the pool part a device's saves allocate in (lib/numa.ts); absent = any. */
  poolPartOf?: (device: number) => number | undefined;
}

/** Summary of an instance for /instances. */
export interface InstanceInfo {
  instanceId: string;
  namespace: string;
  tpSize: number;
  ppSize: number;
  worldSize: number;
  ranksRegistered: number;
  sealed: boolean;
  numLayers: number;
  /** Layer names by layer id: the namespace's order (stages by pp_rank, registration order within). */
  layers: string[];
  /** MLA: the namespace stores each block once for all TP ranks. */
  kvSharedAcrossTp: boolean;
  /** The engine_id its ranks registered with ("" from a client that sends none). */
  engineId: string;
  /** Each registered rank and the device its regions (and copies) are on, by rank index. */
  ranks: { tpRank: number; ppRank: number; device: number }[];
  inflightCopies: number;
  ageSeconds: number;
}

const DEFAULT_SAVE_CONCURRENCY = 4;
const DEFAULT_SAVE_QUEUE = 64;
const DEFAULT_LOAD_CONCURRENCY = 8;
const DEFAULT_LOAD_QUEUE = 128;

/**
 * The orchestration core of the KV server.
 *
 * @example
 * ```ts
 * const engine = new KvEngine({ native, store, log, leaseTtlMs: 600_000 });
 * engine.register(args);                 // per rank
 * await engine.save(saveArgs);           // returns after the gather landed
 * const q = engine.query("inst", hashes, "req-1");
 * const l = await engine.load({ ...loadArgs, leaseId: q.leaseId! });
 * await l.done;
 * ```
 */
export class KvEngine {
  readonly #ctx: EngineContext;
  readonly #leaseTtlMs: number;
  readonly #saver: SaveRunner;
  readonly #loader: LoadRunner;
  readonly #saveStage: Stage<SaveJob, SaveResult>;
  readonly #loadStage: Stage<LoadJob, LoadResult>;
  /** What a query-and-load composes (query_load.ts): made once, not per query. */
  readonly #queryLoadPorts: QueryLoadPorts;
  readonly #goneListeners: ((instanceId: string, reason: string) => void)[] = [];
  readonly #sealedListeners: ((namespace: string, keys: readonly string[]) => void)[] = [];
  readonly #prefetchWaits = new PrefetchWaits();
  #closed = false;

  constructor(opts: EngineOptions) {
    this.#ctx = {
      native: opts.native,
      store: opts.store,
      log: opts.log,
      metrics: opts.metrics,
      tiers: opts.tiers,
      instances: new Map(),
      layouts: new Map(),
      poolPartOf: opts.poolPartOf,
    };
    this.#leaseTtlMs = opts.leaseTtlMs;
    // One planner per batch writer: each keeps its writer's scratch.
    this.#saver = new SaveRunner(
      this.#ctx,
      opts.native.batch(),
      new TransferPlanner(),
      (ns, keys) => {
        for (const f of this.#sealedListeners) f(ns, keys);
      },
    );
    this.#loader = new LoadRunner(this.#ctx, opts.native.batch(), new TransferPlanner());
    this.#saveStage = new Stage<SaveJob, SaveResult>(
      "save.gather",
      {
        concurrency: opts.saveConcurrency ?? DEFAULT_SAVE_CONCURRENCY,
        queue: { depth: opts.saveQueueDepth ?? DEFAULT_SAVE_QUEUE, policy: "refuse" },
        metrics: opts.metrics?.stage("save.gather"),
      },
      (job) => this.#saver.run(job),
    );
    this.#loadStage = new Stage<LoadJob, LoadResult>(
      "load.submit",
      {
        concurrency: opts.loadConcurrency ?? DEFAULT_LOAD_CONCURRENCY,
        queue: { depth: opts.loadQueueDepth ?? DEFAULT_LOAD_QUEUE, policy: "refuse" },
        metrics: opts.metrics?.stage("load.submit"),
      },
      (job) => this.#loader.run(job),
    );
    this.#queryLoadPorts = {
      instance: (id, what) => this.#instance(id, what),
      query: (id, h, r, e) => this.query(id, h, r, e),
      accept: (a) => this.#loader.accept(a, (id) => this.#instance(id, "Load")),
      queue: (a) => this.#loader.queue(a, (job) => this.#loadStage.submit(job)),
      abandon: (a, why) => this.#loader.abandon(a, why),
      release: (l) => this.release(l),
    };
  }

  /**
   * Called with the keys of blocks a save just sealed (servable from now on):
   * the hook for metrics and cross-node advertising. (Tiers below RAM are
   * handed sealed blocks through {@link EngineOptions.tiers}, not here.)
   */
  onSealed(fn: (namespace: string, keys: readonly string[]) => void): void {
    this.#sealedListeners.push(fn);
  }

  /** Called with (instanceId, reason) after an instance has been cleaned up. */
  onInstanceGone(fn: (instanceId: string, reason: string) => void): void {
    this.#goneListeners.push(fn);
  }

  get backend(): "cuda" | "host" {
    return this.#ctx.native.backend;
  }

  /**
   * Registers all layers of one rank (register.ts); every check (namespace
   * layout and layer order included) runs before anything is mapped or
   * recorded, and a failure at seal rolls the rank back whole.
   */
  register(a: RegisterArgs): RegisterResult {
    if (this.#closed) throw new EngineError(Code.UNAVAILABLE, "server is shutting down");
    return registerRank(this.#ctx, a);
  }

  /** Copies the listed blocks into the pool (save.ts); resolves after the gather landed and the slots joined their blocks. */
  async save(args: SaveArgs): Promise<SaveResult> {
    const inst = this.#instance(args.instanceId, "Save");
    // Another engine's Save under this instance id would gather from this engine's memory.
    inst.checkEngine(args.engineId, requestWho("Save", args), "request", {
      tpRank: args.tpRank,
      ppRank: args.ppRank,
      requestId: args.requestId || undefined,
    });
    const rank = inst.rankCtx(args.tpRank, args.ppRank, "Save");
    const fields = { instance: inst.id, tpRank: rank.tpRank, ppRank: rank.ppRank };
    // Before the fence and the queue: a discard copies nothing, and must not be lost to either.
    const blocksDiscarded = applyDiscards(this.#ctx, inst, rank, args);
    if (discardOnly(args)) return { ...NOTHING_SAVED, blocksDiscarded };
    if (inst.fenced) {
      throw new EngineError(Code.UNAVAILABLE, `instance "${inst.id}" is being cleaned up`, fields);
    }
    const sub = this.#saveStage.submit({ args, inst, rank });
    if (sub.status === "refused") {
      this.#ctx.metrics?.saveFailed("queue_full", rank.deviceId);
      throw new EngineError(
        Code.RESOURCE_EXHAUSTED,
        `instance "${inst.id}" rank ${rank.rank}: save queue full; the save is dropped`,
        fields,
      );
    }
    const out = await sub.done();
    if (out.status === "done") return { ...out.value, blocksDiscarded };
    if (out.status === "failed") throw out.error;
    throw new EngineError(Code.RESOURCE_EXHAUSTED, `save ${out.status} by the save queue`, fields);
  }

  /**
   * Longest cached prefix; a hit pins it under a lease consumable once per rank. `engineId`:
   * the sender's ("" = not checked); another engine's is refused before anything is looked up.
   */
  query(
    instanceId: string,
    hashes: Uint8Array[],
    requestId: string,
    engineId = "",
  ): QueryAnswer {
    // Before the store and the tiers see it: another engine's query must not pin this one's blocks.
    const { inst, fields } = this.#requestOf("QueryPrefetch", instanceId, requestId, engineId);
    if (!inst.sealed) {
      throw precondition(
        `instance "${inst.id}": QueryPrefetch before the topology is sealed (${inst.ranks.size}/${inst.worldSize} ranks)`,
        fields,
      );
    }
    if (inst.fenced) {
      throw new EngineError(Code.UNAVAILABLE, `instance "${inst.id}" is being cleaned up`, fields);
    }
    // Checked before the tiers see the query: refused, it must not count or start a read.
    if (hashes.length > MAX_HASHES_PER_REQUEST) {
      throw invalid(
        `request "${requestId}": ${hashes.length} block hashes; at most ${MAX_HASHES_PER_REQUEST} are accepted`,
        { ...fields, expected: MAX_HASHES_PER_REQUEST, got: hashes.length },
      );
    }
    for (let i = 0; i < hashes.length; i++) {
      if (hashes[i].length < 1 || hashes[i].length > MAX_HASH_BYTES) {
        throw invalid(
          `request "${requestId}": block hash ${i} is ${
            hashes[i].length
          } bytes (1..${MAX_HASH_BYTES})`,
          { ...fields, expected: `1..${MAX_HASH_BYTES}`, got: hashes[i].length },
        );
      }
    }
    const { store, tiers, log, metrics } = this.#ctx;
    if (tiers?.beforeQuery(inst.namespace, inst.id, hashes, requestId)) {
      log.debug("query loading from a lower tier", { instance: inst.id, request: requestId });
      return { hits: 0, leaseId: null, ttlMs: this.#leaseTtlMs, loading: true };
    }
    const r = store.query(inst.namespace, hashes, inst.id, inst.worldSize);
    metrics?.queryDone(hashes.length, r.hits);
    // After the handler's synchronous part: a query-and-load's copy is submitted first
    // (a debug line is ~0.05 ms of formatting and a write on a warm request's critical path).
    if (log.enabled("debug")) {
      const hits = r.hits;
      queueMicrotask(() =>
        log.debug("query", {
          instance: inst.id,
          request: requestId,
          requested: hashes.length,
          hits,
        })
      );
    }
    return { hits: r.hits, leaseId: r.lease?.idBytes ?? null, ttlMs: this.#leaseTtlMs };
  }

  /**
   * WaitPrefetch: after a "loading" answer, resolves true once the lower
   * tier's fetch of `requestId` ended (the next query answers from RAM) or
   * when none runs, false after `waitMs` while it still runs or at shutdown.
   * Takes no lease and starts nothing; checked like a query (instance,
   * engine id, request id) and `waitMs` in 1..MAX_PREFETCH_WAIT_MS.
   */
  waitPrefetch(
    instanceId: string,
    requestId: string,
    waitMs: number,
    engineId = "",
  ): Promise<boolean> {
    try {
      const { inst, fields, what } = this.#requestOf(
        "WaitPrefetch",
        instanceId,
        requestId,
        engineId,
      );
      if (!Number.isInteger(waitMs) || waitMs < 1 || waitMs > MAX_PREFETCH_WAIT_MS) {
        throw invalid(
          `${what}: wait_ms is ${waitMs}; 1..${MAX_PREFETCH_WAIT_MS} is accepted`,
          { ...fields, expected: `1..${MAX_PREFETCH_WAIT_MS}`, got: waitMs },
        );
      }
      if (this.#closed) return Promise.resolve(false);
      return this.#prefetchWaits.hold(this.#ctx.tiers?.settled(inst.id, requestId), waitMs);
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /** WaitPrefetch calls held now (`pegaflow_prefetch_waits`). */
  get prefetchWaits(): number {
    return this.#prefetchWaits.size;
  }

  /** QueryPrefetch with `load_into`: on a hit, every rank's load is queued before the answer (query_load.ts). */
  queryLoad(
    instanceId: string,
    hashes: Uint8Array[],
    requestId: string,
    into: LoadInto,
    engineId = "",
  ): QueryAnswer & { loads: RankLoadOutcome[] } {
    return queryAndLoad(this.#queryLoadPorts, { instanceId, hashes, requestId, into, engineId });
  }

  /** Consumes the lease for this rank and submits ONE scatter batch (load.ts); resolves at submit. */
  load(args: LoadArgs): Promise<LoadResult> {
    try {
      checkRequestId("Load", args.instanceId, args.requestId);
    } catch (e) {
      return Promise.reject(e);
    }
    return this.#loader.load(
      args,
      (id) => this.#instance(id, "Load"),
      (job) => this.#loadStage.submit(job),
    );
  }

  release(leaseId: Uint8Array): void {
    this.#ctx.store.releaseLease(leaseId);
  }

  /**
   * Cleans an instance up: fence → drain → close mappings → release leases.
   * Returns the number of leases released.
   */
  async unregister(instanceId: string, reason: string): Promise<number> {
    const inst = this.#instance(instanceId, "UnregisterContext");
    if (inst.fenced) {
      await inst.drain();
      return 0;
    }
    inst.fence();
    const t0 = performance.now();
    await inst.drain();
    // Drained: every copy's completion record has arrived, and the native layer
    // drops a batch's region references before posting it, so closing cannot race a copy.
    for (const r of inst.ranks.values()) {
      closeRegions(this.#ctx, r.regions, `instance "${inst.id}" rank ${r.rank}`);
    }
    const { store, layouts, log } = this.#ctx;
    const { leases, inflightFreed } = store.dropInstance(inst.id);
    this.#ctx.instances.delete(inst.id);
    this.#loader.states.forget(inst.id);
    const lay = layouts.get(inst.namespace);
    if (lay) {
      lay.users.delete(inst.id);
      // The layout stays bound while blocks of the namespace may be cached; an empty
      // namespace with no user may be re-bound by the next instance.
      if (lay.users.size === 0 && store.stats().sealedBlocks === 0) {
        layouts.delete(inst.namespace);
      }
    }
    log.info("instance cleaned up", {
      instance: inst.id,
      reason,
      leases_released: leases,
      inflight_blocks_freed: inflightFreed,
      ms: Math.round(performance.now() - t0),
    });
    for (const f of this.#goneListeners) f(inst.id, reason);
    return leases;
  }

  /** Instances for /instances. */
  instances(): InstanceInfo[] {
    const now = Date.now();
    return [...this.#ctx.instances.values()].map((i) => ({
      instanceId: i.id,
      namespace: i.namespace,
      tpSize: i.tpSize,
      ppSize: i.ppSize,
      worldSize: i.worldSize,
      ranksRegistered: i.ranks.size,
      sealed: i.sealed,
      numLayers: i.layerNames.length,
      layers: [...i.layerNames],
      kvSharedAcrossTp: this.#ctx.layouts.get(i.namespace)?.kvSharedAcrossTp ?? false,
      engineId: i.engineId,
      ranks: [...i.ranks.values()].sort((a, b) => a.rank - b.rank).map((r) => ({
        tpRank: r.tpRank,
        ppRank: r.ppRank,
        device: r.deviceId,
      })),
      inflightCopies: i.inflight,
      ageSeconds: Math.round((now - i.createdAt) / 1000),
    }));
  }

  has(instanceId: string): boolean {
    return this.#ctx.instances.has(instanceId);
  }

  /** A registered instance's TP and PP sizes; undefined when it is not registered. */
  topologyOf(instanceId: string): { tpSize: number; ppSize: number } | undefined {
    const i = this.#ctx.instances.get(instanceId);
    return i && { tpSize: i.tpSize, ppSize: i.ppSize };
  }

  stageStats() {
    return [this.#saveStage.stats(), this.#loadStage.stats()];
  }

  /** Cleans every instance up and stops accepting work. */
  async close(): Promise<void> {
    this.#closed = true;
    this.#prefetchWaits.close();
    for (const id of [...this.#ctx.instances.keys()]) {
      // One cleaned up meanwhile (its session dropped while another drained) is gone already.
      if (this.#ctx.instances.has(id)) await this.unregister(id, "shutdown");
    }
  }

  /**
   * The checks QueryPrefetch and WaitPrefetch share, in this order: the instance is registered,
   * the sender is its engine (`engineId` "" is not checked), and the request id is there and not
   * too long. Returns the instance and the ids errors and logs carry.
   */
  #requestOf(method: string, instanceId: string, requestId: string, engineId: string) {
    const what = `${method} (request "${requestId}")`;
    const inst = this.#instance(instanceId, what);
    const fields = { instance: instanceId, requestId: requestId || undefined };
    inst.checkEngine(engineId, what, "request", fields);
    checkRequestId(method, instanceId, requestId);
    if (!requestId) throw invalid(`instance "${instanceId}": ${method} needs a request_id`, fields);
    return { inst, fields, what };
  }

  /** A registered instance (FAILED_PRECONDITION naming `what` otherwise). */
  #instance(id: string, what: string): Instance {
    const inst = this.#ctx.instances.get(id);
    if (!inst) throw precondition(`${what}: instance "${id}" is not registered`, { instance: id });
    return inst;
  }
}
