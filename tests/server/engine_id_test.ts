/**
 * One instance, one engine: every rank of an instance registers with the engine_id of the
 * engine it belongs to. A rank of another engine (another engine_id under the same instance
 * id) is refused FAILED_PRECONDITION naming the instance, the rank and both engine ids, even
 * for a rank the instance has not registered yet, and the instance is left as it was; the
 * engine's own ranks join and round-trip in their own memory. So is another engine's Save,
 * QueryPrefetch (with or without load_into) and Load: its scheduler side registers nothing,
 * and its loads would land in the instance's memory (the first engine's) at its own block
 * ids. An empty engine_id (a client that predates the field) is not checked.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { LLAMA_3_1_8B, type SimEngine } from "../../lib/client/sim_engine.ts";
import { STATE_REJECTED } from "../../lib/engine/load_state.ts";
import {
  hostSim,
  metricBecomes,
  refusedWith,
  type ServerProc,
  shmMappings,
  startServer,
  uid,
} from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };

/** What /instances says about `id` (undefined when it is not registered). */
async function described(srv: ServerProc, id: string) {
  const j = await (await srv.http_get("/instances")).json();
  return (j.instances as {
    instanceId: string;
    engineId: string;
    ranksRegistered: number;
    sealed: boolean;
  }[]).find((i) => i.instanceId === id);
}

/** How many of `sim`'s regions the server process has mapped (/proc/<pid>/maps). */
function mapped(srv: ServerProc, sim: SimEngine): number {
  return sim.regions.filter((region) => {
    const name = new TextDecoder().decode(region.handle).replace(/\0+$/, "");
    return shmMappings(srv.pid, name.slice(1)).some((l) =>
      l.endsWith(`/dev/shm${name}`) || l.endsWith(`/dev/shm${name} (deleted)`)
    );
  }).length;
}

/** Rank `tpRank` of a TP 2 instance on the host backend. */
function rank(srv: ServerProc, instanceId: string, tpRank: number, engineId?: string): SimEngine {
  return hostSim(srv, {
    instanceId,
    namespace: `ns-${instanceId}`,
    model: MODEL,
    numBlocks: 16,
    tpRank,
    tpSize: 2,
    engineId,
  });
}

Deno.test("a rank of another engine id is refused naming both ids; the engine's own ranks join and round-trip", async () => {
  const srv = await startServer();
  const instanceId = uid("eng");
  const [a, b] = [crypto.randomUUID(), crypto.randomUUID()];
  const r0 = rank(srv, instanceId, 0, a);
  const r1 = rank(srv, instanceId, 1, a);
  const intruder = rank(srv, instanceId, 1, b);
  const hashes = chainedBlockHashes(syntheticTokens(11, 16 * 4), 16);
  try {
    assert.equal((await r0.register()).ranksRegistered, 1);
    const other = new RegExp(
      `instance "${instanceId}" tp_rank 1 pp_rank 0: instance "${instanceId}" is registered by ` +
        `another engine \\(its engine_id "${a}", this rank's "${b}"\\)`,
    );
    // Rank 1 is not registered yet: before, the intruder became rank 1 of the engine's instance.
    await assert.rejects(intruder.register(), refusedWith("FAILED_PRECONDITION", other));
    const line = JSON.parse(srv.logs().find((l) => l.includes("this rank's"))!);
    assert.deepEqual([line.instance, line.tp_rank, line.expected, line.got], [instanceId, 1, a, b]);
    // Nothing about the instance changed: one rank, not sealed, the intruder's regions unmapped.
    const desc = await described(srv, instanceId);
    assert.deepEqual([desc?.engineId, desc?.ranksRegistered, desc?.sealed], [a, 1, false]);
    assert.equal(mapped(srv, r0), r0.regions.length, "the server maps the engine's rank 0");
    assert.equal(mapped(srv, intruder), 0, "and none of the intruder's regions");

    // The engine's own rank 1 joins and seals; the intruder is refused again (now a held rank).
    assert.equal((await r1.register()).topologySealed, true);
    await assert.rejects(intruder.register(), refusedWith("FAILED_PRECONDITION", other));
    await assert.rejects(r0.register(), refusedWith("ALREADY_EXISTS", /already registered/));
    const ids = [0, 1, 2, 3];
    for (const r of [r0, r1]) r.fill(ids, hashes);
    for (const r of [r0, r1]) assert.equal((await r.save(ids, hashes)).blocksSaved, 4);
    const q = await r0.query(hashes, "after-refusal");
    assert.ok(q.kind === "ready" && q.hits === 4, JSON.stringify(q));
    if (q.kind !== "ready") return;
    for (const r of [r0, r1]) await r.load(q.leaseId, [8, 9, 10, 11]);
    for (const r of [r0, r1]) assert.equal(r.verify([8, 9, 10, 11], hashes).badSegments, 0);
    const untouched = intruder.verify([8, 9, 10, 11], hashes).badSegments;
    assert.equal(untouched, 4 * 2 * 4, "nothing was loaded into the intruder's memory");

    // Once the instance is gone, another engine id registers it.
    await srv.client.unregisterContext(instanceId);
    assert.equal((await intruder.register()).ranksRegistered, 1);
    assert.equal((await described(srv, instanceId))?.engineId, b);
  } finally {
    for (const r of [r0, r1, intruder]) r.close();
    await srv.stop();
  }
});

