/**
 * One instance, one engine: every rank of an instance registers with the engine_id of the
 * engine it belongs to. A rank of another engine (another engine_id under the same instance
 * id) is refused FAILED_PRECONDITION naming the instance, the rank and both engine ids, even
 * for a rank the instance has not registered yet, and the instance is left as it was; the
 * engine's own ranks join and round-trip in their own memory. An empty engine_id (a client
 * that predates the field) is not checked.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B, type SimEngine } from "../../lib/client/sim_engine.ts";
import { hostSim, refusedWith, type ServerProc, shmMappings, startServer, uid } from "./harness.ts";

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
