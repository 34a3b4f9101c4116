/**
 * Save, for one rank: validate the request (save_request.ts: every layer
 * registered, every block id below its layer's num_blocks, every hash 1..64
 * bytes), plan it in the store (dedup, room, admission, allocation), write
 * ONE gather batch for every layer (lib/transfer/plan.ts), await it, then
 * complete the plans: the slots join their blocks and complete blocks seal.
 * A save that fails anywhere completes its plans as failed: nothing
 * half-written is ever served. Hashes skipped because another save was still
 * copying them are planned again once it settled (that copy may have failed).
 *
 * @module
 */
import { MAX_REQUEST_ID_CHARS } from "../limits.ts";
import type { SavePlan } from "../storage/store.ts";
import { sealedHashBytes } from "../storage/tier.ts";
import type { TransferPlanner } from "../transfer/plan.ts";
import { within } from "../timer_limit.ts";
import { type EngineContext, round3 } from "./context.ts";
import { Code, EngineError, type ErrorFields, invalid } from "./errors.ts";
import type { Instance, RankCtx } from "./instances.ts";
import { type BatchWriter, ClientMemoryFault } from "./ports.ts";
import { groupLayers, type LayerGroup } from "./save_request.ts";

export interface SaveArgs {
  instanceId: string;
  tpRank: number;
  ppRank: number;
  requestId?: string;
  /** Per-layer lists; empty means "every layer of the rank saves blockIds/blockHashes". */
  layers: { layerName: string; blockIds: number[]; blockHashes: Uint8Array[] }[];
  blockIds?: number[];
  blockHashes?: Uint8Array[];
  /** The sender's engine id: another engine's is refused (`Instance.checkEngine`); "" = not checked. */
  engineId?: string;
  /**
   * Hashes this rank computed over a load that failed on it: discarded in the
   * store when the Save arrives, before its own blocks (save_discard.ts).
   */
  discardHashes?: Uint8Array[];
}

export interface SaveResult {
  blocksSaved: number;
  blocksSkipped: number;
  bytesCopied: number;
  /** Refused for room, or because a discard named them within its TTL (not saved). */
  blocksRefused: number;
  /** New blocks TinyLFU admission turned away (not saved). */
  blocksNotAdmitted: number;
  /** Blocks the Save's discard hashes dropped or evicted (save_discard.ts). */
  blocksDiscarded: number;
}

/** A Save admitted by the save stage. */
export interface SaveJob {
  args: SaveArgs;
  inst: Instance;
  rank: RankCtx;
}

/** A Save that saved nothing (copy it: callers fill it in). */
export const NOTHING_SAVED: Readonly<SaveResult> = {
  blocksSaved: 0,
  blocksSkipped: 0,
  bytesCopied: 0,
  blocksRefused: 0,
  blocksNotAdmitted: 0,
  blocksDiscarded: 0,
};

/**
 * Longest a Save waits for the saves its riders rode on: they end when their
 * copies do (a copy of a 10K-token prefix takes ~25 ms on an H100). Past it,
 * the riders not stored by then count as skipped, as they did before.
 */
export const RIDER_WAIT_MS = 30_000;

/** What one round of a Save did. */
interface Round {
  result: SaveResult;
  /** Per layer group, the hashes skipped because another save was copying them. */
  riders: LayerGroup[];
  /** The other saves running when the round planned (one of them is the copy ridden on). */
  others: Promise<void>[];
}

/** Runs Saves; one per engine (it owns the gather batch and its planner). */
export class SaveRunner {
  /** Saves running now (each settles when its run ends): riders wait for those of their time. */
  readonly #running = new Set<Promise<void>>();

  constructor(
    readonly ctx: EngineContext,
    readonly batch: BatchWriter,
    readonly planner: TransferPlanner,
    /** Called with the keys of blocks a save sealed (metrics, cross-node index). */
    readonly onSealed: (namespace: string, keys: readonly string[]) => void,
  ) {}

  /**
   * The save stage's worker: the request is validated, then copied in one
   * round; hashes it skipped only because another save was copying their
   * slots (riders, see {@link #riders}) are saved again once those saves
   * settled, so the Save answers only when its bytes are in the pool.
   */
  async run(job: SaveJob): Promise<SaveResult> {
    const { args, inst, rank } = job;
    const tStart = performance.now();
    const who = `instance "${inst.id}" tp_rank ${rank.tpRank} pp_rank ${rank.ppRank}` +
      (args.requestId ? ` request "${args.requestId}"` : "");
    const fields: ErrorFields = {
      instance: inst.id,
      tpRank: rank.tpRank,
      ppRank: rank.ppRank,
      requestId: args.requestId || undefined,
    };
    // Validate everything before allocating anything.
    const groups = groupLayers(who, fields, rank, args);
    checkRequestId("Save", inst.id, args.requestId);
    if (groups.length === 0) return { ...NOTHING_SAVED };
    inst.begin("Save");
    let settle!: () => void;
    const me = new Promise<void>((resolve) => (settle = resolve));
    this.#running.add(me);
    try {
      const first = await this.#round(job, groups, who, fields, { me, tStart });
      const result = first.riders.length > 0
        ? await this.#riders(job, first, who, fields)
        : first.result;
      const secs = (performance.now() - tStart) / 1000;
      this.ctx.metrics?.saveDone(result.bytesCopied, secs, result.blocksSaved, rank.deviceId);
      return result;
    } finally {
      this.#running.delete(me);
      settle();
      inst.end();
    }
  }

