/**
 * Bad input gets the right gRPC status, names what was wrong, and stores
 * nothing: wrong client version, bad topology/arrays/geometry, block id out
 * of range, unknown/expired lease, a second layout under one namespace, an
 * oversized request, a missing load state.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { hostSim, refusedWith, startServer, uid } from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 2 };

async function instanceIds(srv: { http_get(p: string): Promise<Response> }): Promise<string[]> {
  const j = await (await srv.http_get("/instances")).json();
  return j.instances.map((i: { instanceId: string }) => i.instanceId);
}

Deno.test("registration refuses bad input with the right status and maps nothing", async () => {
  const srv = await startServer();
  const ns = uid("ns");
  const sim = hostSim(srv, {
    instanceId: uid("bad"),
    namespace: ns,
    model: MODEL,
    numBlocks: 16,
  });
  try {
    await assert.rejects(
      sim.register({ clientVersion: "pegaflow-0" }),
      refusedWith("FAILED_PRECONDITION", /client version "pegaflow-0"/),
    );
    await assert.rejects(
      sim.register({ tpRank: 2, tpSize: 2, worldSize: 2 }),
      refusedWith("INVALID_ARGUMENT", /tp_rank 2 >= tp_size 2/),
    );
    await assert.rejects(
      sim.register({ worldSize: 3 }),
      refusedWith("INVALID_ARGUMENT", /world_size 3/),
    );
    await assert.rejects(
      sim.register({ layerNames: ["only-one"] }),
      refusedWith("INVALID_ARGUMENT", /1 layer_names but 2 region_handles/),
    );
    await assert.rejects(
      sim.register({ layerNames: [], regionHandles: [], geometry: [] }),
      refusedWith("INVALID_ARGUMENT", /layer_names is empty/),
    );
    const g = {
      numBlocks: 16,
      blockStride: 32768,
      segStride: 16 * 32768,
      segBytes: 32768,
      numSegments: 2,
      baseOffset: 0,
      regionBytes: 2 * 16 * 32768,
    };
    await assert.rejects(
      sim.register({ geometry: [g, { ...g, numBlocks: 17 }] }),
      refusedWith(
        "INVALID_ARGUMENT",
        /layer "model.layers.001.attn": (segments overlap|geometry reaches byte)/,
      ),
    );
    await assert.rejects(
      sim.register({ geometry: [g, { ...g, regionBytes: 4 * 16 * 32768 }] }),
      refusedWith("INVALID_ARGUMENT", /cannot map region/),
    );
    await assert.rejects(
      sim.register({ regionHandles: [sim.regions[0].handle, new Uint8Array(10)] }),
      refusedWith("INVALID_ARGUMENT", /10 bytes, expected 64/),
    );
    const bogus = new Uint8Array(64);
    bogus.set(new TextEncoder().encode("/pegaflow-no-such-region"));
    await assert.rejects(
      sim.register({ regionHandles: [sim.regions[0].handle, bogus] }),
      refusedWith("INVALID_ARGUMENT", /cannot map region/),
    );
    assert.deepEqual(await instanceIds(srv), [], "no failed registration left an instance behind");

    // The valid registration works afterwards, and the same rank twice is refused.
    await sim.register();
    await assert.rejects(sim.register(), refusedWith("ALREADY_EXISTS"));

    // A second layout under the same namespace is refused (different K/V size).
    const other = hostSim(srv, {
      instanceId: uid("other"),
      namespace: ns,
      model: { ...MODEL, kvHeads: 4 },
      numBlocks: 16,
    });
    try {
      await assert.rejects(
        other.register(),
        refusedWith("FAILED_PRECONDITION", /different layout/),
      );
      assert.deepEqual(await instanceIds(srv), [sim.instanceId]);
    } finally {
      other.close();
    }
  } finally {
    sim.close();
    await srv.stop();
  }
});

Deno.test("save, query, load and release refuse bad input and store nothing", async () => {
  const srv = await startServer(["--lease-ttl-ms", "300"]);
  const sim = hostSim(srv, {
    instanceId: uid("bad"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 16,
  });
  try {
    await sim.register();
    const hashes = chainedBlockHashes(syntheticTokens(5, 16 * 4), 16);
    sim.fill([0, 1, 2, 3], hashes);

    await assert.rejects(
      sim.save([0, 1, 2, 16], hashes),
      refusedWith("INVALID_ARGUMENT", /block id 16 >= num_blocks 16/),
    );
    await assert.rejects(
      srv.client.save({
        instanceId: sim.instanceId,
        tpRank: 0,
        ppRank: 0,
        blockIds: [99],
        blockHashes: [hashes[0]],
        requestId: "req-7",
      }),
      refusedWith(
        "INVALID_ARGUMENT",
        /request "req-7" layer "model\.layers\.000\.attn": block id 99 >= num_blocks 16/,
      ),
    );
    await assert.rejects(
      sim.save([0, 1, 2], hashes),
      refusedWith("INVALID_ARGUMENT", /3 block_ids but 4 block_hashes/),
    );
    await assert.rejects(
      srv.client.save({
        instanceId: sim.instanceId,
        tpRank: 0,
        ppRank: 0,
        layers: [{ layerName: "nope", blockIds: [0], blockHashes: [hashes[0]] }],
      }),
      refusedWith("INVALID_ARGUMENT", /layer "nope"/),
    );
    await assert.rejects(
      srv.client.save({
        instanceId: sim.instanceId,
        tpRank: 0,
        ppRank: 0,
        layers: [{ layerName: sim.layerNames[0], blockIds: [0], blockHashes: [hashes[0]] }],
        blockIds: [1],
        blockHashes: [hashes[1]],
      }),
      refusedWith("INVALID_ARGUMENT", /both per-layer lists and the all-layers/),
    );
    await assert.rejects(
      srv.client.save({ instanceId: "ghost", tpRank: 0, ppRank: 0, layers: [] }),
      refusedWith("FAILED_PRECONDITION", /instance "ghost" is not registered/),
    );
    assert.equal(await srv.metric("pegaflow_pool_used_bytes"), 0, "nothing was allocated");
    const q0 = await sim.query(hashes, "after-bad-saves");
    assert.equal(q0.kind === "ready" && q0.hits, 0, "nothing was stored");
    await assert.rejects(sim.query(hashes, ""), refusedWith("INVALID_ARGUMENT", /request_id/));

    await sim.save([0, 1, 2, 3], hashes);
    const unknown = new Uint8Array(16).fill(7);
    await assert.rejects(sim.load(unknown, [4, 5, 6, 7]), refusedWith("FAILED_PRECONDITION"));
    // An engine polling its load state (instead of awaiting the RPC) sees the refusal too.
    const st = new DataView((await Deno.readFile(`/dev/shm${sim.loadStateName!}`)).buffer);
    assert.equal(st.getInt32(20, true), -1000, "state: refused before any copy");
    assert.equal(st.getUint32(16, true), MODEL.numLayers, "layers_ready: every layer done");
    assert.equal(st.getUint32(8, true), MODEL.numLayers, "num_layers: the rank's layers");
    await assert.rejects(srv.client.release(unknown), refusedWith("FAILED_PRECONDITION"));
    await assert.rejects(
      sim.load(new Uint8Array(5), [4]),
      refusedWith("INVALID_ARGUMENT", /lease id is 5 bytes/),
    );
    const st5 = new DataView((await Deno.readFile(`/dev/shm${sim.loadStateName!}`)).buffer);
    assert.equal(st5.getInt32(20, true), -1000, "a short lease id is visible to a poller too");

    const q = await sim.query(hashes, "r1");
    assert.ok(q.kind === "ready" && q.hits === 4);
    if (q.kind !== "ready") return;
    await assert.rejects(
      sim.load(q.leaseId, [4, 5, 6, 99]),
      refusedWith("INVALID_ARGUMENT", /target block id 99/),
    );
    await assert.rejects(
      sim.load(q.leaseId, [4, 5, 6, 7, 8]),
      refusedWith(
        "INVALID_ARGUMENT",
        /holds 4 blocks; a load names at most that many targets, got 5/,
      ),
    );
    await assert.rejects(
      srv.client.load({
        instanceId: sim.instanceId,
        tpRank: 0,
        ppRank: 0,
        leaseId: q.leaseId,
        blockIds: [4, 5, 6, 7],
        loadStateShm: "/pegaflow-no-such-state",
      }),
      refusedWith("INVALID_ARGUMENT", /load state/),
    );

    // An expired lease (TTL 300 ms here) is refused, and its pins are gone.
    const q2 = await sim.query(hashes, "r2");
    assert.ok(q2.kind === "ready");
    if (q2.kind !== "ready") return;
    await new Promise((r) => setTimeout(r, 1500));
    await assert.rejects(sim.load(q2.leaseId, [4, 5, 6, 7]), refusedWith("FAILED_PRECONDITION"));
    assert.equal(await srv.metric("pegaflow_pinned_blocks"), 0);
  } finally {
    sim.close();
    await srv.stop();
  }
});

Deno.test("an oversized request is refused with RESOURCE_EXHAUSTED and stores nothing", async () => {
  const srv = await startServer(["--max-message-size", "64kb"]);
  const sim = hostSim(srv, {
    instanceId: uid("big"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 16,
  });
  try {
    await sim.register();
    // 2 layers x 4000 hashes of 16 bytes is well over 64 KiB.
    const hashes = chainedBlockHashes(syntheticTokens(9, 16 * 4000), 16);
    const ids = hashes.map((_, i) => i % 16);
    await assert.rejects(sim.save(ids, hashes), refusedWith("RESOURCE_EXHAUSTED"));
    assert.equal(await srv.metric("pegaflow_pool_used_bytes"), 0);
    assert.equal((await srv.client.health()).status, "ok", "the server keeps serving");
  } finally {
    sim.close();
    await srv.stop();
  }
});

Deno.test("pipeline stages must hold disjoint layers; TP peers the same ones", async () => {
  const srv = await startServer();
  const instanceId = uid("pp");
  const ns = uid("ns");
  const mk = (tpRank: number, tpSize: number) =>
    hostSim(srv, {
      instanceId,
      namespace: ns,
      model: MODEL,
      numBlocks: 8,
      tpRank,
      tpSize,
    });
  const a = mk(0, 1);
  const b = mk(0, 1);
  try {
    // Two PP stages (pp_size 2), both claiming the same layer names.
    await a.register({ ppRank: 0, ppSize: 2, worldSize: 2 });
    await assert.rejects(
      b.register({ ppRank: 1, ppSize: 2, worldSize: 2 }),
      refusedWith(
        "INVALID_ARGUMENT",
        /layer "model\.layers\.000\.attn" is also registered by pp_rank 0/,
      ),
    );
    // The valid second stage (other layer names) seals the topology.
    const r = await b.register({
      ppRank: 1,
      ppSize: 2,
      worldSize: 2,
      layerNames: ["model.layers.002.attn", "model.layers.003.attn"],
    });
    assert.equal(r.topologySealed, true);
    const inst = (await (await srv.http_get("/instances")).json()).instances[0];
    assert.equal(inst.numLayers, 4, "layer ids span both stages");
  } finally {
    a.close();
    b.close();
    await srv.stop();
  }
});

Deno.test("a namespace or instance id outside 1..128 of [A-Za-z0-9._-] is refused on every rank before anything is stored", async () => {
  const srv = await startServer();
  const mk = (instanceId: string, namespace: string, tpRank: number) =>
    hostSim(srv, {
      instanceId,
      namespace,
      model: MODEL,
      numBlocks: 8,
      tpRank,
      tpSize: 2,
    });
  const id = uid("names");
  const r0 = mk(id, "llama:8b", 0);
  const r1 = mk(id, "llama:8b", 1);
  try {
    // TP=2: the FIRST rank is refused already (not only the last one, at seal).
    await assert.rejects(
      r0.register(),
      refusedWith(
        "INVALID_ARGUMENT",
        /namespace "llama:8b" contains ":"; allowed: 1\.\.128 characters/,
      ),
    );
    await assert.rejects(r1.register(), refusedWith("INVALID_ARGUMENT", /namespace "llama:8b"/));
    assert.deepEqual(await instanceIds(srv), [], "no rank of the bad namespace got in");
    await assert.rejects(
      r0.register({ namespace: "x".repeat(129) }),
      refusedWith("INVALID_ARGUMENT", /namespace is 129 characters, at most 128/),
    );
    await assert.rejects(
      r0.register({ namespace: "" }),
      refusedWith("INVALID_ARGUMENT", /namespace is empty/),
    );
    await assert.rejects(
      r0.register({ instanceId: "engine 0" }),
      refusedWith("INVALID_ARGUMENT", /instance_id "engine 0" contains " "/),
    );
    await assert.rejects(
      r0.register({ instanceId: "" }),
      refusedWith("INVALID_ARGUMENT", /instance_id is empty/),
    );
    assert.deepEqual(await instanceIds(srv), []);
    // The longest allowed name, every allowed character: both ranks in, sealed.
    const ns = ("Az09._-" + "n".repeat(128)).slice(0, 128);
    await r0.register({ namespace: ns });
    const r = await r1.register({ namespace: ns });
    assert.equal(r.topologySealed, true);
  } finally {
    r0.close();
    r1.close();
    await srv.stop();
  }
});
