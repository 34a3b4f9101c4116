/**
 * Peer fetch failures across real server processes in network namespaces
 * (tests/peer/_cluster.ts), one real redis-server: the owner killed in the
 * middle of a read, the requester killed while holding a lock, Redis killed
 * and restarted, and an owner that no longer holds what the index says. A
 * failed fetch is a miss — never bytes — and leaves nothing behind. An owner
 * dead while the index still names it is passed over for the next owner.
 */

import assert from "node:assert/strict";
import type { ServerProc } from "../server/harness.ts";
import { uid } from "../server/harness.ts";
import { stopProcess } from "../xfer/_harness.ts";
import { makeCluster } from "./_cluster.ts";
import {
  assertClean,
  engineOn,
  loadAndVerify,
  metric,
  pollQuery,
  prefix,
  probeOf,
  savePrefix,
  waitFor,
} from "./_fetch.ts";

/**
 * How long a requester waits (test hook) between the owner's lock and its
 * READ: ample for the test to freeze or kill a node there, even on a loaded
 * machine (the test waits for the hook's log line, never for the time).
 */
const READ_DELAY_MS = "3000";

function logged(srv: ServerProc, text: string): () => boolean {
  return () => srv.logs().some((l) => l.includes(text));
}

/** SIGKILL (a stopped process dies as it is: no SIGCONT first, which would let it answer). */
function kill(srv: ServerProc): Promise<Deno.CommandStatus> {
  try {
    Deno.kill(srv.pid, "SIGKILL");
  } catch (_e) {
    // already gone
  }
  return srv.status;
}

Deno.test("the owner SIGKILLed in the middle of a read: the query ends as a miss, nothing dirty on the requester", async () => {
  const c = await makeCluster(2, "kA");
  try {
    const a = await c.start(0);
    // B pauses right before submitting its READ, so the test can freeze A first:
    // the READ is then certainly in flight when A dies.
    const b = await c.start(1, [], { PEGAFLOW_TEST_PEER_READ_DELAY_MS: READ_DELAY_MS });
    const probe = probeOf(c);
    const ns = uid("ns");
    const hashes = prefix(3, 16);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    await savePrefix(simA, hashes);
    await waitFor("advertised", async () => (await probe.lookup(ns, hashes)).length === 16);
    const q = pollQuery(simB, hashes, "q-kill");
    await waitFor("B holds A's lock and waits to read", logged(b, "delaying the peer read"));
    await stopProcess(a.pid);
    await waitFor("B submitted its READ to the frozen owner", logged(b, "peer read submitted"));
    await kill(a);
    const { answer, loading } = await q;
    assert.equal(loading, true);
    assert.equal(answer.hits, 0, "a fetch that lost its owner is a miss");
    const failed = await metric(b, "pegaflow_peer_fetch_failures_total", '{reason="transfer"}') +
      await metric(b, "pegaflow_peer_fetch_failures_total", '{reason="timeout"}');
    assert.equal(failed, 1);
    assert.equal(await metric(b, "pegaflow_peer_fetch_blocks_total"), 0);
    await assertClean(b, "requester after its owner died");
    // B still serves: its own saves and hits are untouched by the failed fetch.
    await savePrefix(simB, hashes.slice(0, 2));
    const own = await pollQuery(simB, hashes.slice(0, 2), "q-own");
    assert.equal(own.answer.hits, 2);
    await b.client.release(own.answer.leaseId);
  } finally {
    await c.remove();
  }
});

