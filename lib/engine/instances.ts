/**
 * Instances (one inference engine: all its TP/PP ranks), their registered
 * ranks and layers, and the in-flight counter that cleanup drains before
 * unmapping.
 *
 * Topology: an instance is sealed when world_size ranks have registered.
 * Then layer ids are assigned from the namespace's layer order (see
 * namespaces.ts: the stages in pp_rank order, registration order within a
 * stage), so ids agree across ranks, processes and nodes. How a block's
 * slots are numbered is the store's (lib/storage/offsets.ts).
 *
 * @module
 */
import { Code, EngineError, type ErrorFields, invalid, precondition } from "./errors.ts";
import { rankIndex } from "./rank.ts";
import { engineIdText, HELD_BY_ANOTHER_ENGINE } from "./registration.ts";
import { type Geometry, slotBytes } from "./geometry.ts";
import type { RegionPort } from "./ports.ts";

/** One layer of one rank. */
export interface LayerCtx {
  name: string;
  geometry: Geometry;
  region: RegionPort;
  /** Set when the topology seals. */
  layerId: number;
  slotBytes: number;
}

/** One registered rank (one GPU). */
export interface RankCtx {
  tpRank: number;
  ppRank: number;
  /** Index among the instance's ranks: `rankIndex(tp_rank, pp_rank, tp_size)` (rank.ts). */
  rank: number;
  deviceId: number;
  /** In registration order (the order of layers_ready in a load state). */
  layers: LayerCtx[];
  byName: Map<string, LayerCtx>;
  /** Distinct regions (layers may share one), closed on cleanup. */
  regions: RegionPort[];
  /**
   * `registrationFingerprint` of what registered this rank: a RegisterContext for the
   * rank with another one comes from another engine (register.ts refuses it).
   */
  fingerprint: string;
}

/** An inference engine known to the server. */
export class Instance {
  readonly id: string;
  readonly namespace: string;
  readonly tpSize: number;
  readonly ppSize: number;
  readonly worldSize: number;
  /**
   * The engine_id of the rank that created the instance ("" from a client that sends none):
   * a rank with another non-empty one belongs to another engine (register.ts refuses it).
   */
  readonly engineId: string;
  readonly ranks = new Map<number, RankCtx>();
  readonly createdAt = Date.now();
  sealed = false;
  /** Every layer name of the instance in the namespace's order (ids are indexes). Set at seal. */
  layerNames: string[] = [];
  #fenced = false;
  /** Resolves {@link whenFenced}'s promise, once one was asked for. */
  #onFence: (() => void) | undefined;
  #fencedPromise: Promise<void> | undefined;
  #inflight = 0;
  #drainWaiters: (() => void)[] = [];

  constructor(
    id: string,
    namespace: string,
    tpSize: number,
    ppSize: number,
    worldSize: number,
    engineId = "",
  ) {
    this.id = id;
    this.namespace = namespace;
    this.tpSize = tpSize;
    this.ppSize = ppSize;
    this.worldSize = worldSize;
    this.engineId = engineId;
  }

  /** Set once cleanup starts: no new save/load is accepted. */
  get fenced(): boolean {
    return this.#fenced;
  }

  /** Starts cleanup: no new save/load is accepted, and what waits on {@link whenFenced} stops. */
  fence(): void {
    this.#fenced = true;
    this.#onFence?.();
  }

