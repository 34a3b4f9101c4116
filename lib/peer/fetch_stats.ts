/**
 * The peer tier's running totals (what lib/peer/metrics.ts exports) and the
 * failure count of one fetch: a fetch that fails at several steps — its
 * first part's READ refused, then its second lock refused, or the owner
 * dying under both — is ONE failed fetch, counted under the reason of its
 * first failure, so `pegaflow_peer_fetch_failures_total` never exceeds the
 * fetches started. (Checksum mismatches are counted per block, apart.) An
 * owner the fetch passed over for the next one (owner_walk.ts) is not the
 * fetch's failure: it is counted apart, by its reason, and the fetch counts
 * what happened at the owner it ended on (a success, or one failure). An
 * owner marked suspect (owner_walk.ts) is counted apart again, once per mark.
 *
 * @module
 */

import type { Logger } from "../log.ts";

/** Why a fetch brought nothing (or less than the owner locked). */
export type PeerFetchFailure =
  | "index-down"
  | "no-owner"
  | "owner-miss"
  | "lock-rpc"
  | "bad-answer"
  | "no-pool-space"
  | "connect"
  | "transfer"
  | "timeout"
  | "checksum";

/** Why a fetch passed over an owner for the next one the index names (owner_walk.ts). */
export type OwnerSkipReason = Extract<PeerFetchFailure, "connect" | "lock-rpc" | "owner-miss">;

/** Why an owner was marked suspect, asked after the healthy ones for a while (owner_walk.ts). */
export type OwnerSuspectReason = Extract<OwnerSkipReason, "connect" | "lock-rpc">;

/** Counters for /metrics. */
export interface PeerTierStats {
  fetches: number;
  /** Fetches that committed at least one block. */
  fetchesOk: number;
  /** Failed fetches by the reason of each one's first failure; `checksum`: blocks. */
  failures: Record<PeerFetchFailure, number>;
  /** Owners passed over for the next one, by the reason each failed (not fetch failures). */
  ownersSkipped: Record<OwnerSkipReason, number>;
  /** Owners marked suspect (healthy before), by the reason of the failure that marked them. */
  ownersSuspected: Record<OwnerSuspectReason, number>;
  blocks: number;
  bytes: number;
  /** Bytes and time of the READ batches that ended OK (the transport's own ns), for the wire rate. */
  readBytes: number;
  readSeconds: number;
  /** Checksums recorded after a seal (the checksum stage). */
  checksumsAtSeal: number;
  /** Seal batches the full checksum queue dropped (their checksums are computed at lock time). */
  checksumDropped: number;
  /** Fetches running now. */
  inflight: number;
}

/** The totals the tier itself keeps (the rest is read at scrape time). */
export type FetchTotals = Omit<PeerTierStats, "inflight" | "checksumsAtSeal" | "checksumDropped">;

/** Zeroed totals. */
export function fetchTotals(): FetchTotals {
  return {
    fetches: 0,
    fetchesOk: 0,
    failures: {
      "index-down": 0,
      "no-owner": 0,
      "owner-miss": 0,
      "lock-rpc": 0,
      "bad-answer": 0,
      "no-pool-space": 0,
      connect: 0,
      transfer: 0,
      timeout: 0,
      checksum: 0,
    },
    ownersSkipped: { connect: 0, "lock-rpc": 0, "owner-miss": 0 },
    ownersSuspected: { connect: 0, "lock-rpc": 0 },
    blocks: 0,
    bytes: 0,
    readBytes: 0,
    readSeconds: 0,
  };
}

/** Records one failure of a fetch; returns undefined so a step can `return fail(...)`. */
export type FailFn = (why: PeerFetchFailure, fields?: Record<string, string | number>) => undefined;

/**
 * The failure recorder of one fetch: every failure is logged with the
 * fetch's namespace and first block; only the first is counted.
 *
 * @example
 * ```ts
 * const fail = fetchFailures(totals, log, { namespace, first_block: hex });
 * if (!found.available) return fail("index-down");
 * ```
 */
export function fetchFailures(
  totals: FetchTotals,
  log: Logger,
  ids: Record<string, string>,
): FailFn {
  let counted = false;
  return (why, fields = {}) => {
    log.debug("peer fetch brought nothing", { reason: why, ...ids, ...fields });
    if (counted) return undefined;
    counted = true;
    totals.failures[why]++;
    return undefined;
  };
}
