/**
 * The one formula that turns a (tp_rank, pp_rank) pair into a rank index:
 * PP stages in order, TP ranks within a stage. The engine indexes an
 * instance's registered ranks by it (with the instance's TP size); the
 * server's session table by it (with {@link MAX_PARALLEL}, since a session
 * may open before its instance registers).
 *
 * @module
 */
import { MAX_PARALLEL } from "../limits.ts";

/**
 * The index of rank (`tpRank`, `ppRank`) among ranks of TP size `tpSize`.
 *
 * @example
 * ```ts
 * rankIndex(1, 2, 4); // 9: stage 2 starts at 8
 * ```
 */
export function rankIndex(tpRank: number, ppRank: number, tpSize: number): number {
  return ppRank * tpSize + tpRank;
}

/**
 * Why a (tp_rank, pp_rank) pair cannot name a rank of any instance, or
 * undefined when it can (both below {@link MAX_PARALLEL}).
 */
export function rankOutOfRange(tpRank: number, ppRank: number): string | undefined {
  if (tpRank >= MAX_PARALLEL) return `tp_rank ${tpRank} out of range 0..${MAX_PARALLEL - 1}`;
  if (ppRank >= MAX_PARALLEL) return `pp_rank ${ppRank} out of range 0..${MAX_PARALLEL - 1}`;
  return undefined;
}
