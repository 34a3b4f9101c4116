/**
 * Peer fetch across real server processes, each in its own network
 * namespace (tests/peer/_cluster.ts), one real redis-server, TCP transport:
 * a prefix saved on one node is loaded by an engine on another, every byte
 * checked; with three nodes the longest owner serves and a fetched block is
 * served onwards.
 */

import assert from "node:assert/strict";
import { uid } from "../server/harness.ts";
import { makeCluster } from "./_cluster.ts";
import {
  engineOn,
  loadAndVerify,
  metric,
  pollQuery,
  prefix,
  probeOf,
  savePrefix,
  waitFor,
} from "./_fetch.ts";

Deno.test("a prefix saved on node A is loaded by an engine on node B, every byte verified", async () => {
  const c = await makeCluster(2, "f2");
  try {
    const a = await c.start(0);
    const b = await c.start(1);
    const probe = probeOf(c);
    const ns = uid("ns");
    const hashes = prefix(1, 8);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
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
    // The lock and its release went over A's peer RPC socket, not gRPC.
    assert.equal(await metric(b, "pegaflow_peer_lock_calls_total", '{via="rpc"}'), 2);
    assert.equal(await metric(b, "pegaflow_peer_lock_calls_total", '{via="grpc"}'), 0);
    assert.equal(await metric(a, "pegaflow_pinned_blocks"), 0);
    assert.equal(await metric(a, "pegaflow_peer_checksums_total", '{when="lock"}'), 0);
    console.log(`peer fetch over ${c.mode}${c.why ? ` (${c.why})` : ""}`);
  } finally {
    await c.remove();
  }
});

Deno.test("three nodes: B fetches from the longest owner, C completes its partial prefix from A or B", async () => {
  const c = await makeCluster(3, "f3");
  try {
    const [a, b, cc] = [await c.start(0), await c.start(1), await c.start(2)];
    const probe = probeOf(c);
    const ns = uid("ns");
    const hashes = prefix(2, 8);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    const simC = await engineOn(c, cc, ns, 16);
    await savePrefix(simA, hashes);
    await savePrefix(simC, hashes.slice(0, 4));
    await waitFor("both saves advertised", async () => {
      const r = await probe.lookup(ns, hashes);
      return r.owners.length === 2 && r.owners[0].length === 8;
    });
    const fromA = await pollQuery(simB, hashes, "q-b");
    assert.equal(fromA.answer.hits, 8);
    await loadAndVerify(simB, hashes, fromA.answer.leaseId, 8);
    assert.equal(await metric(a, "pegaflow_peer_locks_total", '{event="granted"}'), 1);
    assert.equal(await metric(cc, "pegaflow_peer_locks_total", '{event="granted"}'), 0);

    // C holds the first 4 in RAM; the other 4 come from a node holding the whole prefix.
    await waitFor(
      "B's fetched blocks advertised",
      async () =>
        (await probe.lookup(ns, hashes)).owners.filter((o) => o.length === 8).length === 2,
    );
    const fromPeer = await pollQuery(simC, hashes, "q-c");
    assert.equal(fromPeer.loading, true);
    assert.equal(fromPeer.answer.hits, 8);
    await loadAndVerify(simC, hashes, fromPeer.answer.leaseId, 8);
    assert.equal(await metric(cc, "pegaflow_peer_fetch_blocks_total"), 4);
    const granted = await metric(a, "pegaflow_peer_locks_total", '{event="granted"}') +
      await metric(b, "pegaflow_peer_locks_total", '{event="granted"}');
    assert.equal(granted, 2, "one lock for B's fetch, one for C's");
  } finally {
    await c.remove();
  }
});
