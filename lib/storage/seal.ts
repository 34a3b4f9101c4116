/**
 * Ending a save or fill: on success the copied slots become FILLED and
 * blocks whose every slot is filled are sealed (servable, in the LRU); on
 * failure the plan's slots return to EMPTY and their bytes are freed, and a
 * block left with nothing is dropped; a block a discard named while the copy
 * ran completes as failed whatever the copy did. Never half-written data.
 *
 * @module
 */

import { NO_OFFSET, SLOT_EMPTY, SLOT_FILLED } from "./block.ts";
import { StaleHandleError } from "./errors.ts";
import { slotColumn, slotIndex } from "./offsets.ts";
import type { PlanRecord, SavePlan } from "./save_plan.ts";
import type { StoreState } from "./state.ts";

/** What {@link KvStore.completeSave} did. */
export interface SaveCompletion {
  /** Blocks that became sealed (servable) by this save. */
  readonly sealed: number;
  /** Keys (`namespace:hash`) of those blocks. */
  readonly sealedKeys: readonly string[];
  /** Content hashes (hex) of those blocks, for SSD write-behind and the cross-node index. */
  readonly sealedHashes: readonly string[];
  /** Pool bytes freed (failed saves). */
  readonly freedBytes: number;
}

/**
 * Completes an open plan exactly once (see {@link KvStore.completeSave}).
 * `ok` is the outcome of every block, or per plan block (index k, plan order).
 */
export function completePlan(
  st: StoreState,
  plan: SavePlan,
  ok: boolean | ((block: number) => boolean),
): SaveCompletion {
  const p = plan as PlanRecord;
  if (!st.plans.has(p) || p.settled) {
    throw new StaleHandleError(`save plan was already completed or is not from this store`, {
      namespace: plan.namespace,
      instance: plan.instance,
    });
  }
  const n = p.blockCount;
  // Every block's outcome first: a predicate that throws leaves nothing half
  // completed; the plan then fails whole (slots freed) and the error goes on.
  let oks: Uint8Array | undefined;
  if (typeof ok === "function") {
    oks = new Uint8Array(n);
    try {
      for (let k = 0; k < n; k++) oks[k] = ok(k) ? 1 : 0;
    } catch (e) {
      completePlan(st, p, false);
      throw e;
    }
  }
  p.settled = true;
  st.plans.delete(p);
  st.inflightCopyBytes -= p.poolBytes;
  const S = p.segments;
  const R = p.rankSlots.length;
  const C = p.layers.length * R;
  const rankSlotsOf = st.namespaces.require(p.namespace).rankSlots;
  const sealedKeys: string[] = [];
  const sealedHashes: string[] = [];
  let freed = 0;
  for (let k = 0; k < n; k++) {
    const b = p.blocks[k];
    // A block discarded under the copy (lib/storage/discard.ts) never seals: its slots are freed.
    const blockOk = !b.discarded && (oks ? oks[k] === 1 : ok === true);
    for (let c = 0; c < C; c++) {
      if (p.offsets[slotColumn(c, 0, S) * n + k] === NO_OFFSET) continue;
      const si = slotIndex(p.layers[Math.floor(c / R)], p.rankSlots[c % R], rankSlotsOf);
      b.pending--;
      if (blockOk) {
        b.slots[si] = SLOT_FILLED;
        b.filled++;
      } else {
        b.slots[si] = SLOT_EMPTY;
        for (let seg = 0; seg < S; seg++) {
          const j = slotColumn(si, seg, S);
          st.allocator.free(b.offsets[j], p.segmentBytes);
          b.offsets[j] = NO_OFFSET;
          freed += st.allocator.strideOf(p.segmentBytes);
        }
      }
    }
    if (blockOk && b.filled === b.slotCount && b.state === "inflight") {
      st.index.seal(b);
      st.lru.insert(b, p.cacheClass);
      st.c.savedBlocks++;
      sealedKeys.push(b.key);
      sealedHashes.push(b.hash);
    } else if (!blockOk && b.filled === 0 && b.pending === 0) {
      st.index.remove(b);
      st.namespaces.recycle(b);
    }
  }
  return { sealed: sealedKeys.length, sealedKeys, sealedHashes, freedBytes: freed };
}