Deno.test("empty engine ids are not checked: ranks without one join, with or beside an engine id", async () => {
  const srv = await startServer();
  const old = uid("old");
  const mixed = uid("mixed");
  const a = crypto.randomUUID();
  const sims = [rank(srv, old, 0), rank(srv, old, 1), rank(srv, mixed, 0, a), rank(srv, mixed, 1)];
  try {
    await sims[0].register();
    assert.equal((await sims[1].register()).topologySealed, true);
    assert.equal((await described(srv, old))?.engineId, "");
    await sims[2].register();
    assert.equal((await sims[3].register()).topologySealed, true, "an empty id is not checked");
    assert.equal((await described(srv, mixed))?.engineId, a);
    // An instance registered without an engine id is refused to a rank that names one.
    await srv.client.unregisterContext(mixed);
    await sims[3].register();
    await assert.rejects(
      sims[2].register(),
      refusedWith("FAILED_PRECONDITION", /its engine_id none \(a client that sends no engine_id\)/),
    );
  } finally {
    for (const s of sims) s.close();
    await srv.stop();
  }
});

Deno.test("an engine id over 256 characters is refused naming the field, registering nothing", async () => {
  const srv = await startServer();
  const instanceId = uid("long");
  const sim = rank(srv, instanceId, 0, "e".repeat(257));
  try {
    await assert.rejects(
      sim.register(),
      refusedWith(
        "INVALID_ARGUMENT",
        /tp_rank 0 pp_rank 0: engine_id is 257 characters, at most 256/,
      ),
    );
    assert.equal(await described(srv, instanceId), undefined);
    assert.equal((await sim.register({ engineId: "e".repeat(256) })).ranksRegistered, 1);
  } finally {
    sim.close();
    await srv.stop();
  }
});

/** "… is registered by another engine (its engine_id "a", this request's "b")", after `who`. */
function otherEngine(who: string, instanceId: string, a: string, b: string): RegExp {
  const esc = (t: string) => t.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  return new RegExp(
    `^${esc(who)}: instance "${instanceId}" is registered by another engine \\(its ` +
      `engine_id "${a}", this request's "${b}"\\); an engine's requests carry the engine_id ` +
      `its ranks registered with`,
  );
}

/** The last "rpc refused" log line of `method`, parsed. */
function refusedLine(srv: ServerProc, method: string) {
  return srv.logs().map((l) => {
    try {
      return JSON.parse(l);
    } catch {
      return undefined;
    }
  }).filter((j) => j?.msg === "rpc refused" && j.method === method).at(-1);
}