  /**
   * Resolves once cleanup starts: what waits on another instance's work (a Save's riders,
   * lib/engine/save.ts) stops waiting, so this instance's drain is not held by it.
   */
  whenFenced(): Promise<void> {
    if (this.#fenced) return Promise.resolve();
    return this.#fencedPromise ??= new Promise((resolve) => (this.#onFence = resolve));
  }

  /** Copies currently targeting this instance's regions. */
  get inflight(): number {
    return this.#inflight;
  }

  /** Throws unless new work may start; then counts it in flight until `end()`. */
  begin(what: string): void {
    if (this.fenced) {
      throw new EngineError(
        Code.UNAVAILABLE,
        `instance "${this.id}" is being cleaned up; ${what} refused`,
      );
    }
    this.#inflight++;
  }

  end(): void {
    this.#inflight--;
    if (this.#inflight === 0) {
      const w = this.#drainWaiters;
      this.#drainWaiters = [];
      for (const f of w) f();
    }
  }

  /** Resolves once no copy targets this instance (call after fencing). */
  drain(): Promise<void> {
    if (this.#inflight === 0) return Promise.resolve();
    return new Promise((resolve) => this.#drainWaiters.push(resolve));
  }

  /** Assigns layer ids once every rank is in; `order` is the namespace's global layer order. */
  seal(order: readonly string[]): void {
    this.layerNames = [...order];
    const ids = new Map(this.layerNames.map((n, i) => [n, i]));
    for (const r of this.ranks.values()) for (const l of r.layers) l.layerId = ids.get(l.name)!;
    this.sealed = true;
  }

  /** Undoes {@link seal} (a registration rolled back at seal time). */
  unseal(): void {
    this.layerNames = [];
    for (const r of this.ranks.values()) for (const l of r.layers) l.layerId = -1;
    this.sealed = false;
  }

  /**
   * The one check of "does this engine id belong to this instance": a non-empty `engineId`
   * that is not the instance's comes from another engine under this instance id, whose rank
   * joining (RegisterContext, register.ts) or whose Save, QueryPrefetch or Load (engine.ts,
   * load.ts) would use this engine's memory: a load scattered into its blocks at the other
   * engine's block ids, a query pinning its blocks under a lease. Refused FAILED_PRECONDITION
   * with the words of a held rank (HELD_BY_ANOTHER_ENGINE) naming `who`, the instance and
   * both ids (also as `expected` / `got`). Empty (a client that predates the field): not
   * checked. One string compare on the accepted path.
   *
   * @example
   * ```ts
   * inst.checkEngine(req.engineId, `QueryPrefetch (request "r1")`, "request", { instance: inst.id });
   * // QueryPrefetch (request "r1"): instance "x" is registered by another engine (its
   * // engine_id "9b1f…", this request's "03c2…"); …
   * ```
   */
  checkEngine(
    engineId: string | undefined,
    who: string,
    sender: "rank" | "request",
    fields: ErrorFields,
  ): void {
    if (!engineId || engineId === this.engineId) return;
    const rule = sender === "rank"
      ? "every rank of one engine sends that engine's engine_id"
      : "an engine's requests carry the engine_id its ranks registered with";
    throw precondition(
      `${who}: instance "${this.id}" ${HELD_BY_ANOTHER_ENGINE} (its engine_id ` +
        `${engineIdText(this.engineId)}, this ${sender}'s ${engineIdText(engineId)}); ${rule}: ` +
        `give this engine another instance id, or unregister the instance`,
      { ...fields, instance: this.id, expected: this.engineId, got: engineId },
    );
  }

  rankCtx(tpRank: number, ppRank: number, what: string): RankCtx {
    // Before the lookup: tp_rank tp_size of pp_rank p would index rank (0, p + 1), so a
    // Save or Load naming it would read or write another rank's memory and spend its share.
    if (!(tpRank < this.tpSize) || !(ppRank < this.ppSize)) {
      throw invalid(
        `instance "${this.id}": ${what} from tp_rank ${tpRank} pp_rank ${ppRank}, outside its topology (tp_size ${this.tpSize}, pp_size ${this.ppSize})`,
        {
          instance: this.id,
          tpRank,
          ppRank,
          expected: `tp_rank < ${this.tpSize}, pp_rank < ${this.ppSize}`,
        },
      );
    }
    const r = this.ranks.get(rankIndex(tpRank, ppRank, this.tpSize));
    if (!r) {
      throw precondition(
        `instance "${this.id}": ${what} from tp_rank ${tpRank} pp_rank ${ppRank}, which is not registered`,
      );
    }
    if (!this.sealed) {
      throw precondition(
        `instance "${this.id}": ${what} before the topology is sealed (${this.ranks.size}/${this.worldSize} ranks registered)`,
      );
    }
    return r;
  }
}

/** Builds a LayerCtx (layer id assigned later at seal). */
export function layerCtx(name: string, geometry: Geometry, region: RegionPort): LayerCtx {
  return { name, geometry, region, layerId: -1, slotBytes: slotBytes(geometry) };
}

/** How a Save or Load names itself in a refusal: its rank and, when it has one, its request. */
export function requestWho(
  method: string,
  a: { tpRank: number; ppRank: number; requestId?: string },
): string {
  return `${method} (tp_rank ${a.tpRank} pp_rank ${a.ppRank}` +
    (a.requestId ? `, request "${a.requestId}")` : ")");
}
