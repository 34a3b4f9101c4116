/**
 * The KV engine: registration, Save, QueryPrefetch, Load, Release and
 * cleanup, on top of the native copy layer and the block store (see
 * ports.ts). Transport-free: the gRPC service decodes requests into these
 * calls and maps {@link EngineError} codes to statuses.
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
import { Stage, type StageMetrics } from "../pipeline/stage.ts";
import type { Logger } from "../log.ts";
import { Code, codeOf, EngineError, invalid, precondition } from "./errors.ts";
import { StorageError } from "../storage/errors.ts";
import { LEASE_ID_BYTES } from "../storage/lease.ts";
import { keyHex, MAX_HASH_BYTES, type RegisterArgs, validateRegistration } from "./registration.ts";
import { Instance, type LayerCtx, layerCtx, type RankCtx } from "./instances.ts";
import {
  checkStageClaim,
  claimStage,
  globalOrder,
  type NamespaceLayout,
  newLayout,
  type StageClaim,
} from "./namespaces.ts";
import {
  armLoadState,
  checkLoadState,
  completeLoadState,
  failLoadState,
  LOAD_STATE_BYTES,
  OFF_PROGRESS,
  STATE_REJECTED,
} from "./load_state.ts";
import {
  type BatchWriter,
  ClientMemoryFault,
  type NativePort,
  type RegionPort,
  type ShmPort,
} from "./ports.ts";
import type { KvStore, SavePlan } from "../storage/store.ts";
import { sealedHashBytes } from "../storage/tier.ts";
import { type LayoutIdentity, layoutIdentity } from "../storage/layout.ts";

export {
  MAX_HASH_BYTES,
  MAX_LAYERS,
  MAX_PARALLEL,
  PROTOCOL_VERSION,
  REGION_HANDLE_BYTES,
  type RegisterArgs,
} from "./registration.ts";

export interface SaveArgs {
  instanceId: string;
  tpRank: number;
  ppRank: number;
  requestId?: string;
  /** Per-layer lists; empty means "every layer of the rank saves blockIds/blockHashes". */
  layers: { layerName: string; blockIds: number[]; blockHashes: Uint8Array[] }[];
  blockIds?: number[];
  blockHashes?: Uint8Array[];
}

export interface SaveResult {
  blocksSaved: number;
  blocksSkipped: number;
  bytesCopied: number;
  blocksRefused: number;
  /** New blocks TinyLFU admission turned away (not saved). */
  blocksNotAdmitted: number;
}

export interface LoadArgs {
  instanceId: string;
  requestId?: string;
  tpRank: number;
  ppRank: number;
  leaseId: Uint8Array;
  blockIds: number[];
  loadStateShm: string;
}

export interface LoadResult {
  numBlocks: number;
  numLayers: number;
  bytes: number;
  /** Resolves when the scatter finished (ok or not); the RPC does not wait for it. */
  done: Promise<void>;
}

/** Hooks the engine reports through (prom-client implements them in lib/server/metrics.ts). */
export interface EngineMetrics {
  saveDone(bytes: number, seconds: number, blocks: number): void;
  saveFailed(reason: string): void;
  loadDone(bytes: number, seconds: number, ok: boolean): void;
  queryDone(requested: number, hits: number): void;
  stage(name: string): StageMetrics;
}

/**
 * The tiers below RAM (implemented by lib/storage/lower_tiers.ts over the
 * `Tier` port): sealed blocks are handed over for write-behind; a query whose
 * prefix continues in a tier starts (or polls) a fetch and is answered
 * "loading"; a registration is checked against the layouts the tiers hold
 * for its namespace (they outlive a restart, RAM does not).
 */
export interface TiersPort {
  /** Blocks a save just sealed (the engine's hash bytes). Never waits. */
  sealed(namespace: string, hashes: readonly Uint8Array[]): unknown;
  /** Layouts the tiers hold blocks of under `namespace`, with block counts and where. */
  storedLayouts(namespace: string): readonly (LayoutIdentity & { blocks: number; where: string })[];
  /** True: answer "loading" (a fetch for this request id is running). */
  beforeQuery(
    namespace: string,
    instance: string,
    hashes: Uint8Array[],
    requestId: string,
  ): boolean;
}

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
  inflightCopies: number;
  ageSeconds: number;
}

const DEFAULT_SAVE_CONCURRENCY = 4;
const DEFAULT_SAVE_QUEUE = 64;
const DEFAULT_LOAD_CONCURRENCY = 8;
const DEFAULT_LOAD_QUEUE = 128;

interface SaveJob {
  args: SaveArgs;
  inst: Instance;
  rank: RankCtx;
}

