/**
 * A Save request's checks, before anything is allocated: every layer it
 * names is the rank's and named once, its lists agree in length, every block
 * id is a block index of its layer, every hash is 1..64 bytes, and no id
 * comes twice under two hashes. The layers saving the same lists are grouped
 * (one store plan per group).
 *
 * @module
 */
import { MAX_HASH_BYTES } from "../limits.ts";
import { type ErrorFields, invalid } from "./errors.ts";
import { outOf } from "./geometry.ts";
import type { LayerCtx, RankCtx } from "./instances.ts";
import type { SaveArgs } from "./save.ts";
import { IdMarks } from "./id_marks.ts";

/** Layers saving the same (ids, hashes) lists: one store plan for all of them. */
export interface LayerGroup {
  ids: number[];
  hashes: Uint8Array[];
  layers: LayerCtx[];
  checkedFor: number;
}

/**
 * The Save's layers, grouped by identical (ids, hashes) lists — the normal
 * case, every layer saving the same blocks, is one group — after checking
 * every layer name, list length, block id and hash.
 */
export function groupLayers(
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
 * Throws INVALID_ARGUMENT naming the layer and block unless every id and hash is valid, and no
 * id comes twice under two hashes (its bytes would be stored under both, one of them wrong).
 */
function checkBlocks(
  who: string,
  fields: ErrorFields,
  ls: { layerName: string; blockIds: number[]; blockHashes: Uint8Array[] },
  numBlocks: number,
): void {
  const p = IdMarks.pass(numBlocks);
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
    const before = IdMarks.seen(id, p);
    if (before >= 0 && !sameBytes(ls.blockHashes[before], h)) {
      throw invalid(
        `${who} layer "${ls.layerName}": block id ${id} is listed twice (at ${before} and ${i}) under two different hashes`,
        { ...fields, blockId: id },
      );
    }
    IdMarks.mark(id, p, i);
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
