/**
 * Save, for one rank: validate the request (every layer registered, every
 * block id below its layer's num_blocks, every hash 1..64 bytes), plan it in
 * the store (dedup, room, admission, allocation), write ONE gather batch for
 * every layer (lib/transfer/plan.ts), await it, then complete the plans:
 * the slots join their blocks and complete blocks seal. A save that fails
 * anywhere completes its plans as failed: nothing half-written is ever
 * served.
 *
 * @module
 */
import { MAX_HASH_BYTES, MAX_REQUEST_ID_CHARS } from "../limits.ts";
import type { SavePlan } from "../storage/store.ts";
import { sealedHashBytes } from "../storage/tier.ts";
import type { TransferPlanner } from "../transfer/plan.ts";
import { type EngineContext, round3 } from "./context.ts";
import { Code, EngineError, type ErrorFields, invalid } from "./errors.ts";
import type { Instance, LayerCtx, RankCtx } from "./instances.ts";
import { outOf } from "./geometry.ts";
import { type BatchWriter, ClientMemoryFault } from "./ports.ts";

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
}

export interface SaveResult {
  blocksSaved: number;
  blocksSkipped: number;
  bytesCopied: number;
  blocksRefused: number;
  /** New blocks TinyLFU admission turned away (not saved). */
  blocksNotAdmitted: number;
}

/** A Save admitted by the save stage. */
export interface SaveJob {
  args: SaveArgs;
  inst: Instance;
  rank: RankCtx;
}

/** Layers saving the same (ids, hashes) lists: one store plan for all of them. */
interface LayerGroup {
  ids: number[];
  hashes: Uint8Array[];
  layers: LayerCtx[];
  checkedFor: number;
}

const NOTHING: SaveResult = {
  blocksSaved: 0,
  blocksSkipped: 0,
  bytesCopied: 0,
  blocksRefused: 0,
  blocksNotAdmitted: 0,
};

/** Runs Saves; one per engine (it owns the gather batch and its planner). */
export class SaveRunner {
  constructor(
    readonly ctx: EngineContext,
    readonly batch: BatchWriter,
    readonly planner: TransferPlanner,
    /** Called with the keys of blocks a save sealed (metrics, cross-node index). */
    readonly onSealed: (namespace: string, keys: readonly string[]) => void,
  ) {}

