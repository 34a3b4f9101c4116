/**
 * Transfer locks: pin whichever of a list of blocks are sealed here, with a
 * TTL, so another reader (the SSD writer; a peer's one-sided read, lib/peer/)
 * can copy their bytes out of the pool while eviction keeps its hands off. A
 * lock is a lease with one consumer. The lock carries each block's recorded
 * checksum, which the peer that reads the bytes verifies.
 *
 * @module
 */

import type { BlockHash } from "./keys.ts";
import type { LeaseId } from "./lease.ts";
import { sealedSubset } from "./lookup.ts";
import { checkRequest, type StoreState } from "./state.ts";

/** A transfer lock: pins any sealed subset of the asked hashes. */
export interface TransferLock {
  readonly id: string;
  readonly idBytes: Uint8Array;
  readonly expiresAt: number;
  /** Indexes (into the asked hashes) of the blocks held and locked. */
  readonly found: Int32Array;
  /**
   * Every slot of every found block, column-major (lib/storage/offsets.ts):
   * `offsets[offsetColumn(layer, rankSlot, rankSlots, seg, segments) * found.length + i]`.
   */
  readonly offsets: Float64Array;
  readonly segmentBytes: number;
  /** Per found block, its recorded CRC32C, or NO_CHECKSUM (-1) when none was recorded yet. */
  readonly checksums: Float64Array;
}

/** Locks the sealed subset of `hashes` for `requester`; null when none is held. */
export function lockBlocks(
  st: StoreState,
  namespace: string,
  hashes: readonly BlockHash[],
  requester: string,
): TransferLock | null {
  checkRequest(hashes.length, { namespace, instance: requester });
  const ns = st.namespaces.get(namespace);
  if (!ns) return null;
  const { found, blocks } = sealedSubset(st, namespace, hashes);
  if (blocks.length === 0) return null;
  const lock = st.locks.create(requester, namespace, blocks, 1); // before the pins: no pin without a holder
  for (const b of blocks) st.pin(b);
  // A block record's offsets are already in column order: transpose to column-major.
  const cols = ns.layout.layers * ns.rankSlots * ns.layout.segments;
  const n = blocks.length;
  const offsets = new Float64Array(cols * n);
  const checksums = new Float64Array(n);
  for (let k = 0; k < n; k++) {
    const rec = blocks[k].offsets;
    for (let j = 0; j < cols; j++) offsets[j * n + k] = rec[j];
    checksums[k] = blocks[k].checksum;
  }
  return {
    id: lock.id,
    idBytes: lock.idBytes,
    expiresAt: lock.expiresAt,
    found: Int32Array.from(found),
    offsets,
    segmentBytes: ns.layout.segmentBytes,
    checksums,
  };
}

/**
 * Records CRC32Cs of sealed blocks (index-aligned with `hashes`); a block
 * no longer held, or not sealed, is skipped. Returns how many were recorded.
 */
export function recordBlockChecksums(
  st: StoreState,
  namespace: string,
  hashes: readonly BlockHash[],
  crcs: ArrayLike<number>,
): number {
  if (crcs.length !== hashes.length) {
    throw new RangeError(`${crcs.length} checksums for ${hashes.length} hashes`);
  }
  const ns = st.namespaces.get(namespace);
  if (!ns) return 0;
  const { found, blocks } = sealedSubset(st, namespace, hashes);
  for (let k = 0; k < blocks.length; k++) blocks[k].checksum = crcs[found[k]] >>> 0;
  return blocks.length;
}

/** Releases a transfer lock. Throws {@link LeaseError} when unknown or expired. */
export function unlockBlocks(st: StoreState, id: LeaseId): void {
  st.unpinLease(st.locks.release(id));
}
