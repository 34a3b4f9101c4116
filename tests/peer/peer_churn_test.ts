/**
 * A node fetches prefix after prefix from another for as long as both live:
 * each fetch locks, reads, verifies, releases. Twenty of them, each loaded
 * and its lease given back, must leave nothing behind on either side: no
 * lock held, no pinned block, no fetch in flight, no descriptor more (the
 * transfer connection is made once and reused).
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

const FETCHES = 20;
const BLOCKS = 4;

Deno.test("twenty peer fetches leave no lock, pin, fetch or descriptor behind on either node", async () => {
  const c = await makeCluster(2, "churn");
  try {
    const a = await c.start(0);
    const b = await c.start(1);
    const probe = probeOf(c);
    const ns = uid("ns");
    const simA = await engineOn(c, a, ns, BLOCKS);
    const simB = await engineOn(c, b, ns, BLOCKS);
    const prefixes = Array.from({ length: FETCHES + 2 }, (_, i) => prefix(100 + i, BLOCKS));
    for (const hashes of prefixes) await savePrefix(simA, hashes);
    await waitFor(
      "every prefix is advertised and checksummed on A",
      async () =>
        (await probe.lookup(ns, prefixes.at(-1)!)).length === BLOCKS &&
        await metric(a, "pegaflow_peer_checksums_total", '{when="seal"}') ===
          prefixes.length * BLOCKS,
    );
    const fetchOne = async (i: number) => {
      const hashes = prefixes[i];
      const { answer, loading } = await pollQuery(simB, hashes, `churn-${i}`);
      assert.equal(loading, true, `fetch ${i}: a local miss with an owner answers loading first`);
      assert.equal(answer.hits, BLOCKS, `fetch ${i}`);
      await loadAndVerify(simB, hashes, answer.leaseId, BLOCKS);
    };
    // Two first: the transfer connection and the peer RPC socket are made here, once.
    await fetchOne(0);
    await fetchOne(1);
    const fdsA = await metric(a, "process_open_fds");
    const fdsB = await metric(b, "process_open_fds");
    for (let i = 2; i < prefixes.length; i++) await fetchOne(i);

    await waitFor(
      "every lock is released on A",
      async () =>
        await metric(a, "pegaflow_peer_locks_total", '{event="released"}') === prefixes.length,
    );
    assert.equal(
      await metric(a, "pegaflow_peer_locks_total", '{event="granted"}'),
      prefixes.length,
    );
    assert.equal(await metric(a, "pegaflow_peer_locks_held"), 0);
    assert.equal(await metric(a, "pegaflow_pinned_blocks"), 0);
    assert.equal(await metric(b, "pegaflow_pinned_blocks"), 0);
    assert.equal(await metric(b, "pegaflow_inflight_blocks"), 0);
    assert.equal(await metric(b, "pegaflow_peer_fetches_inflight"), 0);
    assert.equal(await metric(b, "pegaflow_peer_fetch_blocks_total"), prefixes.length * BLOCKS);
    assert.equal(await metric(b, "pegaflow_leases"), 0);
    const fdsA1 = await metric(a, "process_open_fds");
    const fdsB1 = await metric(b, "process_open_fds");
    assert.ok(fdsA1 <= fdsA + 2, `A's descriptors ${fdsA} -> ${fdsA1} over ${FETCHES} fetches`);
    assert.ok(fdsB1 <= fdsB + 2, `B's descriptors ${fdsB} -> ${fdsB1} over ${FETCHES} fetches`);
  } finally {
    await c.remove();
  }
});