Deno.test("a lock whose requester vanished expires on the owner, and its blocks become evictable again", async () => {
  const c = await makeCluster(2, "kB");
  try {
    const a = await c.start(0);
    // B asks for a lock of its READ deadline + one RPC deadline (1 s + 2 s), then stalls.
    const b = await c.start(1, ["--peer-fetch-timeout-ms", "1000"], {
      PEGAFLOW_TEST_PEER_READ_DELAY_MS: "60000",
    });
    const probe = probeOf(c);
    const ns = uid("ns");
    const hashes = prefix(4, 8);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    await savePrefix(simA, hashes);
    await waitFor("advertised", async () => (await probe.lookup(ns, hashes)).length === 8);
    assert.equal((await simB.query(hashes, "q-vanish")).kind, "loading");
    await waitFor("B holds A's lock", logged(b, "delaying the peer read"));
    assert.equal(await metric(a, "pegaflow_peer_locks_held"), 1);
    assert.equal(await metric(a, "pegaflow_pinned_blocks"), 8);
    await kill(b);
    await waitFor(
      "the lock expired",
      async () => await metric(a, "pegaflow_peer_locks_held") === 0,
      15_000,
    );
    assert.equal(await metric(a, "pegaflow_peer_locks_total", '{event="timed_out"}'), 1);
    assert.equal(await metric(a, "pegaflow_peer_locks_total", '{event="released"}'), 0);
    assert.equal(await metric(a, "pegaflow_pinned_blocks"), 0);
    assert.ok(a.logs().some((l) => l.includes("peer transfer lock expired")));
    const res = await a.http_post("/cache/memory/cleanup");
    await res.body?.cancel();
    await assertClean(a, "owner after the lock expired and everything was evicted");
  } finally {
    await c.remove();
  }
});

Deno.test("Redis killed: a local miss stays a miss and both nodes serve locally; Redis back: the fetch works again", async () => {
  const c = await makeCluster(2, "kR");
  try {
    const a = await c.start(0);
    const b = await c.start(1);
    const ns = uid("ns");
    const hashes = prefix(5, 8);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    const before = probeOf(c, "probe-before");
    await savePrefix(simA, hashes);
    await waitFor("advertised", async () => (await before.lookup(ns, hashes)).length === 8);
    await c.redis.kill();

    const down = await pollQuery(simB, hashes, "q-down");
    assert.equal(down.answer.hits, 0, "no index: a miss, computed as without one");
    const local = await pollQuery(simA, hashes, "q-local");
    assert.equal(local.answer.hits, 8, "A serves its own blocks without Redis");
    await a.client.release(local.answer.leaseId);
    await assertClean(b, "requester while Redis is down");

    await c.redis.restart();
    const after = probeOf(c, "probe-after");
    await waitFor(
      "A re-advertised",
      async () => (await after.lookup(ns, hashes)).length === 8,
      15_000,
    );
    await waitFor(
      "B sees Redis again",
      async () => await metric(b, "pegaflow_index_redis_up") === 1,
      15_000,
    );
    const back = await pollQuery(simB, hashes, "q-back");
    assert.equal(back.answer.hits, 8);
    await loadAndVerify(simB, hashes, back.answer.leaseId, 8);
    let errors = 0;
    for (const op of ["advertise", "withdraw", "lookup", "heartbeat", "connect"]) {
      errors += await metric(b, "pegaflow_index_errors_total", `{op="${op}"}`);
    }
    assert.ok(errors >= 1, `B counted the outage: ${errors} index errors`);
  } finally {
    await c.remove();
  }
});

Deno.test("an owner that lost the blocks after the index named it (evicted between lookup and lock) answers a clean miss", async () => {
  const c = await makeCluster(2, "kE");
  try {
    const a = await c.start(0);
    const b = await c.start(1);
    const probe = probeOf(c);
    const ns = uid("ns");
    const hashes = prefix(6, 4);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    // The index still names A after A evicted: a stale entry, as after a lost
    // withdraw, a failover, or an eviction racing the requester's lookup.
    const stale = probeOf(c, "stale-entry", a.grpc);
    await savePrefix(simA, hashes);
    await waitFor("advertised", async () => (await probe.lookup(ns, hashes)).length === 4);
    // Redis may time a call out on a loaded machine (advertise answers false, counted): again.
    await waitFor("the stale entry advertised", () => stale.advertise(ns, hashes));
    const res = await a.http_post("/cache/memory/cleanup");
    await res.body?.cancel();
    await waitFor("A withdrew", async () => {
      const r = await probe.lookup(ns, hashes);
      return r.owners.length === 1 && r.owners[0].nodeId === "stale-entry";
    });
    const q = await pollQuery(simB, hashes, "q-stale");
    assert.equal(q.loading, true);
    assert.equal(q.answer.hits, 0);
    assert.equal(
      await metric(b, "pegaflow_peer_fetch_failures_total", '{reason="owner-miss"}'),
      1,
    );
    assert.equal(await metric(a, "pegaflow_peer_lock_misses_total", '{reason="not-held"}'), 1);
    assert.equal(await metric(a, "pegaflow_peer_locks_held"), 0);
    await assertClean(b, "requester after a stale index entry");
    await assertClean(a, "owner after refusing the lock");
  } finally {
    await c.remove();
  }
});