  /**
   * The riders of the first round: hashes skipped because another save was
   * copying every slot they lacked. That copy may fail (its slots are freed),
   * and this Save's answer would then count them held while nothing of them
   * is stored, nor ever would be (the engine saves a block once). So wait for
   * the saves that were running when the first round planned (one of them is
   * the copy ridden on; bounded by {@link RIDER_WAIT_MS}), then plan the
   * riders again: what landed meanwhile is skipped, what did not is copied
   * now from this engine's blocks (still its until this Save answers).
   */
  async #riders(
    job: SaveJob,
    first: Round,
    who: string,
    fields: ErrorFields,
  ): Promise<SaveResult> {
    const tWait = performance.now();
    const { inst } = job;
    if (first.others.length > 0) {
      // Cut short by this instance's cleanup: its drain must not wait on another's copy.
      const settled = Promise.allSettled(first.others);
      await within(Promise.race([settled, inst.whenFenced()]), RIDER_WAIT_MS);
    }
    const tStart = performance.now();
    const waitMs = tStart - tWait;
    if (inst.fenced) {
      // The engine is going away: copy nothing more from it; the riders stay counted skipped.
      this.ctx.log.info("save riders not copied: the instance is being cleaned up", {
        instance: inst.id,
        rank: job.rank.rank,
        request: job.args.requestId || undefined,
        riders: first.riders.reduce((n, g) => n + g.ids.length, 0),
        wait_ms: round3(waitMs),
      });
      return first.result;
    }
    const again = await this.#round(job, first.riders, who, fields, { tStart, waitMs });
    const r = first.result;
    const p = again.result;
    // Every rider was counted skipped by the first round; those copied or refused now are not.
    r.blocksSkipped -= p.blocksSaved + p.blocksRefused + p.blocksNotAdmitted;
    r.blocksSaved += p.blocksSaved;
    r.blocksRefused += p.blocksRefused;
    r.blocksNotAdmitted += p.blocksNotAdmitted;
    r.bytesCopied += p.bytesCopied;
    return r;
  }

  /**
   * One round: plan every group, ONE gather batch, copy, complete; the one
   * place where a round's phases are timed and its plans are settled exactly
   * once (the try/finally below). `me` (the first round's): the saves running
   * besides this one when it planned are kept, for riders to wait on; a
   * second round (no `me`) plans riders, counted once already.
   */
  async #round(
    job: SaveJob,
    groups: LayerGroup[],
    who: string,
    fields: ErrorFields,
    t: { me?: Promise<void>; tStart: number; waitMs?: number },
  ): Promise<Round> {
    const { inst, rank } = job;
    const me = t.me;
    const t0 = performance.now();
    const plans: { plan: SavePlan; group: LayerGroup }[] = [];
    try {
      for (const group of groups) {
        plans.push({ plan: this.#plan(job, group, who, fields, me === undefined), group });
      }
      const riders = me ? ridersOf(plans) : [];
      const others = riders.length > 0 ? [...this.#running].filter((p) => p !== me) : [];
      const tPlanned = performance.now();
      const result = tally(plans.map((p) => p.plan));
      if (plans.some((p) => p.plan.refusedForRoom > 0)) {
        this.ctx.metrics?.saveFailed("pool_exhausted_partial", rank.deviceId);
      }
      // ONE gather batch for every layer of the request.
      const shape = this.planner.writeSave(
        this.batch,
        plans.map(({ plan, group }) => ({ plan, layers: group.layers, blockIds: group.ids })),
      );
      const tBuilt = performance.now();
      const copied = shape.segments > 0 ? await this.#copy(job, who, fields) : { bytes: 0, ns: 0 };
      result.bytesCopied = copied.bytes;
      // The bytes are in the pool: the slots join their blocks, complete blocks seal.
      const tCopied = performance.now();
      const sealed = this.#complete(plans, inst.namespace);
      this.ctx.log.debug("save done", {
        instance: inst.id,
        rank: rank.rank,
        request: job.args.requestId || undefined,
        round: me ? undefined : "riders",
        blocks: result.blocksSaved,
        skipped: result.blocksSkipped,
        refused: result.blocksRefused,
        not_admitted: result.blocksNotAdmitted,
        riders: riders.length > 0 ? riders.reduce((n, g) => n + g.ids.length, 0) : undefined,
        sealed,
        bytes: copied.bytes,
        ms: round3(performance.now() - t0),
        // Phases, for finding where a save's time goes.
        wait_ms: t.waitMs === undefined ? undefined : round3(t.waitMs),
        validate_ms: round3(t0 - t.tStart),
        plan_ms: round3(tPlanned - t0),
        build_ms: round3(tBuilt - tPlanned),
        copy_ms: round3(tCopied - tBuilt),
        seal_ms: round3(performance.now() - tCopied),
        native_ms: round3(copied.ns / 1e6),
      });
      return { result, riders, others };
    } finally {
      // Plans still here did not complete: free their slots (never half-written data).
      for (const p of plans) this.ctx.store.completeSave(p.plan, false);
    }
  }

  /**
   * Completes the plans, one at a time: a throw (a tier's or a listener's)
   * leaves the plans not yet completed to the caller's finally, which frees
   * them, instead of leaking their slots. Returns the blocks sealed.
   */
  #complete(plans: { plan: SavePlan; group: LayerGroup }[], namespace: string): number {
    let sealed = 0;
    while (plans.length > 0) {
      const done = this.ctx.store.completeSave(plans[0].plan, true);
      const p = plans.shift()!;
      sealed += done.sealed;
      if (done.sealed > 0) {
        this.ctx.tiers?.sealed(namespace, sealedHashBytes(p.plan, p.group.hashes, done));
        this.onSealed(namespace, done.sealedKeys);
      }
    }
    return sealed;
  }

  /** The store's plan for one layer group; a refusal for room fails the whole Save. */
  #plan(
    job: SaveJob,
    group: LayerGroup,
    who: string,
    fields: ErrorFields,
    again: boolean,
  ): SavePlan {
    const begun = this.ctx.store.beginSave({
      namespace: job.inst.namespace,
      instance: job.inst.id,
      rank: job.rank.tpRank,
      hashes: group.hashes,
      layers: group.layers.map((l) => l.layerId),
      poolPart: this.ctx.poolPartOf?.(job.rank.deviceId),
      again,
    });
    if (!begun.ok) {
      this.ctx.metrics?.saveFailed("pool_exhausted", job.rank.deviceId);
      throw new EngineError(
        Code.RESOURCE_EXHAUSTED,
        `${who}: ${begun.error.message}; the save is dropped`,
        { ...begun.error.fields, ...fields },
      );
    }
    return begun.plan;
  }

  /** Submits the written gather batch and awaits it. */
  async #copy(
    job: SaveJob,
    who: string,
    fields: ErrorFields,
  ): Promise<{ bytes: number; ns: number }> {
    try {
      return await this.ctx.native.submit(this.batch);
    } catch (e) {
      // The engine shrank its own region under the copy: its request fails
      // (FAILED_PRECONDITION); any other native failure is ours (INTERNAL).
      const fault = e instanceof ClientMemoryFault;
      this.ctx.metrics?.saveFailed(
        fault ? "client_memory_fault" : "copy_failed",
        job.rank.deviceId,
      );
      if (fault) {
        this.ctx.log.warn("save failed: client memory gone", {
          instance: job.inst.id,
          rank: job.rank.rank,
          request: job.args.requestId || undefined,
          error: (e as Error).message,
        });
      }
      throw new EngineError(
        fault ? Code.FAILED_PRECONDITION : Code.INTERNAL,
        `${who}: gather copy failed: ${(e as Error).message}`,
        fields,
      );
    }
  }
}

