/**
 * RegisterContext, one rank at a time: every check (the request, the
 * instance and the engine it belongs to, the namespace's layout and layer
 * order) runs before anything is mapped or recorded; then the rank's regions
 * are mapped (one import per distinct handle); then the rank is committed.
 * When the last rank arrives the topology seals: layer ids are fixed and the
 * store's namespace is defined from the agreed layout (namespaces.ts owns
 * it). A failure at seal rolls the rank back whole.
 *
 * @module
 */
import { closeRegions, type EngineContext } from "./context.ts";
import { Code, EngineError, invalid, precondition } from "./errors.ts";
import { Instance, type LayerCtx, layerCtx, type RankCtx } from "./instances.ts";
import { rankIndex } from "./rank.ts";
import {
  blockLayoutOf,
  checkStageClaim,
  claimStage,
  globalOrder,
  type NamespaceLayout,
  newLayout,
  type StageClaim,
} from "./namespaces.ts";
import type { RegionPort } from "./ports.ts";
import {
  HELD_BY_ANOTHER_ENGINE,
  keyHex,
  type RegisterArgs,
  registrationFingerprint,
  validateRegistration,
} from "./registration.ts";

/** What RegisterContext answers. */
export interface RegisterResult {
  numLayers: number;
  topologySealed: boolean;
  ranksRegistered: number;
}

/** Registers all layers of one rank (see the module comment). */
export function registerRank(ctx: EngineContext, a: RegisterArgs): RegisterResult {
  const { who, ppSize } = validateRegistration(a);
  const fields = { instance: a.instanceId, tpRank: a.tpRank, ppRank: a.ppRank };
  const rankId = rankIndex(a.tpRank, a.ppRank, a.tpSize);
  const fingerprint = registrationFingerprint(a);
  let inst = ctx.instances.get(a.instanceId);
  if (inst) checkJoin(inst, a, who, ppSize, rankId, fingerprint);
  // The namespace's layout (sizes, block shape, TP sharing, each stage's layer
  // order) must agree with this rank before anything is mapped.
  const claim = stageClaimOf(a, who, ppSize);
  const known = ctx.layouts.get(a.namespace);
  if (known) checkStageClaim(known, claim);
  checkDevice(ctx, a, who);

  const { imported, layers } = mapRegions(ctx, a, who);
  // Registration order is kept: it is the order layers land in a load.
  const rankCtx: RankCtx = {
    tpRank: a.tpRank,
    ppRank: a.ppRank,
    rank: rankId,
    deviceId: a.deviceId,
    layers,
    byName: new Map(layers.map((l) => [l.name, l])),
    regions: imported,
    fingerprint,
  };

  // Commit: the namespace's layout, the instance, the rank.
  const layout = known ?? newLayout(a.namespace, claim);
  if (!known) ctx.layouts.set(a.namespace, layout);
  const fixedStage = claimStage(layout, claim);
  const created = !inst;
  if (!inst) {
    inst = new Instance(a.instanceId, a.namespace, a.tpSize, ppSize, a.worldSize, a.engineId);
  }
  const newUser = !layout.users.has(inst.id);
  layout.users.add(inst.id);
  inst.ranks.set(rankCtx.rank, rankCtx);
  if (created) ctx.instances.set(inst.id, inst);
  if (inst.ranks.size === inst.worldSize) {
    try {
      sealTopology(ctx, inst, layout);
    } catch (e) {
      // A lower tier or the store still holds this namespace under another layout
      // (blocks saved before every engine of it left): roll this rank back whole.
      inst.ranks.delete(rankCtx.rank);
      inst.unseal();
      if (created) ctx.instances.delete(inst.id);
      if (newUser) layout.users.delete(inst.id);
      if (fixedStage) layout.stages[a.ppRank] = undefined;
      if (!known) ctx.layouts.delete(a.namespace);
      closeRegions(ctx, imported, who);
      throw precondition(`${who}: ${(e as Error).message}`, { ...fields, namespace: a.namespace });
    }
  }
  ctx.log.info("rank registered", {
    instance: a.instanceId,
    tp_rank: a.tpRank,
    pp_rank: a.ppRank,
    device: a.deviceId,
    engine_id: a.engineId ?? "",
    layers: a.layerNames.length,
    regions: imported.length,
    ranks: inst.ranks.size,
    world_size: inst.worldSize,
  });
  return {
    numLayers: a.layerNames.length,
    topologySealed: inst.sealed,
    ranksRegistered: inst.ranks.size,
  };
}

/** What this rank says about its stage of the namespace's layout. */
function stageClaimOf(a: RegisterArgs, who: string, ppSize: number): StageClaim {
  // validateRegistration made every layer of the rank share one segment shape.
  return {
    who,
    tpSize: a.tpSize,
    ppSize,
    ppRank: a.ppRank,
    layerNames: a.layerNames,
    segBytes: a.geometry[0].segBytes,
    numSegments: a.geometry[0].numSegments,
    kvSharedAcrossTp: a.kvSharedAcrossTp ?? false,
  };
}

/** The rank's device must be one this server serves (--devices). */
function checkDevice(ctx: EngineContext, a: RegisterArgs, who: string): void {
  if (ctx.native.devices.includes(a.deviceId)) return;
  const served = ctx.native.devices.join(",");
  throw invalid(
    `${who}: device_id ${a.deviceId} is not served by this server (it serves devices ${served}; see --devices)`,
    {
      instance: a.instanceId,
      tpRank: a.tpRank,
      ppRank: a.ppRank,
      expected: served,
      got: a.deviceId,
    },
  );
}

