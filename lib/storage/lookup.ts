/**
 * Finding blocks: the longest sealed prefix of a query (pinned under a
 * lease on a hit), a single block's state, and the sealed subset of a hash
 * list (for a transfer lock). Lookups hash the engine's bytes into the
 * namespace's buckets; no hex or key string is built per hash.
 *
 * @module
 */

import { type Block, BlockIndex } from "./block.ts";
import { InvalidArgumentError } from "./errors.ts";
import { type BlockHash, hashBucket } from "./keys.ts";
import { checkRequest, type StoreState } from "./state.ts";

/** The answer to {@link KvStore.query}. */
export interface QueryResult {
  /** Length of the longest prefix of the hashes held sealed. */
  readonly hits: number;
  /** Present when hits > 0: pins those blocks until consumed by every rank, released or expired. */
  readonly lease?: {
    readonly id: string;
    readonly idBytes: Uint8Array;
    readonly expiresAt: number;
  };
}

/**
 * Longest prefix of `hashes` held sealed; a hit pins it under a lease that
 * each of `worldSize` ranks of `instance` consumes once. Every hash counts
 * as an access for admission, past the prefix too.
 */
export function queryPrefix(
  st: StoreState,
  namespace: string,
  hashes: readonly BlockHash[],
  instance: string,
  worldSize: number,
): QueryResult {
  checkRequest(hashes.length, { namespace, instance });
  if (!Number.isSafeInteger(worldSize) || worldSize < 1) {
    throw new InvalidArgumentError(`world size must be an integer ≥ 1`, {
      namespace,
      instance,
      got: worldSize,
    });
  }
  const hit: Block[] = [];
  const ns = st.namespaces.get(namespace);
  const buckets = st.index.buckets(namespace);
  // Every hash is validated (hashBucket throws on a malformed one) before any counts as
  // an access: a refused query changes nothing, the hashes before the bad one included.
  const bucketOf = bucketScratch(hashes.length);
  for (let i = 0; i < hashes.length; i++) bucketOf[i] = hashBucket(hashes[i], ns?.seed ?? 0);
  // Nothing was ever saved under an unknown namespace: nothing to count or find.
  for (let i = 0; ns && i < hashes.length; i++) {
    st.lfu?.record(bucketOf[i]);
    if (hit.length < i) continue; // prefix already broken: keep counting frequency
    const b = BlockIndex.findIn(buckets, hashes[i], bucketOf[i]);
    if (b && b.state === "sealed" && !b.discarded) hit.push(b);
  }
  // Counted once every hash was accepted: a malformed hash throws above, and is no query.
  st.c.queries++;
  st.c.hits += hit.length;
  st.c.misses += hashes.length - hit.length;
  if (hit.length === 0) return { hits: 0 };
  // The lease first (its id source may throw), then its pins: no pin without a holder.
  // No LRU touch: the pin takes each block out of the LRU and the last unpin
  // puts it back at the MRU end, which is where a touch would have moved it.
  const lease = st.leases.create(instance, namespace, hit, worldSize);
  for (const b of hit) st.pin(b);
  return {
    hits: hit.length,
    lease: { id: lease.id, idBytes: lease.idBytes, expiresAt: lease.expiresAt },
  };
}

/** A query's buckets, kept across queries (no allocation per query; one query runs at a time). */
let scratch = new Int32Array(0);

function bucketScratch(n: number): Int32Array {
  if (scratch.length < n) scratch = new Int32Array(Math.max(n, 2 * scratch.length));
  return scratch;
}

/**
 * State of one block: absent, inflight (not servable) or sealed. A sealed
 * block a discard doomed while pinned (discard.ts) is not servable: inflight.
 */
export function blockState(
  st: StoreState,
  namespace: string,
  hash: BlockHash,
): "absent" | "inflight" | "sealed" {
  const ns = st.namespaces.get(namespace);
  const bucket = hashBucket(hash, ns?.seed ?? 0);
  const b = ns && st.index.find(namespace, hash, bucket);
  if (!b) return "absent";
  return b.discarded ? "inflight" : b.state;
}

/** The sealed blocks among `hashes` (none a discard doomed), with their indexes in `hashes`. */
export function sealedSubset(
  st: StoreState,
  namespace: string,
  hashes: readonly BlockHash[],
): { found: number[]; blocks: Block[] } {
  const found: number[] = [];
  const blocks: Block[] = [];
  const ns = st.namespaces.get(namespace);
  if (!ns) return { found, blocks };
  for (let i = 0; i < hashes.length; i++) {
    const b = st.index.find(namespace, hashes[i], hashBucket(hashes[i], ns.seed));
    if (b?.state === "sealed" && !b.discarded) {
      found.push(i);
      blocks.push(b);
    }
  }
  return { found, blocks };
}
