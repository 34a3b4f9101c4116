/**
 * Owners a requester meets again after they changed, across real server
 * processes in network namespaces (tests/peer/_cluster.ts), one real
 * redis-server: an owner restarted under the same --node-id and ports (its
 * old transfer connection broke while idle; what it held before is no
 * longer named by the index), and an owner whose engine cuts the same
 * namespace's blocks another way (its blocks are never loaded; both nodes
 * log it, naming both layouts).
 *
 * Found by this file: the first fetch after an owner restarted reused the
 * broken transfer connection — the owner locked, the READ was refused
 * (`transfer`), the query a miss, every owner restart. And a layout
 * mismatch was logged at debug only: no node said why it never shared.
 */

import assert from "node:assert/strict";
import { hostSim, uid } from "../server/harness.ts";
import { makeCluster } from "./_cluster.ts";
import {
  assertClean,
  engineOn,
  loadAndVerify,
  metric,
  MODEL,
  pollQuery,
  prefix,
  probeOf,
  savePrefix,
  waitFor,
} from "./_fetch.ts";
import type { ServerProc } from "../server/harness.ts";

const REASONS = ["owner-miss", "bad-answer", "transfer", "lock-rpc", "connect", "timeout"];

async function failures(srv: ServerProc): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  for (const r of REASONS) {
    const n = await metric(srv, "pegaflow_peer_fetch_failures_total", `{reason="${r}"}`);
    if (n > 0) out[r] = n;
  }
  return out;
}

/** Log lines of `srv` at `level` that contain every one of `parts`. */
function logLines(srv: ServerProc, level: string, ...parts: string[]): string[] {
  return srv.logs().filter((l) =>
    l.includes(`"level":"${level}"`) && parts.every((p) => l.includes(p))
  );
}

Deno.test("an owner restarted under the same node id and ports: the next fetch from it succeeds at once, its old entries are gone", async () => {
  const c = await makeCluster(2, "rS");
  try {
    // Fixed ports, as deployed: the restarted owner is at the very same addresses.
    const ports = ["--addr", `${c.nodeAddr(0)}:50055`, "--xfer-port", "50056"];
    let a = await c.start(0, [...ports, "--peer-rpc-port", "50057"]);
    const b = await c.start(1);
    const probe = probeOf(c);
    const ns = uid("ns");
    const first = prefix(11, 4), never = prefix(12, 4), after = prefix(13, 4);
    let simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    await savePrefix(simA, first);
    await savePrefix(simA, never);
    await waitFor("advertised", async () => (await probe.lookup(ns, never)).length === 4);
    const q1 = await pollQuery(simB, first, "q-before");
    assert.equal(q1.answer.hits, 4);
    await b.client.release(q1.answer.leaseId);

    // A dies (its transfer sockets to B close) and comes back empty under the same id and ports.
    Deno.kill(a.pid, "SIGKILL");
    await a.status;
    a = await c.start(0, [...ports, "--peer-rpc-port", "50057"]);
    simA = await engineOn(c, a, ns, 16);
    await savePrefix(simA, after);
    await waitFor("re-joined", async () => (await probe.lookup(ns, after)).length === 4);
    // What A held before its restart is no longer named (its old incarnation is void).
    assert.equal((await probe.lookup(ns, never)).length, 0);

    const q2 = await pollQuery(simB, after, "q-after-restart");
    assert.equal(q2.answer.hits, 4, "the first fetch after the owner's restart loads");
    await loadAndVerify(simB, after, q2.answer.leaseId, 4);
    assert.deepEqual(await failures(b), {});
    assert.equal(await metric(b, "pegaflow_peer_fetch_blocks_total"), 8);
    assert.ok(
      logLines(b, "info", "broke while idle", "10.").length >= 1 || c.mode === "loopback",
      "the reconnect is logged naming the owner",
    );

    // A block only A's previous life held: a clean miss on B.
    const q3 = await pollQuery(simB, never, "q-never");
    assert.equal(q3.answer.hits, 0);
    await waitFor(
      "A's locks all released",
      async () => await metric(a, "pegaflow_peer_locks_held") === 0,
    );
    assert.equal(await metric(a, "pegaflow_pinned_blocks"), 0);
    assert.equal(await metric(b, "pegaflow_peer_fetches_inflight"), 0);
  } finally {
    await c.remove();
  }
});

Deno.test("same namespace, another KV layout: the owner lends nothing, both nodes log it naming both layouts, nothing lands", async () => {
  const c = await makeCluster(2, "rL");
  try {
    const a = await c.start(0);
    const b = await c.start(1);
    const probe = probeOf(c);
    const ns = uid("ns");
    const hashes = prefix(14, 4);
    const simA = await engineOn(c, a, ns, 16);
    // B: twice the layers, half the KV heads: the same bytes per block, cut another way.
    const simB = hostSim(b, {
      instanceId: uid("inst"),
      namespace: ns,
      model: { ...MODEL, numLayers: 4, kvHeads: 4 },
      numBlocks: 16,
    });
    c.defer(() => simB.close());
    await simB.register();
    await savePrefix(simA, hashes);
    await waitFor("advertised", async () => (await probe.lookup(ns, hashes)).length === 4);

    for (const id of ["q-layout-1", "q-layout-2"]) {
      const q = await pollQuery(simB, hashes, id);
      assert.equal(q.answer.hits, 0, "another layout's bytes are never loaded");
    }
    assert.deepEqual(await failures(b), { "owner-miss": 2 });
    assert.equal(await metric(a, "pegaflow_peer_lock_misses_total", '{reason="other-layout"}'), 2);
    assert.equal(await metric(a, "pegaflow_peer_locks_held"), 0);
    assert.equal(await metric(a, "pegaflow_pinned_blocks"), 0);
    assert.equal(await metric(b, "pegaflow_peer_fetch_blocks_total"), 0);

    // The requester says it, once, naming the owner, its address, the namespace, the request
    // and its own layout; the owner says it, once, naming the requester and both layouts.
    const onB = logLines(b, "warn", "another KV layout", ns, '"owner":"node-0"');
    assert.equal(onB.length, 1, onB.join("\n"));
    const wB = JSON.parse(onB[0]);
    assert.match(wB.request, /:q-layout-1$/, "the request, by its instance and id");
    assert.match(wB.addr, /:\d+$/);
    assert.match(wB.layout, /^[0-9a-f]{32}$/);
    assert.match(wB.layout_summary, /4 layers/);
    const onA = logLines(a, "warn", "another KV layout", ns, '"requester":"node-1"');
    assert.equal(onA.length, 1, onA.join("\n"));
    const wA = JSON.parse(onA[0]);
    assert.equal(wA.requester_layout, wB.layout);
    assert.match(wA.layout, /^[0-9a-f]{32}$/);
    assert.notEqual(wA.layout, wB.layout);
    assert.match(wA.layout_summary, /2 layers/);

    await assertClean(b, "requester after two refused fetches");
  } finally {
    await c.remove();
  }
});
