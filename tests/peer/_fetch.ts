/**
 * Test helpers of the peer-tier tests: an engine on a node, saving a prefix,
 * polling a query through "loading" to its answer, and reading a node's
 * metrics by label.
 */

import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import type { QueryResult } from "../../lib/client/client.ts";
import { LLAMA_3_1_8B, type SimEngine } from "../../lib/client/sim_engine.ts";
import { hostSim, type ServerProc, uid } from "../server/harness.ts";
import { waitFor } from "../index/_redis.ts";
import { RedisBlockIndex } from "../../lib/index/block_index.ts";
import type { Cluster } from "./_cluster.ts";

/** Two layers of Llama-3.1-8B: 128 KiB per block (2 layers × K/V × 32 KiB). */
export const MODEL = { ...LLAMA_3_1_8B, numLayers: 2 };
/** Most polls of one query (each 20 ms apart): far beyond a fetch's deadline. */
const MAX_POLLS = 1_500;

/** An engine of `namespace` on `srv`, registered; closed by the cluster's remove(). */
export async function engineOn(
  c: Cluster,
  srv: ServerProc,
  namespace: string,
  numBlocks: number,
): Promise<SimEngine> {
  const sim = hostSim(srv, { instanceId: uid("inst"), namespace, model: MODEL, numBlocks });
  c.defer(() => sim.close());
  await sim.register();
  return sim;
}

/** A client of the cluster's index (another node id), closed by the cluster's remove(). */
export function probeOf(c: Cluster, nodeId = "probe", addr = "probe:1"): RedisBlockIndex {
  const p = new RedisBlockIndex({
    url: c.redis.url,
    nodeId,
    advertiseAddr: addr,
    listSealed: () => [],
  });
  p.start();
  c.defer(() => p.close());
  return p;
}

/** `n` chained block hashes of a synthetic prompt. */
export function prefix(seed: number, n: number): Uint8Array[] {
  return chainedBlockHashes(syntheticTokens(seed, 16 * n), 16);
}

/** Fills blocks 0..n-1 with the content of `hashes` and saves them. */
export async function savePrefix(sim: SimEngine, hashes: Uint8Array[]): Promise<void> {
  const ids = hashes.map((_, i) => i);
  sim.fill(ids, hashes);
  await sim.save(ids, hashes);
}

/** Polls a query until it is answered; `loading` says whether any poll answered "loading". */
export async function pollQuery(
  sim: SimEngine,
  hashes: Uint8Array[],
  requestId: string,
): Promise<{ answer: Extract<QueryResult, { kind: "ready" }>; loading: boolean }> {
  let loading = false;
  for (let i = 0; i < MAX_POLLS; i++) {
    const q = await sim.query(hashes, requestId);
    if (q.kind === "ready") return { answer: q, loading };
    loading = true;
    await new Promise((r) => setTimeout(r, 20));
  }
  throw new Error(`query ${requestId} still loading after ${MAX_POLLS} polls`);
}

/** Loads the answer's lease into blocks 0..hits-1 (zeroed first) and checks every byte. */
export async function loadAndVerify(
  sim: SimEngine,
  hashes: Uint8Array[],
  leaseId: Uint8Array,
  hits: number,
): Promise<void> {
  const ids = Array.from({ length: hits }, (_, i) => i);
  sim.clear(ids);
  await sim.load(leaseId, ids);
  const v = sim.verify(ids, hashes.slice(0, hits));
  assert.equal(v.badSegments, 0, v.first ?? "");
}

/** A metric's value (0 when absent: a labelled counter not yet incremented). */
export async function metric(srv: ServerProc, name: string, labels = ""): Promise<number> {
  const v = await srv.metric(name, labels);
  return Number.isNaN(v) ? 0 : v;
}

/** Nothing dirty on a node: no block, no pin, no inflight slot, no pool byte in use. */
export async function assertClean(srv: ServerProc, who: string): Promise<void> {
  for (
    const m of [
      "pegaflow_pool_used_bytes",
      "pegaflow_cache_blocks",
      "pegaflow_inflight_blocks",
      "pegaflow_pinned_blocks",
    ]
  ) {
    assert.equal(await metric(srv, m), 0, `${who}: ${m}`);
  }
}

/** Polls a condition (never asserts on time itself); re-exported for the peer tests. */
export { waitFor };
