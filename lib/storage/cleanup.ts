/**
 * Collection: leases, transfer locks and discard tombstones past their TTL, inflight blocks
 * older than the inflight TTL with no copy in flight, and everything an
 * instance that went away still held. A slot under an in-flight copy is
 * never freed here (`pending > 0`): every plan is completed exactly once.
 *
 * @module
 */

import type { Block } from "./block.ts";
import { dropInflight } from "./eviction.ts";
import type { StoreState } from "./state.ts";

/** Expires leases and locks, collects stale inflight blocks (see {@link KvStore.collect}). */
export function collectExpired(st: StoreState): { leasesExpired: number; staleFreed: number } {
  const leases = st.leases.expire();
  const locks = st.locks.expire();
  if (st.tombstones.size > 0) st.tombstones.sweep(st.clock());
  st.c.leasesExpired += leases.length;
  const cutoff = st.clock() - st.inflightTtlMs;
  const stale: Block[] = [];
  for (const b of st.index.inflight()) {
    if (b.createdAt > cutoff) break; // creation order: the rest are younger
    if (b.pending === 0) stale.push(b);
  }
  for (const b of stale) dropInflight(st, b);
  st.c.staleCollected += stale.length;
  // Last: a doomed block's eviction calls onEvict (discard.ts), and a throw must leave
  // nothing above undone (every lease is unpinned all the same).
  st.unpinLeases(leases);
  st.unpinLeases(locks);
  return { leasesExpired: leases.length, staleFreed: stale.length };
}

/** Releases what `instance` held (see {@link KvStore.dropInstance}). */
export function dropInstanceState(
  st: StoreState,
  instance: string,
): { leases: number; inflightFreed: number } {
  const leases = [...st.leases.dropInstance(instance), ...st.locks.dropInstance(instance)];
  const victims: Block[] = [];
  for (const b of st.index.inflight()) {
    if (b.pending === 0 && b.lastWriter === instance) victims.push(b);
  }
  for (const b of victims) dropInflight(st, b);
  st.unpinLeases(leases); // last, as in collectExpired
  return { leases: leases.length, inflightFreed: victims.length };
}