/**
 * A rank joining a known instance: same engine (engine_id), namespace and sizes, not fenced,
 * not registered yet. A rank registered already answers ALREADY_EXISTS when this is the same
 * registration (its holder asking again: a client whose stream broke, the Python client's
 * check once its session is open); another one comes from another engine under this instance
 * id, which must not be told "registered": its saves and loads would use the holder's memory.
 */
function checkJoin(
  inst: Instance,
  a: RegisterArgs,
  who: string,
  ppSize: number,
  rank: number,
  fingerprint: string,
) {
  const fields = { instance: a.instanceId, tpRank: a.tpRank, ppRank: a.ppRank };
  if (inst.fenced) {
    throw new EngineError(
      Code.UNAVAILABLE,
      `instance "${a.instanceId}" is being cleaned up; retry`,
      fields,
    );
  }
  checkEngine(inst, a, who);
  if (inst.namespace !== a.namespace || inst.tpSize !== a.tpSize || inst.ppSize !== ppSize) {
    throw precondition(
      `${who}: instance already registered with namespace "${inst.namespace}" tp_size ${inst.tpSize} pp_size ${inst.ppSize}`,
      fields,
    );
  }
  const held = inst.ranks.get(rank);
  if (!held) return;
  if (held.fingerprint === fingerprint) {
    throw new EngineError(
      Code.ALREADY_EXISTS,
      `${who}: already registered; unregister it first`,
      fields,
    );
  }
  throw precondition(
    `${who} ${HELD_BY_ANOTHER_ENGINE} (its regions differ: held registration ` +
      `${held.fingerprint}, this one ${fingerprint}); unregister it, or give this engine ` +
      `another instance id`,
    { ...fields, expected: held.fingerprint, got: fingerprint },
  );
}

/**
 * Every rank of an instance comes from one engine: a rank whose engine_id (non-empty: an older
 * client sends none, and is not checked) is not the instance's belongs to another engine under
 * this instance id, and joining it would scatter the instance's loads into that engine's memory.
 * Refused with the words of a held rank (a client retries until the instance is gone, as an
 * engine restarted before its old session was seen to end must): `Instance.checkEngine`, the
 * one owner of the check, which also refuses another engine's Save, QueryPrefetch and Load.
 */
function checkEngine(inst: Instance, a: RegisterArgs, who: string): void {
  inst.checkEngine(a.engineId, who, "rank", {
    instance: a.instanceId,
    tpRank: a.tpRank,
    ppRank: a.ppRank,
  });
}

/** Maps the rank's regions (one import per distinct handle); on any failure unmaps them all. */
function mapRegions(
  ctx: EngineContext,
  a: RegisterArgs,
  who: string,
): { imported: RegionPort[]; layers: LayerCtx[] } {
  const imported: RegionPort[] = [];
  const regionOf = new Map<string, RegionPort>();
  const layers: LayerCtx[] = [];
  try {
    for (let i = 0; i < a.layerNames.length; i++) {
      const k = keyHex(a.regionHandles[i]);
      let region = regionOf.get(k);
      if (!region) {
        try {
          region = ctx.native.importRegion(
            a.regionHandles[i],
            a.geometry[i].regionBytes,
            a.deviceId,
          );
        } catch (e) {
          throw invalid(
            `${who} layer "${a.layerNames[i]}": cannot map region: ${(e as Error).message}`,
            { instance: a.instanceId, tpRank: a.tpRank, ppRank: a.ppRank, layer: a.layerNames[i] },
          );
        }
        imported.push(region);
        regionOf.set(k, region);
      }
      layers.push(layerCtx(a.layerNames[i], a.geometry[i], region));
    }
  } catch (e) {
    closeRegions(ctx, imported, who);
    throw e;
  }
  return { imported, layers };
}

/**
 * Every rank is in: fix the layer ids and define the store's namespace from
 * the agreed layout, after checking it against what the lower tiers hold. Throws a
 * plain Error (the caller rolls back and answers FAILED_PRECONDITION).
 */
function sealTopology(ctx: EngineContext, inst: Instance, layout: NamespaceLayout): void {
  // Every stage of this instance registered, so every stage order is fixed.
  inst.seal(globalOrder(layout)!);
  const block = blockLayoutOf(layout);
  const identity = block.identity!;
  // One layout per namespace across restarts: blocks in a lower tier were cut
  // by the layout that wrote them, and a restart forgets only the RAM binding.
  const stored = ctx.tiers?.storedLayouts(inst.namespace) ?? [];
  if (stored.length > 0 && !stored.some((l) => l.fingerprint === identity.fingerprint)) {
    const have = stored.map((l) =>
      `${l.summary} (fingerprint ${l.fingerprint}, ${l.blocks} blocks)`
    ).join("; ");
    throw new Error(
      `namespace "${inst.namespace}" is stored on ${stored[0].where} with layout ${have}; ` +
        `this instance offers ${identity.summary} (fingerprint ${identity.fingerprint}); one layout per ` +
        `namespace: use a namespace per layout, or start the server with --ssd-reset`,
    );
  }
  ctx.store.defineNamespace(inst.namespace, block);
  ctx.log.info("topology sealed", {
    instance: inst.id,
    namespace: inst.namespace,
    layers: inst.layerNames.length,
    world_size: inst.worldSize,
    kv_shared_across_tp: layout.kvSharedAcrossTp,
  });
}