/**
 * Refuses a request id past {@link MAX_REQUEST_ID_CHARS}: the one check of
 * every RPC that carries one (Save here, after its lists were checked;
 * QueryPrefetch and Load in engine.ts), over gRPC and the local RPC socket
 * alike, before the id is kept (a tier's read) or logged. The message names
 * the id by its head.
 */
export function checkRequestId(
  method: string,
  instanceId: string,
  requestId: string | undefined,
): void {
  if (requestId === undefined || requestId.length <= MAX_REQUEST_ID_CHARS) return;
  const head = requestId.slice(0, 64);
  throw invalid(
    `${method}: instance "${instanceId}": request_id "${head}..." is ${requestId.length} characters; at most ${MAX_REQUEST_ID_CHARS} are accepted`,
    {
      instance: instanceId,
      requestId: head,
      expected: MAX_REQUEST_ID_CHARS,
      got: requestId.length,
    },
  );
}

/** The riders of each plan, as the layer groups a second round plans (usually none). */
function ridersOf(plans: readonly { plan: SavePlan; group: LayerGroup }[]): LayerGroup[] {
  const out: LayerGroup[] = [];
  for (const { plan, group } of plans) {
    if (plan.riders.length === 0) continue;
    const at = Array.from(plan.riders);
    out.push({
      // Array.from, not .map: optimized .map returns HOLEY arrays (docs/server.md, V8 flags).
      ids: Array.from(at, (i) => group.ids[i]),
      hashes: Array.from(at, (i) => group.hashes[i]),
      layers: group.layers,
      checkedFor: group.checkedFor,
    });
  }
  return out;
}

/** What the plans of one Save add up to (bytes filled in after the copy). */
function tally(plans: readonly SavePlan[]): SaveResult {
  const r = { ...NOTHING_SAVED };
  for (const p of plans) {
    r.blocksSaved += p.blockCount;
    r.blocksSkipped += p.deduplicated;
    r.blocksRefused += p.refusedForRoom + p.discarded;
    r.blocksNotAdmitted += p.admissionRejected;
  }
  return r;
}
