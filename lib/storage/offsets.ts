/**
 * Where a slot's pool offset sits in an offset array: the one formula every
 * offset array of lib/storage follows (a block record's offsets, a save
 * plan's, a load ticket's runs, a transfer lock's).
 *
 * A block holds `layers × rankSlots` slots of `segments` items. The slot of
 * (layer, rank slot) is `layer * rankSlots + rankSlot`; its item `seg` is
 * column `slot * segments + seg`. A block record stores one offset per
 * column. A table over several blocks (plan, ticket, lock) is column-major —
 * `column * blockCount + block` — so one layer's K (or V) plane of all blocks
 * is contiguous and merges into long copy ranges.
 *
 * Plans and tickets index columns by their own lists (`li` into `layers`,
 * `ri` into `rankSlots`); a block record by the namespace's layer id and
 * rank slot. Same formula, different axes: call it with what you hold.
 *
 * @module
 */

/**
 * The slot of (layer, rank slot) in a block: its index in `Block.slots`.
 *
 * @example
 * ```ts
 * slotIndex(3, 1, 2); // layer 3, TP rank 1 of 2 → slot 7
 * ```
 */
export function slotIndex(layer: number, rankSlot: number, rankSlots: number): number {
  return layer * rankSlots + rankSlot;
}

/**
 * The column of item `seg` of slot number `slot` (from {@link slotIndex}).
 *
 * @example
 * ```ts
 * slotColumn(7, 1, 2); // V of slot 7 → column 15
 * ```
 */
export function slotColumn(slot: number, seg: number, segments: number): number {
  return slot * segments + seg;
}

/**
 * The column of item `seg` of slot (layer, rank slot): its index in a block
 * record's offsets, and the column of a plan, ticket or lock table.
 *
 * @example
 * ```ts
 * offsetColumn(3, 1, 2, 0, 2); // K of layer 3, TP rank 1 of 2 → column 14
 * ```
 */
export function offsetColumn(
  layer: number,
  rankSlot: number,
  rankSlots: number,
  seg: number,
  segments: number,
): number {
  return slotColumn(slotIndex(layer, rankSlot, rankSlots), seg, segments);
}

/** A column-major offset table over several blocks (a save plan, a fill, a ticket's offsets). */
export interface OffsetTable {
  /** `offsets[column * blockCount + block]`, NO_OFFSET (-1) where nothing is copied. */
  readonly offsets: Float64Array;
  readonly blockCount: number;
  readonly segments: number;
}

/**
 * The store's one accessor for a table's offsets: the index in `t.offsets`
 * of block `k` at (`li`, `ri`, `seg`), where `ri` indexes the table's rank
 * slots (`rankSlotCount` of them; 1 for an engine Save or a load ticket).
 * A batch builder calls it once per column and adds the block index.
 *
 * @example
 * ```ts
 * const base = offsetIndex(plan, li, 0, 1, 0);   // V of layer li, block 0
 * for (let k = 0; k < plan.blockCount; k++) use(plan.offsets[base + k]);
 * ```
 */
export function offsetIndex(
  t: OffsetTable,
  li: number,
  ri: number,
  seg: number,
  k: number,
  rankSlotCount = 1,
): number {
  return offsetColumn(li, ri, rankSlotCount, seg, t.segments) * t.blockCount + k;
}
