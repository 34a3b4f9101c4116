/**
 * Blocks a requester reports damaged (docs/peer.md, "Damaged blocks"): its
 * READ landed them with another CRC32C than the lock answered, and its
 * release names them (`ReleaseTransferLockRequest.failed_blocks`). While the
 * lock still pins them, the owner checksums them again: bytes that changed
 * since the seal (a stray write, a reused range) would be served to every
 * other requester and to the owner's own engines, so such a block is
 * condemned — the lock table drops it from RAM and the tiers below, hence
 * from the index — at its first report; one that still matches is kept (the
 * damage was on the way or at the requester), logged. A report costs the
 * owner one checksum of the named blocks, never more than the lock holds.
 *
 * @module
 */

import type { RamExtents } from "../storage/tier.ts";
import type { Logger } from "../log.ts";
import { hashHex } from "../storage/keys.ts";
import type { ChecksumFn } from "./locks.ts";

/** What a release that reported damaged blocks did. */
export interface ReportedRelease {
  /** True when it ended a lock held here. */
  released: boolean;
  /** Reported blocks whose bytes here no longer match their checksum: dropped. */
  condemned: number;
}

/** A release's `failed_blocks` that do not name blocks of its lock (the lock is released all the same). */
export class BadReportError extends RangeError {}

/** The lock a report names, as the lock table holds it. */
export interface ReportedLock {
  /** The lock id in hex (logs). */
  readonly id: string;
  readonly requester: string;
  readonly namespace: string;
  readonly blocks: number;
  /** The locked prefix: hashes, pinned blocks and the checksums answered. */
  readonly hashes: readonly Uint8Array[];
  readonly pinned: readonly RamExtents[];
  readonly checksums: Uint32Array;
}

/**
 * Checks the reported blocks `failed` (indices into `l`'s prefix) against
 * the checksums `l` answered and returns those whose bytes changed here.
 * The caller holds `l`'s pin throughout. Throws {@link BadReportError} for
 * an index outside the lock or named twice, before any checksum.
 */
export async function checkReport(
  l: ReportedLock,
  failed: readonly number[],
  checksum: ChecksumFn,
  log: Logger,
): Promise<number[]> {
  const bad = reportError(failed, l);
  if (bad) throw new BadReportError(bad);
  const crcs = await checksum(Array.from(failed, (i) => l.pinned[i].extents));
  const condemned: number[] = [], kept: number[] = [], now: number[] = [];
  for (let j = 0; j < failed.length; j++) {
    if (crcs[j] === l.checksums[failed[j]]) kept.push(failed[j]);
    else (condemned.push(failed[j]), now.push(crcs[j]));
  }
  const ids = { requester: l.requester, lock: l.id, namespace: l.namespace };
  const hexes = (idx: number[]) => idx.map((i) => hashHex(l.hashes[i])).join(",");
  if (condemned.length > 0) {
    log.error("blocks a peer read with wrong checksums changed here since their seal: dropped", {
      ...ids,
      blocks: condemned.length,
      block_hashes: hexes(condemned),
      sealed_crcs: condemned.map((i) => l.checksums[i]).join(","),
      now_crcs: now.join(","),
    });
  }
  if (kept.length > 0) {
    log.warn(
      "blocks a peer read with wrong checksums still match here: kept " +
        "(damaged on the way or at the requester)",
      { ...ids, blocks: kept.length, block_hashes: hexes(kept) },
    );
  }
  return condemned;
}

/** Why `failed` cannot name blocks of lock `l`, or undefined. */
function reportError(failed: readonly number[], l: ReportedLock): string | undefined {
  const seen = new Set<number>();
  for (let j = 0; j < failed.length; j++) {
    const i = failed[j];
    if (!(Number.isInteger(i) && i >= 0 && i < l.blocks) || seen.has(i)) {
      const why = seen.has(i) ? "named twice" : `lock ${l.id} holds ${l.blocks} blocks`;
      return `ReleaseTransferLockRequest.failed_blocks[${j}] = ${i}: ${why}`;
    }
    seen.add(i);
  }
  return undefined;
}