Deno.test("another engine's QueryPrefetch, Load and Save are refused naming both ids; nothing is leased, loaded or saved", async () => {
  const srv = await startServer();
  const instanceId = uid("req");
  const [a, b] = [crypto.randomUUID(), crypto.randomUUID()];
  const [r0, r1] = [0, 1].map((tp) => rank(srv, instanceId, tp, a));
  // The other engine's ranks: never registered (they would be refused), their requests sent anyway.
  const [i0, i1] = [0, 1].map((tp) => rank(srv, instanceId, tp, b));
  const states = [LoadState.create(), LoadState.create()];
  const hashes = chainedBlockHashes(syntheticTokens(12, 16 * 4), 16);
  const ids = [0, 1, 2, 3];
  const targets = [8, 9, 10, 11];
  const untouched = 4 * 2 * 4; // every segment of the 4 target blocks differs from the content
  try {
    for (const r of [r0, r1]) await r.register();
    for (const r of [r0, r1]) r.fill(ids, hashes);
    for (const r of [r0, r1]) assert.equal((await r.save(ids, hashes)).blocksSaved, 4);
    for (const r of [r0, r1]) r.clear(targets);

    // Query and load, as the other engine's scheduler (load_issuer "query") sends it.
    const queryLoad = srv.client.queryPrefetch({
      instanceId,
      blockHashes: hashes,
      requestId: "b-ql",
      engineId: b,
      loadInto: {
        blockIds: targets,
        ranks: [0, 1].map((tpRank) => ({ tpRank, ppRank: 0, loadStateShm: states[tpRank].name })),
      },
    });
    const who = `QueryPrefetch (request "b-ql")`;
    await assert.rejects(
      queryLoad,
      refusedWith("FAILED_PRECONDITION", otherEngine(who, instanceId, a, b)),
    );
    const line = refusedLine(srv, "QueryPrefetch");
    assert.deepEqual([line.instance, line.request, line.expected, line.got], [
      instanceId,
      "b-ql",
      a,
      b,
    ]);
    // A plain query of the other engine (load_issuer "worker" / "scheduler") too.
    await assert.rejects(
      i0.query(hashes, "b-q"),
      refusedWith(
        "FAILED_PRECONDITION",
        otherEngine(`QueryPrefetch (request "b-q")`, instanceId, a, b),
      ),
    );
    assert.equal(await srv.metric("pegaflow_leases"), 0, "no lease was taken for the other engine");
    assert.equal(await srv.metric("pegaflow_pinned_blocks"), 0);
    for (const st of states) {
      assert.equal(st.snapshot().state, 0, "its load states were not opened");
    }

    // A Load of the other engine with a lease that is live (the engine's own query's).
    const q = await r0.query(hashes, "a-q");
    assert.ok(q.kind === "ready" && q.hits === 4, JSON.stringify(q));
    if (q.kind !== "ready") return;
    const load = srv.client.load({
      instanceId,
      tpRank: 0,
      ppRank: 0,
      leaseId: q.leaseId,
      blockIds: targets,
      loadStateShm: states[0].name,
      requestId: "b-load",
      engineId: b,
    });
    await assert.rejects(
      load,
      refusedWith(
        "FAILED_PRECONDITION",
        otherEngine(`Load (tp_rank 0 pp_rank 0, request "b-load")`, instanceId, a, b),
      ),
    );
    // As any refused Load: its (the caller's) load state is marked failed, the lease is untouched.
    assert.equal(states[0].snapshot().state, STATE_REJECTED);
    await assert.rejects(
      i1.load(q.leaseId, targets),
      refusedWith(
        "FAILED_PRECONDITION",
        otherEngine(`Load (tp_rank 1 pp_rank 0)`, instanceId, a, b),
      ),
    );
    for (const r of [r0, r1]) {
      assert.equal(
        r.verify(targets, hashes).badSegments,
        untouched,
        "nothing landed in its blocks",
      );
    }
    // The engine's own Loads spend the lease, whole.
    for (const r of [r0, r1]) await r.load(q.leaseId, targets);
    for (const r of [r0, r1]) assert.equal(r.verify(targets, hashes).badSegments, 0);
    await metricBecomes(srv, "pegaflow_leases", 0);

    // A Save of the other engine: refused before anything is gathered or stored.
    const fresh = chainedBlockHashes(syntheticTokens(13, 16 * 2), 16);
    i0.fill([4, 5], fresh);
    await assert.rejects(
      i0.save([4, 5], fresh),
      refusedWith(
        "FAILED_PRECONDITION",
        otherEngine(`Save (tp_rank 0 pp_rank 0)`, instanceId, a, b),
      ),
    );
    const none = await r0.query(fresh, "a-fresh");
    assert.ok(none.kind === "ready" && none.hits === 0, "the other engine's Save stored nothing");

    // Requests without an engine id (a client that predates the field) are not checked.
    const anon = await srv.client.queryPrefetch({
      instanceId,
      blockHashes: hashes,
      requestId: "q0",
    });
    assert.ok(anon.kind === "ready" && anon.hits === 4);
    if (anon.kind !== "ready") return;
    for (const r of [r0, r1]) r.clear(targets);
    for (const [tpRank, r] of [r0, r1].entries()) {
      states[tpRank].rearm();
      await srv.client.load({
        instanceId,
        tpRank,
        ppRank: 0,
        leaseId: anon.leaseId,
        blockIds: targets,
        loadStateShm: states[tpRank].name,
      });
      assert.equal(await states[tpRank].waitAll(), 1);
      assert.equal(r.verify(targets, hashes).badSegments, 0);
    }
    r0.fill([4, 5], fresh);
    const saved = await srv.client.save({
      instanceId,
      tpRank: 0,
      ppRank: 0,
      blockIds: [4, 5],
      blockHashes: fresh,
    });
    assert.equal(saved.blocksSaved, 2);
    await metricBecomes(srv, "pegaflow_leases", 0);
  } finally {
    await srv.client.unregisterContext(instanceId).catch(() => {});
    for (const st of states) st.close();
    for (const r of [r0, r1, i0, i1]) r.close();
    await srv.stop();
  }
});

Deno.test("an instance registered without an engine id refuses a request that names one, as it refuses such a rank", async () => {
  const srv = await startServer();
  const instanceId = uid("anon");
  const sim = hostSim(srv, {
    instanceId,
    namespace: `ns-${instanceId}`,
    model: MODEL,
    numBlocks: 8,
  });
  const named = crypto.randomUUID();
  const hashes = chainedBlockHashes(syntheticTokens(14, 16 * 2), 16);
  try {
    await sim.register();
    sim.fill([0, 1], hashes);
    assert.equal((await sim.save([0, 1], hashes)).blocksSaved, 2);
    await assert.rejects(
      srv.client.queryPrefetch({
        instanceId,
        blockHashes: hashes,
        requestId: "n",
        engineId: named,
      }),
      refusedWith(
        "FAILED_PRECONDITION",
        /its engine_id none \(a client that sends no engine_id\), this request's "/,
      ),
    );
    const q = await sim.query(hashes, "own");
    assert.ok(q.kind === "ready" && q.hits === 2);
  } finally {
    await srv.client.unregisterContext(instanceId).catch(() => {});
    sim.close();
    await srv.stop();
  }
});
