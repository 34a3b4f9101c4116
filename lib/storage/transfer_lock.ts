/**
 * Transfer locks: pin whichever of a list of blocks are sealed here, with a
 * TTL, so another reader (the SSD writer today; a peer's one-sided read in
 * the cross-node tier to come) can copy their bytes out of the pool while
 * eviction keeps its hands off. A lock is a lease with one consumer.
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
  for (const b of blocks) st.pin(b);
  const lock = st.locks.create(requester, namespace, blocks, 1);
  // A block record's offsets are already in column order: transpose to column-major.
  const cols = ns.layout.layers * ns.rankSlots * ns.layout.segments;
  const n = blocks.length;
  const offsets = new Float64Array(cols * n);
  for (let k = 0; k < n; k++) {
    const rec = blocks[k].offsets;
    for (let j = 0; j < cols; j++) offsets[j * n + k] = rec[j];
  }
  return {
    id: lock.id,
    idBytes: lock.idBytes,
    expiresAt: lock.expiresAt,
    found: Int32Array.from(found),
    offsets,
    segmentBytes: ns.layout.segmentBytes,
  };
}

/** Releases a transfer lock. Throws {@link LeaseError} when unknown or expired. */
export function unlockBlocks(st: StoreState, id: LeaseId): void {
  st.unpinLease(st.locks.release(id));
}