interface LoadJob {
  /** performance.now() when the Load reached the engine (for the debug log). */
  tEntry: number;
  args: LoadArgs;
  inst: Instance;
  rank: RankCtx;
  shm: ShmPort;
}

function round3(ms: number): number {
  return Math.round(ms * 1e3) / 1e3;
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

function sameLists(
  ids: number[],
  hashes: Uint8Array[],
  ids2: number[],
  hashes2: Uint8Array[],
): boolean {
  if (ids === ids2 && hashes === hashes2) return true;
  if (ids.length !== ids2.length) return false;
  for (let i = 0; i < ids.length; i++) {
    if (ids[i] !== ids2[i] || !sameBytes(hashes[i], hashes2[i])) return false;
  }
  return true;
}

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
  readonly #native: NativePort;
  readonly #store: KvStore;
  readonly #log: Logger;
  readonly #metrics: EngineMetrics | undefined;
  readonly #leaseTtlMs: number;
  readonly #tiers: TiersPort | undefined;
  readonly #instances = new Map<string, Instance>();
  /** namespace → its agreed layout and the instances using it. */
  readonly #layouts = new Map<string, NamespaceLayout>();
  readonly #saveStage: Stage<SaveJob, SaveResult>;
  readonly #loadStage: Stage<LoadJob, LoadResult>;
  readonly #saveBatch: BatchWriter;
  readonly #loadBatch: BatchWriter;
  /** Load batch scratch: next target discontinuity after each block (see #submitLoad). */
  #nextBreak = new Int32Array(0);
  readonly #goneListeners: ((instanceId: string, reason: string) => void)[] = [];
  readonly #sealedListeners: ((namespace: string, keys: readonly string[]) => void)[] = [];
  #closed = false;

  constructor(opts: EngineOptions) {
    this.#native = opts.native;
    this.#store = opts.store;
    this.#log = opts.log;
    this.#metrics = opts.metrics;
    this.#leaseTtlMs = opts.leaseTtlMs;
    this.#tiers = opts.tiers;
    this.#saveBatch = this.#native.batch();
    this.#loadBatch = this.#native.batch();
    this.#saveStage = new Stage<SaveJob, SaveResult>(
      "save.gather",
      {
        concurrency: opts.saveConcurrency ?? DEFAULT_SAVE_CONCURRENCY,
        queue: { depth: opts.saveQueueDepth ?? DEFAULT_SAVE_QUEUE, policy: "refuse" },
        metrics: this.#metrics?.stage("save.gather"),
      },
      (job) => this.#runSave(job),
    );
    this.#loadStage = new Stage<LoadJob, LoadResult>(
      "load.submit",
      {
        concurrency: opts.loadConcurrency ?? DEFAULT_LOAD_CONCURRENCY,
        queue: { depth: opts.loadQueueDepth ?? DEFAULT_LOAD_QUEUE, policy: "refuse" },
        metrics: this.#metrics?.stage("load.submit"),
      },
      (job) => this.#runLoad(job),
    );
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
    return this.#native.backend;
  }

  // ---- registration -------------------------------------------------------

  /**
   * Registers all layers of one rank; every check (namespace layout and layer
   * order included) runs before anything is mapped or recorded, and a failure
   * at seal rolls the rank back whole.
   */
  register(
    a: RegisterArgs,
  ): { numLayers: number; topologySealed: boolean; ranksRegistered: number } {
    if (this.#closed) throw new EngineError(Code.UNAVAILABLE, "server is shutting down");
    const { who, ppSize } = validateRegistration(a);
    const n = a.layerNames.length;

    let inst = this.#instances.get(a.instanceId);
    if (inst) {
      if (inst.fenced) {
        throw new EngineError(
          Code.UNAVAILABLE,
          `instance "${a.instanceId}" is being cleaned up; retry`,
        );
      }
      if (inst.namespace !== a.namespace || inst.tpSize !== a.tpSize || inst.ppSize !== ppSize) {
        throw precondition(
          `${who}: instance already registered with namespace "${inst.namespace}" tp_size ${inst.tpSize} pp_size ${inst.ppSize}`,
        );
      }
      if (inst.ranks.has(a.ppRank * a.tpSize + a.tpRank)) {
        throw new EngineError(
          Code.ALREADY_EXISTS,
          `${who}: already registered; unregister it first`,
        );
      }
    }
    // The namespace's layout (sizes, block shape, each stage's layer order) must
    // agree with this rank before anything is mapped. validateRegistration made
    // every layer of the rank share one segment shape.
    const claim: StageClaim = {
      who,
      tpSize: a.tpSize,
      ppSize,
      ppRank: a.ppRank,
      layerNames: a.layerNames,
      segBytes: a.geometry[0].segBytes,
      numSegments: a.geometry[0].numSegments,
    };
    const known = this.#layouts.get(a.namespace);
    if (known) checkStageClaim(known, claim);

    // Map regions (one import per distinct handle); roll back on any failure.
    const imported: RegionPort[] = [];
    const regionOf = new Map<string, RegionPort>();
    const layers: LayerCtx[] = [];
    try {
      for (let i = 0; i < n; i++) {
        const k = keyHex(a.regionHandles[i]);
        let region = regionOf.get(k);
        if (!region) {
          try {
            region = this.#native.importRegion(a.regionHandles[i], a.geometry[i].regionBytes);
          } catch (e) {
            throw invalid(
              `${who} layer "${a.layerNames[i]}": cannot map region: ${(e as Error).message}`,
            );
          }
          imported.push(region);
          regionOf.set(k, region);
        }
        layers.push(layerCtx(a.layerNames[i], a.geometry[i], region));
      }
    } catch (e) {
      this.#closeRegions(imported, who);
      throw e;
    }
    // Registration order is kept: it is the order layers land in a load.
    const rankCtx: RankCtx = {
      tpRank: a.tpRank,
      ppRank: a.ppRank,
      rank: a.ppRank * a.tpSize + a.tpRank,
      deviceId: a.deviceId,
      layers,
      byName: new Map(layers.map((l) => [l.name, l])),
      regions: imported,
    };

    // Commit: the namespace's layout, the instance, the rank.
    const layout = known ?? newLayout(a.namespace, claim);
    if (!known) this.#layouts.set(a.namespace, layout);
    const fixedStage = claimStage(layout, claim);
    const created = !inst;
    if (!inst) inst = new Instance(a.instanceId, a.namespace, a.tpSize, ppSize, a.worldSize);
    const newUser = !layout.users.has(inst.id);
    layout.users.add(inst.id);
    inst.ranks.set(rankCtx.rank, rankCtx);
    if (created) this.#instances.set(inst.id, inst);
    if (inst.ranks.size === inst.worldSize) {
      // Every stage of this instance registered, so every stage order is fixed.
      inst.seal(globalOrder(layout)!);
      try {
        const identity = layoutIdentity(inst.layoutDescription());
        // One layout per namespace across restarts: blocks in a lower tier were cut
        // by the layout that wrote them, and a restart forgets only the RAM binding.
        const stored = this.#tiers?.storedLayouts(inst.namespace) ?? [];
        if (stored.length > 0 && !stored.some((l) => l.fingerprint === identity.fingerprint)) {
          const have = stored.map((l) =>
            `${l.summary} (fingerprint ${l.fingerprint}, ${l.blocks} blocks)`
          ).join("; ");
          throw new Error(
            `namespace "${inst.namespace}" is stored on ${
              stored[0].where
            } with layout ${have}; this instance ` +
              `offers ${identity.summary} (fingerprint ${identity.fingerprint}); one layout per ` +
              `namespace: use a namespace per layout, or start the server with --ssd-reset`,
          );
        }
        this.#store.defineNamespace(inst.namespace, {
          layers: inst.layerNames.length,
          tpSize: inst.tpSize,
          collapseTp: false,
          segments: claim.numSegments,
          segmentBytes: claim.segBytes,
          identity,
        });
      } catch (e) {
        // The SSD or the store still holds this namespace under another layout
        // (blocks saved before every engine of it left): roll this rank back whole.
        inst.ranks.delete(rankCtx.rank);
        inst.unseal();
        if (created) this.#instances.delete(inst.id);
        if (newUser) layout.users.delete(inst.id);
        if (fixedStage) layout.stages[a.ppRank] = undefined;
        if (!known) this.#layouts.delete(a.namespace);
        this.#closeRegions(imported, who);
        throw precondition(`${who}: ${(e as Error).message}`);
      }
      this.#log.info("topology sealed", {
        instance: inst.id,
        namespace: inst.namespace,
        layers: inst.layerNames.length,
        world_size: inst.worldSize,
      });
    }
    this.#log.info("rank registered", {
      instance: a.instanceId,
      tp_rank: a.tpRank,
      pp_rank: a.ppRank,
      layers: n,
      regions: imported.length,
      ranks: inst.ranks.size,
      world_size: inst.worldSize,
    });
    return { numLayers: n, topologySealed: inst.sealed, ranksRegistered: inst.ranks.size };
  }

  #closeRegions(regions: RegionPort[], who: string): void {
    for (const r of regions) {
      try {
        r.close();
      } catch (e) {
        // A region we just mapped has no copies; a failure here is a native bug worth logging.
        this.#log.error("closing region failed", { who, error: (e as Error).message });
      }
    }
  }

  #instance(id: string, what: string): Instance {
    const inst = this.#instances.get(id);
    if (!inst) throw precondition(`${what}: instance "${id}" is not registered`);
    return inst;
  }

  // ---- save ---------------------------------------------------------------

  /** Copies the listed blocks into the pool; resolves after the gather landed and the slots joined their blocks. */
  async save(args: SaveArgs): Promise<SaveResult> {
    const inst = this.#instance(args.instanceId, "Save");
    const rank = inst.rankCtx(args.tpRank, args.ppRank, "Save");
    if (inst.fenced) {
      throw new EngineError(Code.UNAVAILABLE, `instance "${inst.id}" is being cleaned up`);
    }
    const sub = this.#saveStage.submit({ args, inst, rank });
    if (sub.status === "refused") {
      this.#metrics?.saveFailed("queue_full");
      throw new EngineError(
        Code.RESOURCE_EXHAUSTED,
        `instance "${inst.id}" rank ${rank.rank}: save queue full; the save is dropped`,
      );
    }
    const out = await sub.done();
    if (out.status === "done") return out.value;
    if (out.status === "failed") throw out.error;
    throw new EngineError(Code.RESOURCE_EXHAUSTED, `save ${out.status} by the save queue`);
  }

  async #runSave(job: SaveJob): Promise<SaveResult> {
    const { args, inst, rank } = job;
    const tStart = performance.now();
    const who = `instance "${inst.id}" tp_rank ${rank.tpRank} pp_rank ${rank.ppRank}` +
      (args.requestId ? ` request "${args.requestId}"` : "");
    // Validate everything before allocating anything. Layers carrying the same
    // (ids, hashes) lists — the normal case: every layer saves the same blocks —
    // share one store plan; all plans go into ONE gather batch.
    const groups: {
      ids: number[];
      hashes: Uint8Array[];
      layers: LayerCtx[];
      checkedFor: number;
    }[] = [];
    const seenLayer = new Set<string>();
    const shared = (args.blockIds?.length ?? 0) > 0 || (args.blockHashes?.length ?? 0) > 0;
    if (shared && args.layers.length > 0) {
      throw invalid(
        `${who}: Save gives both per-layer lists and the all-layers block_ids/block_hashes`,
      );
    }
    const layerSaves = shared
      ? rank.layers.map((l) => ({
        layerName: l.name,
        blockIds: args.blockIds!,
        blockHashes: args.blockHashes!,
      }))
      : args.layers;
    for (const ls of layerSaves) {
      const layer = rank.byName.get(ls.layerName);
      if (!layer) {
        throw invalid(
          `${who}: Save names layer "${ls.layerName}", which this rank did not register`,
        );
      }
      if (seenLayer.has(layer.name)) {
        throw invalid(`${who}: Save lists layer "${layer.name}" twice`);
      }
      seenLayer.add(layer.name);
      if (ls.blockIds.length !== ls.blockHashes.length) {
        throw invalid(
          `${who} layer "${layer.name}": ${ls.blockIds.length} block_ids but ${ls.blockHashes.length} block_hashes`,
        );
      }
      const nb = layer.geometry.numBlocks;
      const g = groups.find((g) => sameLists(g.ids, g.hashes, ls.blockIds, ls.blockHashes));
      // The all-layers shorthand hands every layer the same arrays: check them once per num_blocks.
      if (!g || g.checkedFor !== nb) {
        for (let i = 0; i < ls.blockIds.length; i++) {
          const id = ls.blockIds[i];
          if (!(id < nb)) {
            throw invalid(`${who} layer "${layer.name}": block id ${id} >= num_blocks ${nb}`);
          }
          const h = ls.blockHashes[i];
          if (h.length < 1 || h.length > MAX_HASH_BYTES) {
            throw invalid(
              `${who} layer "${layer.name}": block hash ${i} is ${h.length} bytes (1..${MAX_HASH_BYTES})`,
            );
          }
        }
        if (g) g.checkedFor = nb;
      }
      if (g) g.layers.push(layer);
      else {groups.push({
          ids: ls.blockIds,
          hashes: ls.blockHashes,
          layers: [layer],
          checkedFor: nb,
        });}
    }
    if (groups.length === 0) {
      return {
        blocksSaved: 0,
        blocksSkipped: 0,
        bytesCopied: 0,
        blocksRefused: 0,
        blocksNotAdmitted: 0,
      };
    }
    inst.begin("Save");
    const t0 = performance.now();
    const plans: { plan: SavePlan; group: typeof groups[number] }[] = [];
    try {
      for (const group of groups) {
        const begun = this.#store.beginSave({
          namespace: inst.namespace,
          instance: inst.id,
          rank: rank.tpRank,
          hashes: group.hashes,
          layers: group.layers.map((l) => l.layerId),
        });
        if (!begun.ok) {
          this.#metrics?.saveFailed("pool_exhausted");
          throw new EngineError(
            Code.RESOURCE_EXHAUSTED,
            `${who}: ${begun.error.message}; the save is dropped`,
          );
        }
        plans.push({ plan: begun.plan, group });
      }
      const tPlanned = performance.now();
      let blocks = 0, skipped = 0, refused = 0, notAdmitted = 0, segs = 0, layerGroups = 0;
      for (const { plan } of plans) {
        blocks += plan.blockCount;
        skipped += plan.deduplicated;
        refused += plan.refusedForRoom;
        notAdmitted += plan.admissionRejected;
        segs += plan.blockCount * plan.layers.length * plan.segments;
        layerGroups += plan.layers.length;
      }
      if (refused > 0) this.#metrics?.saveFailed("pool_exhausted_partial");
      let bytes = 0;
      let tBuilt = tPlanned;
      let nativeNs = 0;
      if (segs > 0) {
        // ONE gather batch for every layer of the request.
        const b = this.#saveBatch;
        b.ensure(layerGroups, segs);
        b.reset("gather");
        for (const { plan, group } of plans) {
          const n = plan.blockCount;
          if (n === 0) continue;
          const S = plan.segments;
          for (let li = 0; li < group.layers.length; li++) {
            const layer = group.layers[li];
            const g = layer.geometry;
            let opened = false;
            // Segment-major (all K, then all V): consecutive blocks then sit next to
            // each other in both the region and the pool, and the writer merges them.
            for (let s = 0; s < S; s++) {
              for (let k = 0; k < n; k++) {
                const off = plan.offsets[(li * S + s) * n + k];
                if (off < 0) continue; // this slot is already held
                if (!opened) {
                  b.group(layer.region, layer.layerId);
                  opened = true;
                }
                const at = g.baseOffset + group.ids[plan.hashIndex[k]] * g.blockStride +
                  s * g.segStride;
                b.seg(at, off, g.segBytes);
              }
            }
          }
        }
        tBuilt = performance.now();
        try {
          const done = await this.#native.submit(b);
          bytes = done.bytes;
          nativeNs = done.ns;
        } catch (e) {
          // The engine shrank its own region under the copy: its request fails
          // (FAILED_PRECONDITION); any other native failure is ours (INTERNAL).
          const fault = e instanceof ClientMemoryFault;
          this.#metrics?.saveFailed(fault ? "client_memory_fault" : "copy_failed");
          if (fault) {
            this.#log.warn("save failed: client memory gone", {
              instance: inst.id,
              rank: rank.rank,
              request: args.requestId || undefined,
              error: (e as Error).message,
            });
          }
          throw new EngineError(
            fault ? Code.FAILED_PRECONDITION : Code.INTERNAL,
            `${who}: gather copy failed: ${(e as Error).message}`,
          );
        }
      }
      // The bytes are in the pool: the slots join their blocks, complete blocks seal.
      const tCopied = performance.now();
      let sealed = 0;
      for (const p of plans.splice(0)) {
        const done = this.#store.completeSave(p.plan, true);
        sealed += done.sealed;
        if (done.sealed > 0) {
          this.#tiers?.sealed(inst.namespace, sealedHashBytes(p.plan, p.group.hashes, done));
          for (const f of this.#sealedListeners) f(inst.namespace, done.sealedKeys);
        }
      }
      const secs = (performance.now() - t0) / 1000;
      this.#metrics?.saveDone(bytes, secs, blocks);
      this.#log.debug("save done", {
        instance: inst.id,
        rank: rank.rank,
        request: args.requestId || undefined,
        blocks,
        skipped,
        refused,
        not_admitted: notAdmitted,
        sealed,
        bytes,
        ms: Math.round(secs * 1e6) / 1e3,
        // Phases, for finding where a save's time goes.
        validate_ms: round3(t0 - tStart),
        plan_ms: round3(tPlanned - t0),
        build_ms: round3(tBuilt - tPlanned),
        copy_ms: round3(tCopied - tBuilt),
        seal_ms: round3(performance.now() - tCopied),
        native_ms: round3(nativeNs / 1e6),
      });
      return {
        blocksSaved: blocks,
        blocksSkipped: skipped,
        bytesCopied: bytes,
        blocksRefused: refused,
        blocksNotAdmitted: notAdmitted,
      };
    } finally {
      // Plans still here did not complete: free their slots (never half-written data).
      for (const p of plans) this.#store.completeSave(p.plan, false);
      inst.end();
    }
  }

  // ---- query --------------------------------------------------------------

  /** Longest cached prefix; a hit pins it under a lease consumable once per rank. */
  query(
    instanceId: string,
    hashes: Uint8Array[],
    requestId: string,
  ): { hits: number; leaseId: Uint8Array | null; ttlMs: number; loading?: boolean } {
    const inst = this.#instance(instanceId, `QueryPrefetch (request "${requestId}")`);
    if (!requestId) throw invalid(`instance "${instanceId}": QueryPrefetch needs a request_id`);
    if (!inst.sealed) {
      throw precondition(
        `instance "${inst.id}": QueryPrefetch before the topology is sealed (${inst.ranks.size}/${inst.worldSize} ranks)`,
      );
    }
    if (inst.fenced) {
      throw new EngineError(Code.UNAVAILABLE, `instance "${inst.id}" is being cleaned up`);
    }
    for (let i = 0; i < hashes.length; i++) {
      if (hashes[i].length < 1 || hashes[i].length > MAX_HASH_BYTES) {
        throw invalid(
          `request "${requestId}": block hash ${i} is ${
            hashes[i].length
          } bytes (1..${MAX_HASH_BYTES})`,
        );
      }
    }
    if (this.#tiers?.beforeQuery(inst.namespace, inst.id, hashes, requestId)) {
      this.#log.debug("query loading from a lower tier", { instance: inst.id, request: requestId });
      return { hits: 0, leaseId: null, ttlMs: this.#leaseTtlMs, loading: true };
    }
    const r = this.#store.query(inst.namespace, hashes, inst.id, inst.worldSize);
    this.#metrics?.queryDone(hashes.length, r.hits);
    this.#log.debug("query", {
      instance: inst.id,
      request: requestId,
      requested: hashes.length,
      hits: r.hits,
    });
    return { hits: r.hits, leaseId: r.lease?.idBytes ?? null, ttlMs: this.#leaseTtlMs };
  }

  // ---- load ---------------------------------------------------------------

  /** Consumes the lease for this rank and submits ONE scatter batch; resolves at submit. */
  async load(args: LoadArgs): Promise<LoadResult> {
    const tEntry = performance.now();
    let shm;
    // Attach the load state first so that any refusal is visible to a polling engine too.
    if (!args.loadStateShm) {
      throw invalid(`instance "${args.instanceId}": Load needs load_state_shm`);
    }
    try {
      shm = this.#native.openShm(args.loadStateShm, LOAD_STATE_BYTES);
    } catch (e) {
      throw invalid(
        `instance "${args.instanceId}": cannot open load state "${args.loadStateShm}": ${
          (e as Error).message
        }`,
      );
    }
    let handedOff = false;
    // The rank's layer count once known: a refusal then marks exactly that many layers done.
    let numLayers: number | undefined;
    try {
      this.#loadStateOp(
        () => checkLoadState(shm, args.loadStateShm),
        `instance "${args.instanceId}"` + (args.requestId ? ` request "${args.requestId}"` : ""),
        args.loadStateShm,
      );
      const inst = this.#instance(args.instanceId, "Load");
      const rank = inst.rankCtx(args.tpRank, args.ppRank, "Load");
      numLayers = rank.layers.length;
      if (args.leaseId.length !== LEASE_ID_BYTES) {
        throw invalid(
          `instance "${args.instanceId}": lease id is ${args.leaseId.length} bytes, expected ${LEASE_ID_BYTES}`,
        );
      }
      const sub = this.#loadStage.submit({ args, inst, rank, shm, tEntry });
      if (sub.status === "refused") {
        throw new EngineError(Code.RESOURCE_EXHAUSTED, `instance "${inst.id}": load queue full`);
      }
      const out = await sub.done();
      if (out.status === "done") {
        handedOff = true;
        return out.value;
      }
      if (out.status === "failed") throw out.error;
      throw new EngineError(Code.RESOURCE_EXHAUSTED, `load ${out.status} by the load queue`);
    } catch (e) {
      this.#failLoadState(shm, args.loadStateShm, STATE_REJECTED, numLayers);
      throw e;
    } finally {
      if (!handedOff) this.#closeShm(shm, args.loadStateShm);
    }
  }

  /**
   * Runs a guarded access to an engine's load state; a block the engine has
   * shrunk since it was opened fails the Load with FAILED_PRECONDITION.
   */
  #loadStateOp(fn: () => void, who: string, name: string): void {
    try {
      fn();
    } catch (e) {
      if (!(e instanceof ClientMemoryFault)) throw e;
      throw precondition(`${who}: load state "${name}" is gone: ${e.message}`);
    }
  }

  /** Best effort: a block the engine shrank cannot carry the failure any more. */
  #failLoadState(shm: ShmPort, name: string, code: number, numLayers?: number): void {
    try {
      failLoadState(shm, code, numLayers);
    } catch (e) {
      if (!(e instanceof ClientMemoryFault)) throw e;
      this.#log.warn("cannot mark load state failed: the engine shrank it", {
        shm: name,
        error: e.message,
      });
    }
  }

  #closeShm(shm: { close(): void }, name: string): void {
    try {
      shm.close();
    } catch (e) {
      // Only reached after the batch's completion record, when the native layer
      // has already dropped its reference: a failure here is a bug worth a log line.
      this.#log.error("closing load state failed", { shm: name, error: (e as Error).message });
    }
  }

  /** Stage worker: the whole submit is synchronous; errors become a rejected promise. */
  #runLoad(job: LoadJob): Promise<LoadResult> {
    try {
      return Promise.resolve(this.#submitLoad(job));
    } catch (e) {
      return Promise.reject(e);
    }
  }

  #submitLoad(job: LoadJob): LoadResult {
    const { args, inst, rank, shm, tEntry } = job;
    const tStart = performance.now();
    const who = `instance "${inst.id}" tp_rank ${rank.tpRank} pp_rank ${rank.ppRank}` +
      (args.requestId ? ` request "${args.requestId}"` : "");
    inst.begin("Load");
    let view;
    try {
      // Every id against every layer's num_blocks; layers of one rank nearly always
      // share it, and a pass against the same bound would check nothing new.
      const ids = args.blockIds;
      let checked = -1;
      for (const l of rank.layers) {
        const numBlocks = l.geometry.numBlocks;
        if (numBlocks === checked) continue;
        for (let i = 0; i < ids.length; i++) {
          if (!(ids[i] < numBlocks)) {
            throw invalid(
              `${who} layer "${l.name}": target block id ${ids[i]} >= num_blocks ${numBlocks}`,
            );
          }
        }
        checked = numBlocks;
      }
      // Last check, and the only state change before the copy: the store checks
      // the target count against the lease before this rank's consume is spent,
      // so every refusal up to here leaves the lease usable by a corrected retry.
      view = this.#store.consumeLease(args.leaseId, inst.id, rank.rank, {
        tpRank: rank.tpRank,
        layers: rank.layers.map((l) => l.layerId),
        count: ids.length,
      });
    } catch (e) {
      inst.end();
      if (e instanceof StorageError) throw new EngineError(codeOf(e), `${who}: ${e.message}`);
      throw e;
    }
    const tLease = performance.now();
    if (view.blockCount === 0) {
      // Nothing to copy: this rank's share of the lease is consumed, the load is done.
      this.#store.loadDone(view);
      inst.end();
      // A throw here leaves the block to load()'s refusal path (marked failed, then closed).
      this.#loadStateOp(() => completeLoadState(shm, rank.layers.length), who, args.loadStateShm);
      this.#closeShm(shm, args.loadStateShm);
      this.#log.debug("load done", {
        instance: inst.id,
        request: args.requestId || undefined,
        rank: rank.rank,
        blocks: 0,
      });
      return { numBlocks: 0, numLayers: rank.layers.length, bytes: 0, done: Promise.resolve() };
    }
    try {
      this.#loadStateOp(() => armLoadState(shm, rank.layers.length), who, args.loadStateShm);
      const b = this.#loadBatch;
      let nSegs = 0;
      for (const l of rank.layers) nSegs += args.blockIds.length * l.geometry.numSegments;
      b.ensure(rank.layers.length, nSegs);
      b.reset("scatter", { shm, offset: OFF_PROGRESS });
      const n = view.blockCount;
      const S = view.segments;
      const ids = args.blockIds;
      const starts = view.runStarts;
      const runs = starts.length - 1;
      const runOffsets = view.runOffsets;
      const itemStride = view.itemStride;
      // One segment per piece of a run (blocks consecutive in the pool) whose
      // target blocks are consecutive too: for a prefix saved in one request
      // into consecutive free blocks, one segment per layer and K/V, built from
      // ~64 steps, not 40,000. nextBreak[k]: the first block after k whose target
      // does not continue its predecessor's (depends on the geometry only).
      if (this.#nextBreak.length < n) this.#nextBreak = new Int32Array(n);
      const nextBreak = this.#nextBreak;
      let breaksFor = -1; // blockStride the table was built for
      let breaksLen = -1; // and segBytes
      for (let li = 0; li < rank.layers.length; li++) {
        const l = rank.layers[li];
        const g = l.geometry;
        const stride = g.blockStride;
        const len = g.segBytes;
        if (stride !== breaksFor || len !== breaksLen) {
          let next = n;
          for (let k = n - 1; k >= 0; k--) {
            nextBreak[k] = next;
            if (k > 0 && (ids[k] - ids[k - 1]) * stride !== len) next = k;
          }
          breaksFor = stride;
          breaksLen = len;
        }
        // A run's blocks are one pool item apart; they are contiguous only when
        // that is exactly the segment (no padding up to the allocation unit).
        const poolContiguous = itemStride === len;
        b.group(l.region, l.layerId);
        for (let s = 0; s < S; s++) {
          const base = g.baseOffset + s * g.segStride;
          const col = (li * S + s) * runs;
          for (let r = 0; r < runs; r++) {
            const first = starts[r];
            const end = starts[r + 1];
            const pool0 = runOffsets[col + r];
            let k = first;
            while (k < end) {
              const e = poolContiguous ? Math.min(nextBreak[k], end) : k + 1;
              b.seg(base + ids[k] * stride, pool0 + (k - first) * itemStride, (e - k) * len);
              k = e;
            }
          }
        }
      }
      const t0 = performance.now();
      let copy;
      try {
        copy = this.#native.submit(b);
      } catch (e) {
        // pf_copy_submit resets the progress words: a shrunk block fails it.
        if (!(e instanceof ClientMemoryFault)) throw e;
        throw precondition(`${who}: load state "${args.loadStateShm}" is gone: ${e.message}`);
      }
      const tSubmitted = performance.now();
      const bytes = rank.layers.reduce((n, l) => n + l.slotBytes, 0) * args.blockIds.length;
      const done = copy.then(
        (d) => {
          this.#metrics?.loadDone(d.bytes, (performance.now() - t0) / 1000, true);
          this.#log.debug("load done", {
            instance: inst.id,
            request: args.requestId || undefined,
            rank: rank.rank,
            blocks: args.blockIds.length,
            bytes: d.bytes,
            admit_ms: round3(tStart - tEntry),
            prepare_ms: round3(t0 - tStart),
            lease_ms: round3(tLease - tStart),
            batch_ms: round3(t0 - tLease),
            submit_ms: round3(tSubmitted - t0),
            copy_ms: round3(performance.now() - t0),
            native_ms: round3(d.ns / 1e6),
          });
        },
        (e) => {
          // The native layer writes a failed batch's state itself; this also covers
          // a failure it could not report there, so the engine never waits forever.
          this.#failLoadState(
            shm,
            args.loadStateShm,
            (e as { status?: number }).status ?? STATE_REJECTED,
            rank.layers.length,
          );
          this.#metrics?.loadDone(0, (performance.now() - t0) / 1000, false);
          this.#log.warn("load copy failed", {
            request: args.requestId || undefined,
            instance: inst.id,
            tp_rank: rank.tpRank,
            pp_rank: rank.ppRank,
            client_memory_fault: e instanceof ClientMemoryFault,
            error: (e as Error).message,
          });
        },
      ).finally(() => {
        this.#store.loadDone(view);
        this.#closeShm(shm, args.loadStateShm);
        inst.end();
      });
      return { numBlocks: args.blockIds.length, numLayers: rank.layers.length, bytes, done };
    } catch (e) {
      this.#store.loadDone(view);
      inst.end();
      throw e;
    }
  }

  // ---- release / cleanup --------------------------------------------------

  release(leaseId: Uint8Array): void {
    this.#store.releaseLease(leaseId);
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
    inst.fenced = true;
    const t0 = performance.now();
    await inst.drain();
    // Drained: every copy's completion record has arrived, and the native layer
    // drops a batch's region references before posting it, so closing cannot race a copy.
    for (const r of inst.ranks.values()) {
      this.#closeRegions(r.regions, `instance "${inst.id}" rank ${r.rank}`);
    }
    const { leases, inflightFreed } = this.#store.dropInstance(inst.id);
    this.#instances.delete(inst.id);
    const lay = this.#layouts.get(inst.namespace);
    if (lay) {
      lay.users.delete(inst.id);
      // The layout stays bound while blocks of the namespace may be cached; an empty
      // namespace with no user may be re-bound by the next instance.
      if (lay.users.size === 0 && this.#store.stats().sealedBlocks === 0) {
        this.#layouts.delete(inst.namespace);
      }
    }
    this.#log.info("instance cleaned up", {
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
    return [...this.#instances.values()].map((i) => ({
      instanceId: i.id,
      namespace: i.namespace,
      tpSize: i.tpSize,
      ppSize: i.ppSize,
      worldSize: i.worldSize,
      ranksRegistered: i.ranks.size,
      sealed: i.sealed,
      numLayers: i.layerNames.length,
      layers: [...i.layerNames],
      inflightCopies: i.inflight,
      ageSeconds: Math.round((now - i.createdAt) / 1000),
    }));
  }

  has(instanceId: string): boolean {
    return this.#instances.has(instanceId);
  }

  stageStats() {
    return [this.#saveStage.stats(), this.#loadStage.stats()];
  }

  /** Cleans every instance up and stops accepting work. */
  async close(): Promise<void> {
    this.#closed = true;
    for (const id of [...this.#instances.keys()]) await this.unregister(id, "shutdown");
  }
}
