/**
 * WaitPrefetch on a peer fetch across two real server processes (network
 * namespaces, tests/peer/_cluster.ts; one real redis-server): the engine on
 * node B, told "loading", waits instead of polling. While B's fetch is held
 * before its READ (test hook) a short wait answers false and the hold shows
 * in `pegaflow_prefetch_waits`; a long one answers true once the fetch ended,
 * and the one query after it hits every block, byte-exact.
 */
import assert from "node:assert/strict";
import { uid } from "../server/harness.ts";
import { makeCluster } from "./_cluster.ts";
import { engineOn, loadAndVerify, metric, prefix, probeOf, savePrefix, waitFor } from "./_fetch.ts";

/** B's pause between the owner's lock and its READ: the fetch is certainly running meanwhile. */
const READ_DELAY_MS = 1500;

Deno.test("an engine waits for a peer fetch with WaitPrefetch: held while it runs, answered when it ends, then one query hits", async () => {
  const c = await makeCluster(2, "kWt");
  try {
    const a = await c.start(0);
    const b = await c.start(1, [], { PEGAFLOW_TEST_PEER_READ_DELAY_MS: String(READ_DELAY_MS) });
    const probe = probeOf(c);
    const ns = uid("ns");
    const hashes = prefix(41, 8);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    await savePrefix(simA, hashes);
    await waitFor("advertised", async () => (await probe.lookup(ns, hashes)).length === 8);
    assert.equal((await simB.query(hashes, "q-wait")).kind, "loading");
    const ask = (waitMs: number) =>
      b.client.waitPrefetch({ instanceId: simB.instanceId, requestId: "q-wait", waitMs });
    const long = ask(60_000);
    await waitFor(
      "the hold is counted",
      async () => await metric(b, "pegaflow_prefetch_waits") === 1,
    );
    assert.equal(await ask(50), false, "a short hold passes while the fetch still runs");
    assert.equal(await long, true, "the long hold ends with the fetch");
    assert.equal(await metric(b, "pegaflow_prefetch_waits"), 0);
    const q = await simB.query(hashes, "q-wait");
    assert.equal(q.kind, "ready", "the query after the wait answers from RAM");
    if (q.kind !== "ready") return;
    assert.equal(q.hits, 8);
    await loadAndVerify(simB, hashes, q.leaseId, q.hits);
    assert.equal(
      await metric(b, "pegaflow_rpc_requests_total", '{method="WaitPrefetch",status="OK"}'),
      2,
    );
    await waitFor(
      "A's lock released",
      async () => await metric(a, "pegaflow_peer_locks_held") === 0,
    );
  } finally {
    await c.remove();
  }
});
