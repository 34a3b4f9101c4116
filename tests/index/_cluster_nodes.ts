/**
 * Index nodes on a test Redis Cluster (tests/index/_redis_cluster.ts), for the cluster tests:
 * block hashes of a chain, a started {@link RedisBlockIndex} on the cluster's seeds, and a guard
 * that an index call settles.
 */

import { RedisBlockIndex, type SealedBlock } from "../../lib/index/block_index.ts";
import { withinOrThrow } from "../../lib/timer_limit.ts";
import type { RedisCluster } from "./_redis_cluster.ts";

/** `n` distinct 32-byte block hashes of chain `seed`. */
export function hashes(n: number, seed: number): Uint8Array[] {
  return Array.from({ length: n }, (_, i) => {
    const h = new Uint8Array(32);
    new DataView(h.buffer).setUint32(0, seed * 1_000_003 + i);
    return h;
  });
}

/** Options of {@link clusterNode}. */
export interface ClusterNodeOptions {
  /** The blocks the node holds (what it re-advertises after an outage). Default: none. */
  held?: () => SealedBlock[];
  /** PEM of the CA that signed the nodes' certificates (a TLS cluster). */
  tlsCa?: string;
  nodeTtlMs: number;
  timeoutMs: number;
}

/** A started index node `nodeId` (address `<nodeId>.local:50055`) on cluster `c`. */
export function clusterNode(
  c: RedisCluster,
  nodeId: string,
  o: ClusterNodeOptions,
): RedisBlockIndex {
  const idx = new RedisBlockIndex({
    url: c.url,
    cluster: true,
    tlsCa: o.tlsCa,
    nodeId,
    advertiseAddr: `${nodeId}.local:50055`,
    listSealed: o.held ?? (() => []),
    nodeTtlMs: o.nodeTtlMs,
    timeoutMs: o.timeoutMs,
  });
  idx.start();
  return idx;
}

/** `p`, or an error naming `what` if it has not settled after `ms` (a hang, not a slow call). */
export function settles<T>(what: string, p: Promise<T>, ms: number): Promise<T> {
  return withinOrThrow(p, ms, () => new Error(`${what} hung past ${ms} ms`));
}
