/**
 * A Load's target block ids, checked before the lease is spent: each is a
 * block index below every layer's num_blocks, and no id comes twice. Two
 * leased blocks scattered into one target land one over the other: the load
 * state read done while one block's KV was lost (and on the host backend the
 * two copies race, so the target could hold a mix of both).
 *
 * The duplicate check marks ids in lib/engine/id_marks.ts (no allocation per
 * block or per load).
 *
 * @module
 */
import { type ErrorFields, invalid } from "./errors.ts";
import { outOf } from "./geometry.ts";
import type { RankCtx } from "./instances.ts";
import { IdMarks } from "./id_marks.ts";

/**
 * Throws INVALID_ARGUMENT naming the layer, the block id and its positions
 * unless every target id is below every layer's num_blocks and none repeats.
 * Layers of one rank nearly always share num_blocks, and a pass against the
 * same bound would check nothing new.
 */
export function checkTargets(
  who: string,
  fields: ErrorFields,
  rank: RankCtx,
  ids: readonly number[],
): void {
  let checked = -1;
  for (const l of rank.layers) {
    const numBlocks = l.geometry.numBlocks;
    if (numBlocks === checked) continue;
    for (let i = 0; i < ids.length; i++) {
      if (!(ids[i] < numBlocks && ids[i] >= 0 && Number.isInteger(ids[i]))) {
        throw invalid(
          `${who} layer "${l.name}": target block id ${ids[i]} ${outOf(ids[i], numBlocks)}`,
          { ...fields, layer: l.name, blockId: ids[i], expected: `< ${numBlocks}`, got: ids[i] },
        );
      }
    }
    checked = numBlocks;
  }
  if (ids.length < 2) return;
  // Every id is now a block index of the first layer (and of every other).
  const p = IdMarks.pass(rank.layers[0].geometry.numBlocks);
  for (let i = 0; i < ids.length; i++) {
    const id = ids[i];
    const before = IdMarks.seen(id, p);
    if (before >= 0) {
      throw invalid(
        `${who}: target block id ${id} is named twice (targets ${before} and ${i}); ` +
          `each leased block needs a target of its own`,
        { ...fields, blockId: id },
      );
    }
    IdMarks.mark(id, p, i);
  }
}