Deno.test("an owner SIGKILLed while the index still names it is passed over: the prefix comes byte-exact from the next owner", async () => {
  const c = await makeCluster(3, "kW");
  try {
    // A's index entries outlive it (as a dead node's do until its TTL): it stays named first.
    const a = await c.start(0, ["--index-node-ttl-ms", "600000"]);
    const b = await c.start(1);
    const owner2 = await c.start(2);
    const probe = probeOf(c);
    const ns = uid("ns");
    const hashes = prefix(9, 8);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    const simC = await engineOn(c, owner2, ns, 16);
    await savePrefix(simA, hashes);
    await savePrefix(simC, hashes);
    const both = async () => (await probe.lookup(ns, hashes)).owners.map((o) => o.nodeId).join();
    await waitFor("advertised by A and C", async () => await both() === "node-0,node-2");
    await kill(a);
    assert.equal(await both(), "node-0,node-2", "the dead owner is still named, first");
    const q = await pollQuery(simB, hashes, "q-dead-first");
    assert.equal(q.loading, true);
    assert.equal(q.answer.hits, 8, "fetched from the next owner, not a miss");
    await loadAndVerify(simB, hashes, q.answer.leaseId, 8);
    assert.equal(await metric(b, "pegaflow_peer_fetches_total", '{result="ok"}'), 1);
    let skipped = 0, failed = 0;
    for (const reason of ["connect", "lock-rpc", "owner-miss"]) {
      skipped += await metric(
        b,
        "pegaflow_peer_fetch_owners_skipped_total",
        `{reason="${reason}"}`,
      );
      failed += await metric(b, "pegaflow_peer_fetch_failures_total", `{reason="${reason}"}`);
    }
    assert.equal(skipped, 1, "A passed over once");
    assert.equal(failed, 0, "no failed fetch");
    const line = b.logs().find((l) => l.includes("passed over an owner")) ?? "(no line)";
    assert.ok(line.includes(`"owner":"node-0"`) && line.includes(':q-dead-first"'), line);
    assert.equal(await metric(owner2, "pegaflow_peer_locks_total", '{event="granted"}'), 1);
    assert.equal(await metric(owner2, "pegaflow_peer_locks_held"), 0);
  } finally {
    await c.remove();
  }
});

Deno.test("a READ that timed out never lands in the requester's pool, even once its space is reused (#403)", async () => {
  const c = await makeCluster(2, "kT");
  try {
    const a = await c.start(0);
    const b = await c.start(1, ["--peer-fetch-timeout-ms", "1500"], {
      PEGAFLOW_TEST_PEER_READ_DELAY_MS: READ_DELAY_MS,
    });
    const probe = probeOf(c);
    const ns = uid("ns");
    const lent = prefix(7, 16);
    const own = prefix(8, 16);
    const simA = await engineOn(c, a, ns, 16);
    const simB = await engineOn(c, b, ns, 16);
    await savePrefix(simA, lent);
    await waitFor("advertised", async () => (await probe.lookup(ns, lent)).length === 16);
    const q = pollQuery(simB, lent, "q-timeout");
    await waitFor("B holds A's lock and waits to read", logged(b, "delaying the peer read"));
    await stopProcess(a.pid); // frozen, not dead: its answer will come, late
    const { answer } = await q;
    assert.equal(answer.hits, 0);
    assert.equal(await metric(b, "pegaflow_peer_fetch_failures_total", '{reason="timeout"}'), 1);
    await assertClean(b, "requester after its READ timed out");
    // B's pool is empty again: its own save is placed where the timed-out fetch had planned.
    // Then A wakes and sends its answer to the READ that already ended.
    await savePrefix(simB, own);
    Deno.kill(a.pid, "SIGCONT");
    await waitFor(
      "the late answer arrived and was discarded",
      async () => await metric(b, "pegaflow_transfer_late_bytes_total") > 0,
      15_000,
    );
    const mine = await pollQuery(simB, own, "q-own");
    assert.equal(mine.answer.hits, 16);
    await loadAndVerify(simB, own, mine.answer.leaseId, 16);
    assert.equal(await metric(b, "pegaflow_peer_fetch_blocks_total"), 0);
  } finally {
    await c.remove();
  }
});