  /**
   * The save stage's worker: the one place where a save's phases are timed
   * and its plans are settled exactly once (the try/finally below).
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
    if (groups.length === 0) return { ...NOTHING };
    inst.begin("Save");
    const t0 = performance.now();
    const plans: { plan: SavePlan; group: LayerGroup }[] = [];
    try {
      for (const group of groups) plans.push({ plan: this.#plan(job, group, who, fields), group });
      const tPlanned = performance.now();
      const result = tally(plans.map((p) => p.plan));
      if (result.blocksRefused > 0) {
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
      let sealed = 0;
      // One plan at a time: a throw below (a tier's or a listener's) leaves the plans not
      // yet completed to the finally, which frees them, instead of leaking their slots.
      while (plans.length > 0) {
        const done = this.ctx.store.completeSave(plans[0].plan, true);
        const p = plans.shift()!;
        sealed += done.sealed;
        if (done.sealed > 0) {
          this.ctx.tiers?.sealed(inst.namespace, sealedHashBytes(p.plan, p.group.hashes, done));
          this.onSealed(inst.namespace, done.sealedKeys);
        }
      }
      const secs = (performance.now() - t0) / 1000;
      this.ctx.metrics?.saveDone(copied.bytes, secs, result.blocksSaved, rank.deviceId);
      this.ctx.log.debug("save done", {
        instance: inst.id,
        rank: rank.rank,
        request: args.requestId || undefined,
        blocks: result.blocksSaved,
        skipped: result.blocksSkipped,
        refused: result.blocksRefused,
        not_admitted: result.blocksNotAdmitted,
        sealed,
        bytes: copied.bytes,
        ms: Math.round(secs * 1e6) / 1e3,
        // Phases, for finding where a save's time goes.
        validate_ms: round3(t0 - tStart),
        plan_ms: round3(tPlanned - t0),
        build_ms: round3(tBuilt - tPlanned),
        copy_ms: round3(tCopied - tBuilt),
        seal_ms: round3(performance.now() - tCopied),
        native_ms: round3(copied.ns / 1e6),
      });
      return result;
    } finally {
      // Plans still here did not complete: free their slots (never half-written data).
      for (const p of plans) this.ctx.store.completeSave(p.plan, false);
      inst.end();
    }
  }

  /** The store's plan for one layer group; a refusal for room fails the whole Save. */
  #plan(job: SaveJob, group: LayerGroup, who: string, fields: ErrorFields): SavePlan {
    const begun = this.ctx.store.beginSave({
      namespace: job.inst.namespace,
      instance: job.inst.id,
      rank: job.rank.tpRank,
      hashes: group.hashes,
      layers: group.layers.map((l) => l.layerId),
      poolPart: this.ctx.poolPartOf?.(job.rank.deviceId),
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

/** What the plans of one Save add up to (bytes filled in after the copy). */
function tally(plans: readonly SavePlan[]): SaveResult {
  const r = { ...NOTHING };
  for (const p of plans) {
    r.blocksSaved += p.blockCount;
    r.blocksSkipped += p.deduplicated;
    r.blocksRefused += p.refusedForRoom;
    r.blocksNotAdmitted += p.admissionRejected;
  }
  return r;
}

/**
 * The Save's layers, grouped by identical (ids, hashes) lists — the normal
 * case, every layer saving the same blocks, is one group — after checking
 * every layer name, list length, block id and hash.
 */
function groupLayers(
  who: string,
  fields: ErrorFields,
  rank: RankCtx,
  args: SaveArgs,
): LayerGroup[] {
  const groups: LayerGroup[] = [];
  const seenLayer = new Set<string>();
  const shared = (args.blockIds?.length ?? 0) > 0 || (args.blockHashes?.length ?? 0) > 0;
  if (shared && args.layers.length > 0) {
    throw invalid(
      `${who}: Save gives both per-layer lists and the all-layers block_ids/block_hashes`,
      fields,
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
        {
          ...fields,
          layer: ls.layerName,
        },
      );
    }
    if (seenLayer.has(layer.name)) {
      throw invalid(`${who}: Save lists layer "${layer.name}" twice`, {
        ...fields,
        layer: layer.name,
      });
    }
    seenLayer.add(layer.name);
    if (ls.blockIds.length !== ls.blockHashes.length) {
      throw invalid(
        `${who} layer "${layer.name}": ${ls.blockIds.length} block_ids but ${ls.blockHashes.length} block_hashes`,
        { ...fields, layer: layer.name },
      );
    }
    const nb = layer.geometry.numBlocks;
    const g = groups.find((g) => sameLists(g.ids, g.hashes, ls.blockIds, ls.blockHashes));
    // The all-layers shorthand hands every layer the same arrays: check them once per num_blocks.
    if (!g || g.checkedFor !== nb) checkBlocks(who, { ...fields, layer: layer.name }, ls, nb);
    if (g) {
      g.checkedFor = nb;
      g.layers.push(layer);
    } else {
      groups.push({ ids: ls.blockIds, hashes: ls.blockHashes, layers: [layer], checkedFor: nb });
    }
  }
  return groups;
}

/**
 * Where each block id was last seen in the list being checked: `seenIn[id] === pass` marks an
 * id of this pass, at index `seenAt[id]`. Kept across calls and grown to the largest num_blocks
 * (no allocation per block or per Save); the JS thread runs one check at a time.
 */
let seenIn = new Uint32Array(0);
let seenAt = new Uint32Array(0);
let pass = 0;

/** A new pass over a list of ids below `numBlocks`. */
function newPass(numBlocks: number): number {
  if (seenIn.length < numBlocks) {
    seenIn = new Uint32Array(numBlocks);
    seenAt = new Uint32Array(numBlocks);
    pass = 0;
  }
  if (++pass > 0xffff_fffe) {
    seenIn.fill(0);
    pass = 1;
  }
  return pass;
}

/**
 * Throws INVALID_ARGUMENT naming the layer and block unless every id and hash is valid, and no
 * id comes twice under two hashes (its bytes would be stored under both, one of them wrong).
 */
function checkBlocks(
  who: string,
  fields: ErrorFields,
  ls: { layerName: string; blockIds: number[]; blockHashes: Uint8Array[] },
  numBlocks: number,
): void {
  const p = newPass(numBlocks);
  for (let i = 0; i < ls.blockIds.length; i++) {
    const id = ls.blockIds[i];
    if (!(id < numBlocks && id >= 0 && Number.isInteger(id))) {
      throw invalid(`${who} layer "${ls.layerName}": block id ${id} ${outOf(id, numBlocks)}`, {
        ...fields,
        blockId: id,
        expected: `< ${numBlocks}`,
        got: id,
      });
    }
    const h = ls.blockHashes[i];
    if (h.length < 1 || h.length > MAX_HASH_BYTES) {
      throw invalid(
        `${who} layer "${ls.layerName}": block hash ${i} is ${h.length} bytes (1..${MAX_HASH_BYTES})`,
        { ...fields, blockId: id, expected: `1..${MAX_HASH_BYTES}`, got: h.length },
      );
    }
    if (seenIn[id] === p && !sameBytes(ls.blockHashes[seenAt[id]], h)) {
      throw invalid(
        `${who} layer "${ls.layerName}": block id ${id} is listed twice (at ${
          seenAt[id]
        } and ${i}) under two different hashes`,
        { ...fields, blockId: id },
      );
    }
    seenIn[id] = p;
    seenAt[id] = i;
  }
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
