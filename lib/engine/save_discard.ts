/**
 * A Save's `discard_hashes`: the hashes of blocks this rank computed over a
 * load that failed on it. With TP (or PP) the other ranks computed theirs
 * from the same garbage and may have saved it; the store drops or evicts
 * those blocks and refuses saves of the hashes for `DISCARD_TTL_MS`
 * (lib/storage/discard.ts). Applied when the Save arrives, before its own
 * blocks are queued: a save of another rank still queued plans after it.
 *
 * @module
 */
import { MAX_HASH_BYTES } from "../limits.ts";
import { MAX_HASHES_PER_REQUEST } from "../storage/store.ts";
import { discardEverywhere } from "../storage/lower_tiers.ts";
import type { EngineContext } from "./context.ts";
import { type ErrorFields, invalid } from "./errors.ts";
import type { Instance, RankCtx } from "./instances.ts";
import { checkRequestId, type SaveArgs } from "./save.ts";

/** True for a Save that carries discard hashes and no block of its own. */
export function discardOnly(args: SaveArgs): boolean {
  return (args.discardHashes?.length ?? 0) > 0 && args.layers.length === 0 &&
    (args.blockIds?.length ?? 0) === 0 && (args.blockHashes?.length ?? 0) === 0;
}

/**
 * Applies the Save's discard hashes, if any (every hash checked first: a bad
 * one is INVALID_ARGUMENT naming its index, and nothing is discarded).
 * Returns the blocks dropped or evicted; logs one line per discard.
 */
export function applyDiscards(
  ctx: EngineContext,
  inst: Instance,
  rank: RankCtx,
  args: SaveArgs,
): number {
  const hashes = args.discardHashes;
  if (!hashes || hashes.length === 0) return 0;
  const requestId = args.requestId || undefined;
  const who = `Save (instance "${inst.id}" tp_rank ${rank.tpRank} pp_rank ${rank.ppRank}` +
    (requestId ? `, request "${requestId}")` : ")");
  const fields: ErrorFields = {
    instance: inst.id,
    namespace: inst.namespace,
    tpRank: rank.tpRank,
    ppRank: rank.ppRank,
    requestId,
  };
  checkRequestId("Save", inst.id, args.requestId);
  if (hashes.length > MAX_HASHES_PER_REQUEST) {
    throw invalid(
      `${who}: ${hashes.length} discard_hashes; at most ${MAX_HASHES_PER_REQUEST} are accepted`,
      { ...fields, expected: MAX_HASHES_PER_REQUEST, got: hashes.length },
    );
  }
  for (let i = 0; i < hashes.length; i++) {
    const n = hashes[i].length;
    if (n < 1 || n > MAX_HASH_BYTES) {
      throw invalid(`${who}: discard_hashes[${i}] is ${n} bytes (1..${MAX_HASH_BYTES})`, {
        ...fields,
        expected: `1..${MAX_HASH_BYTES}`,
        got: n,
      });
    }
  }
  const { store: r, tierDropped } = discardEverywhere(ctx.store, ctx.tiers, {
    namespace: inst.namespace,
    instance: inst.id,
    rank: rank.tpRank,
    hashes,
  });
  ctx.log.warn("save discard: blocks computed over a failed load", {
    instance: inst.id,
    rank: rank.rank,
    tp_rank: rank.tpRank,
    pp_rank: rank.ppRank,
    namespace: inst.namespace,
    request: requestId,
    hashes: hashes.length,
    dropped: r.dropped,
    copies_cut: r.copiesCut,
    evicted: r.evicted,
    pinned_kept: r.pinnedKept,
    tombstones: r.tombstones,
    tier_dropped: tierDropped,
  });
  return r.dropped + r.evicted;
}
