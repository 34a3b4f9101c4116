/**
 * Peer fetch across real server processes, each in its own network
 * namespace (tests/peer/_cluster.ts), one real redis-server, TCP transport:
 * a prefix saved on one node is loaded by an engine on another, every byte
 * checked; with three nodes the longest owner serves and a fetched block is
 * served onwards.
 */

import assert from "node:assert/strict";
import { RedisBlockIndex } from "../../lib/index/block_index.ts";
import { uid } from "../server/harness.ts";
import { makeCluster } from "./_cluster.ts";
import {
  assertClean,
  engineOn,
  loadAndVerify,
  metric,
  pollQuery,
  prefix,
  savePrefix,
  waitFor,
} from "./_fetch.ts";

Deno.test("a prefix saved on node A is loaded by an engine on node B, every byte verified", async () => {
  const c = await makeCluster(2, "f2");
  const a = await c.start(0);
  const b = await c.start(1);
  const probe = new RedisBlockIndex({
    url: c.redis.url,
    nodeId: "probe",
    advertiseAddr: "probe:1",
    listSealed: () => [],
  });
  probe.start();
  const ns = uid("ns");
  const hashes = prefix(1, 8);
  const simA = await engineOn(a, ns, 16);
  const simB = await engineOn(b, ns, 16);
  try {
    await savePrefix(simA, hashes);
    await waitFor(
      "A's save is advertised",
      async () => (await probe.lookup(ns, hashes)).length === 8,
    );
    // Checksums are recorded after the seal (write-behind): wait for them so the lock need not.
    await waitFor(
      "A recorded its checksums",
      async () => await metric(a, "pegaflow_peer_checksums_total", '{when="seal"}') === 8,
    );

    const { answer, loading } = await pollQuery(simB, hashes, "q-b-1");
    assert.equal(loading, true, "a local miss with an owner answers loading first");
    assert.equal(answer.hits, 8);
    await loadAndVerify(simB, hashes, answer.leaseId, 8);

    // The next query of the prefix is a RAM hit on B: no fetch.
    const again = await pollQuery(simB, hashes, "q-b-2");
    assert.equal(again.loading, false);
    assert.equal(again.answer.hits, 8);
    await b.client.release(again.answer.leaseId);

    assert.equal(await metric(b, "pegaflow_peer_fetch_blocks_total"), 8);
    assert.equal(await metric(b, "pegaflow_peer_fetch_bytes_total"), 8 * simB.blockBytes);
    assert.equal(await metric(b, "pegaflow_query_source_total", '{source="peer"}'), 1);
    assert.equal(await metric(b, "pegaflow_query_source_total", '{source="ram"}'), 1);
    assert.equal(await metric(b, "pegaflow_transfer_transport", '{transport="tcp"}'), 1);
    assert.equal(await metric(a, "pegaflow_peer_locks_total", '{event="granted"}'), 1);
    await waitFor(
      "the lock is released on A",
      async () => await metric(a, "pegaflow_peer_locks_total", '{event="released"}') === 1,
    );
    assert.equal(await metric(a, "pegaflow_peer_locks_held"), 0);
    assert.equal(await metric(a, "pegaflow_pinned_blocks"), 0);
    assert.equal(await metric(a, "pegaflow_peer_checksums_total", '{when="lock"}'), 0);
    console.log(`peer fetch over ${c.mode}${c.why ? ` (${c.why})` : ""}`);
  } finally {
    simA.close();
    simB.close();
    await probe.close();
    await a.stop();
    await b.stop();
    await c.remove();
  }
});
