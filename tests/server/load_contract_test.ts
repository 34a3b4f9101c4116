/**
 * The Load contract the vLLM connector relies on, over real gRPC against a
 * server child: a refused Load changes nothing (its lease stays usable); a
 * Load may name a prefix of the lease (the rest is given back once every
 * rank consumed it); zero targets consume and finish at once; a refusal
 * marks every layer done in the load state, so a waiter on layers_ready
 * alone never hangs.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { initLoadState, LOAD_STATE_BYTES, readLoadState } from "../../lib/engine/load_state.ts";
import { SharedMemory } from "../../ffi/mod.ts";
import {
  hostSim,
  metricBecomes,
  refusedWith,
  type ServerProc,
  shmMappings,
  startServer,
  uid,
} from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 3 };
/** Four layers: two pipeline stages of two. */
const MODEL4 = { ...LLAMA_3_1_8B, numLayers: 4 };
function sim(srv: ServerProc, instanceId: string, ns: string, tpRank = 0, tpSize = 1) {
  return hostSim(srv, {
    instanceId,
    namespace: ns,
    model: MODEL,
    numBlocks: 16,
    tpRank,
    tpSize,
  });
}

Deno.test("a refused Load leaves its lease usable: the corrected retry loads byte-exact", async () => {
  const srv = await startServer();
  const e = sim(srv, uid("refused"), uid("ns"));
  const st = LoadState.create();
  try {
    await e.register();
    const hashes = chainedBlockHashes(syntheticTokens(21, 16 * 4), 16);
    e.fill([0, 1, 2, 3], hashes);
    await e.save([0, 1, 2, 3], hashes);
    const q = await e.query(hashes, "r-refused");
    assert.ok(q.kind === "ready" && q.hits === 4);
    if (q.kind !== "ready") return;
    const load = (over: Record<string, unknown>) =>
      srv.client.load({
        instanceId: e.instanceId,
        tpRank: 0,
        ppRank: 0,
        leaseId: q.leaseId,
        blockIds: [8, 9, 10, 11],
        loadStateShm: st.name,
        requestId: "r-refused",
        ...over,
      });
    // Each refusal is its own kind of bad input; none may spend the lease.
    await assert.rejects(
      load({ blockIds: [8, 9, 10, 11, 12] }),
      refusedWith("INVALID_ARGUMENT", /request "r-refused".*holds 4 blocks.*got 5/),
    );
    await assert.rejects(
      load({ blockIds: [8, 9, 10, 16] }),
      refusedWith("INVALID_ARGUMENT", /target block id 16 >= num_blocks 16/),
    );
    await assert.rejects(
      load({ loadStateShm: "/pegaflow-no-such-load-state" }),
      refusedWith("INVALID_ARGUMENT", /load state/),
    );
    await assert.rejects(
      load({ tpRank: 1 }),
      refusedWith("INVALID_ARGUMENT", /tp_rank 1 pp_rank 0, outside its topology \(tp_size 1/),
    );
    await assert.rejects(
      load({ instanceId: "ghost" }),
      refusedWith("FAILED_PRECONDITION", /instance "ghost" is not registered/),
    );
    assert.equal(await srv.metric("pegaflow_leases"), 1, "the lease survived every refusal");

    e.clear([8, 9, 10, 11]);
    st.rearm();
    const r = await load({});
    assert.equal(r.numBlocks, 4);
    assert.equal(await st.waitAll(), 1);
    const v = e.verify([8, 9, 10, 11], hashes);
    assert.equal(v.badSegments, 0, v.first ?? "");
    await metricBecomes(srv, "pegaflow_pinned_blocks", 0);
    assert.equal(await srv.metric("pegaflow_leases"), 0, "consumed by the only rank");
  } finally {
    st.close();
    e.close();
    await srv.stop();
  }
});

Deno.test("a Load naming fewer targets loads that prefix; the rest is given back when every rank consumed", async () => {
  const srv = await startServer();
  const ns = uid("ns");
  const id = uid("prefix");
  const r0 = sim(srv, id, ns, 0, 2);
  const r1 = sim(srv, id, ns, 1, 2);
  const st0 = LoadState.create();
  try {
    await r0.register();
    await r1.register();
    const hashes = chainedBlockHashes(syntheticTokens(22, 16 * 4), 16);
    for (const r of [r0, r1]) {
      r.fill([0, 1, 2, 3], hashes);
      await r.save([0, 1, 2, 3], hashes);
    }
    const q = await r0.query(hashes, "r-prefix");
    assert.ok(q.kind === "ready" && q.hits === 4);
    if (q.kind !== "ready") return;

    // Rank 0 needs 3 blocks (vLLM recomputes the last token).
    r0.clear([10, 11, 12]);
    const got0 = await srv.client.load({
      instanceId: id,
      tpRank: 0,
      ppRank: 0,
      leaseId: q.leaseId,
      blockIds: [10, 11, 12],
      loadStateShm: st0.name,
    });
    assert.equal(got0.numBlocks, 3);
    assert.equal(got0.bytes, 3 * r0.blockBytes);
    assert.equal(await st0.waitAll(), 1);
    let v = r0.verify([10, 11, 12], hashes.slice(0, 3));
    assert.equal(v.badSegments, 0, v.first ?? "");
    // The lease still pins all 4 blocks: rank 1 has not consumed it.
    await metricBecomes(srv, "pegaflow_pinned_blocks", 4);
    assert.equal(await srv.metric("pegaflow_leases"), 1);

    // Rank 1 needs only 2; after this last consume nothing stays pinned.
    r1.clear([0, 1, 2, 3]);
    const res1 = await r1.load(q.leaseId, [2, 3]);
    assert.equal(res1.state, 1);
    v = r1.verify([2, 3], hashes.slice(0, 2));
    assert.equal(v.badSegments, 0, v.first ?? "");
    await metricBecomes(srv, "pegaflow_pinned_blocks", 0);
    assert.equal(await srv.metric("pegaflow_leases"), 0);
    // The blocks given back are still cached and servable.
    const again = await r0.query(hashes, "r-prefix-2");
    assert.ok(again.kind === "ready" && again.hits === 4);
    if (again.kind === "ready") await srv.client.release(again.leaseId);
  } finally {
    st0.close();
    r0.close();
    r1.close();
    await srv.stop();
  }
});

Deno.test("a Load with zero targets consumes this rank's share and marks the load state done", async () => {
  const srv = await startServer();
  const e = sim(srv, uid("zero"), uid("ns"));
  const st = LoadState.create();
  try {
    await e.register();
    const hashes = chainedBlockHashes(syntheticTokens(23, 16 * 2), 16);
    e.fill([0, 1], hashes);
    await e.save([0, 1], hashes);
    const q = await e.query(hashes, "r-zero");
    assert.ok(q.kind === "ready" && q.hits === 2);
    if (q.kind !== "ready") return;
    const req = {
      instanceId: e.instanceId,
      tpRank: 0,
      ppRank: 0,
      leaseId: q.leaseId,
      blockIds: [],
      loadStateShm: st.name,
    };
    const r = await srv.client.load(req);
    assert.deepEqual(r, { numBlocks: 0, numLayers: MODEL.numLayers, bytes: 0 });
    assert.deepEqual(st.snapshot(), {
      numLayers: MODEL.numLayers,
      layersReady: MODEL.numLayers,
      state: 1,
    });
    await metricBecomes(srv, "pegaflow_pinned_blocks", 0);
    assert.equal(await srv.metric("pegaflow_leases"), 0, "the only rank consumed it");
    await assert.rejects(
      srv.client.load(req),
      refusedWith("FAILED_PRECONDITION", /unknown or expired/),
    );
  } finally {
    st.close();
    e.close();
    await srv.stop();
  }
});

Deno.test("a refused Load marks every layer done, so a layers_ready waiter wakes and sees the failure", async () => {
  const srv = await startServer();
  const e = sim(srv, uid("wake"), uid("ns"));
  const st = LoadState.create();
  try {
    await e.register();
    const req = {
      instanceId: e.instanceId,
      tpRank: 0,
      ppRank: 0,
      leaseId: new Uint8Array(16).fill(3),
      blockIds: [0],
      loadStateShm: st.name,
    };
    // Known rank: layers_ready = num_layers = the rank's layer count.
    await assert.rejects(
      srv.client.load(req),
      refusedWith("FAILED_PRECONDITION", /unknown or expired/),
    );
    assert.deepEqual(st.snapshot(), {
      numLayers: MODEL.numLayers,
      layersReady: MODEL.numLayers,
      state: -1000,
    });

    // Unknown instance: the server cannot know the layer count, so both words read "all".
    st.rearm();
    await assert.rejects(
      srv.client.load({ ...req, instanceId: "ghost" }),
      refusedWith("FAILED_PRECONDITION"),
    );
    const words = readLoadState(
      new DataView((await Deno.readFile(`/dev/shm${st.name}`)).buffer),
    );
    assert.deepEqual(words, { numLayers: 0xffffffff, layersReady: 0xffffffff, state: -1000 });
  } finally {
    st.close();
    e.close();
    await srv.stop();
  }
});

Deno.test("a whole (async) Load lands byte-exact into scattered targets, and its log line says whole", async () => {
  const srv = await startServer();
  const e = sim(srv, uid("whole"), uid("ns"));
  const st = LoadState.create();
  try {
    await e.register();
    const hashes = chainedBlockHashes(syntheticTokens(31, 16 * 6), 16);
    e.fill([0, 1, 2, 3, 4, 5], hashes);
    await e.save([0, 1, 2, 3, 4, 5], hashes);
    const q = await e.query(hashes, "r-whole");
    assert.ok(q.kind === "ready" && q.hits === 6);
    if (q.kind !== "ready") return;
    const dst = [15, 13, 11, 9, 7, 8]; // descending and scattered, as vLLM hands a re-sent prompt
    e.clear(dst);
    const r = await srv.client.load({
      instanceId: e.instanceId,
      tpRank: 0,
      ppRank: 0,
      leaseId: q.leaseId,
      blockIds: dst,
      loadStateShm: st.name,
      requestId: "r-whole",
      whole: true,
    });
    assert.equal(r.numBlocks, 6);
    assert.equal(await st.waitAll(), 1);
    assert.equal(st.snapshot().layersReady, MODEL.numLayers);
    const v = e.verify(dst, hashes);
    assert.equal(v.badSegments, 0, v.first ?? "");
    let line: Record<string, unknown> | undefined;
    for (let i = 0; i < 100 && !line; i++) {
      const hit = srv.logs().find((l) => l.includes('"load done"') && l.includes("r-whole"));
      if (hit) line = JSON.parse(hit);
      else await new Promise((res) => setTimeout(res, 10));
    }
    assert.ok(line, "the load done line");
    assert.equal(line!.whole, true);
    // Nothing merges: descending targets, 6 blocks x 3 layers x K/V.
    assert.equal(line!.segments, 6 * MODEL.numLayers * 2 - 2 * MODEL.numLayers);
  } finally {
    st.close();
    e.close();
    await srv.stop();
  }
});

/** A load-state block made under a chosen name (the engine's own, as the connector's free list reuses). */
function namedState(name: string): { view: DataView; close(): void } {
  const shm = SharedMemory.open(name, LOAD_STATE_BYTES, { create: true, unlink: true });
  const u8 = shm.view();
  const view = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  initLoadState(view);
  return { view, close: () => shm.close() };
}

async function settled(view: DataView): Promise<number> {
  const deadline = Date.now() + 10_000;
  while (readLoadState(view).state === 0) {
    assert.ok(Date.now() < deadline, "the load never settled");
    await new Promise((r) => setTimeout(r, 2));
  }
  return readLoadState(view).state;
}

Deno.test("the server maps a load state once across loads, follows a new object under its name, unmaps it when the engine leaves", async () => {
  const srv = await startServer();
  const e = sim(srv, uid("kept"), uid("ns"));
  const name = `/${uid("kept-ls")}`;
  let st = namedState(name);
  try {
    await e.register();
    const hashes = chainedBlockHashes(syntheticTokens(61, 16 * 4), 16);
    e.fill([0, 1, 2, 3], hashes);
    await e.save([0, 1, 2, 3], hashes);
    const loadOnce = async (i: number) => {
      const q = await e.query(hashes, `r-kept-${i}`);
      assert.ok(q.kind === "ready" && q.hits === 4);
      if (q.kind !== "ready") return;
      e.clear([8, 9, 10, 11]);
      initLoadState(st.view);
      await srv.client.load({
        instanceId: e.instanceId,
        tpRank: 0,
        ppRank: 0,
        leaseId: q.leaseId,
        blockIds: [8, 9, 10, 11],
        loadStateShm: name,
        requestId: `r-kept-${i}`,
      });
      assert.equal(await settled(st.view), 1, `load ${i}`);
      assert.equal(e.verify([8, 9, 10, 11], hashes).badSegments, 0, `load ${i}`);
    };
    for (let i = 0; i < 3; i++) {
      await loadOnce(i);
      assert.equal(shmMappings(srv.pid, name.slice(1)).length, 1, `one mapping after load ${i}`);
    }
    // The engine drops the block and makes a new one under the same name: the
    // server must report into the new one, not the mapping it kept.
    st.close();
    st = namedState(name);
    await loadOnce(3);
    assert.equal(shmMappings(srv.pid, name.slice(1)).length, 1, "the old mapping was closed");
    await srv.client.unregisterContext(e.instanceId);
    assert.deepEqual(shmMappings(srv.pid, name.slice(1)), [], "unmapped once the engine left");
  } finally {
    st.close();
    e.close();
    await srv.stop();
  }
});

Deno.test("a Save or Load naming a tp_rank beyond tp_size is refused: the rank it would alias keeps its memory and its share", async () => {
  const srv = await startServer();
  const id = uid("alias");
  const ns = uid("ns");
  // tp_size 1, pp_size 2: (tp 1, pp 0) would index rank (tp 0, pp 1).
  const ranks = [0, 1].map((ppRank) =>
    hostSim(srv, { instanceId: id, namespace: ns, model: MODEL4, numBlocks: 16, ppRank, ppSize: 2 })
  );
  const st = LoadState.create();
  try {
    for (const r of ranks) await r.register();
    const hashes = chainedBlockHashes(syntheticTokens(71, 16 * 2), 16);
    for (const r of ranks) {
      r.fill([0, 1], hashes);
      await r.save([0, 1], hashes);
    }
    await assert.rejects(
      srv.client.save({
        instanceId: id,
        tpRank: 1,
        ppRank: 0,
        blockIds: [2],
        blockHashes: [hashes[0]],
      }),
      refusedWith(
        "INVALID_ARGUMENT",
        /tp_rank 1 pp_rank 0, outside its topology \(tp_size 1, pp_size 2\)/,
      ),
    );
    const q = await ranks[0].query(hashes, "r-alias");
    assert.ok(q.kind === "ready" && q.hits === 2);
    if (q.kind !== "ready") return;
    ranks[1].clear([8, 9]);
    await assert.rejects(
      srv.client.load({
        instanceId: id,
        tpRank: 1,
        ppRank: 0,
        leaseId: q.leaseId,
        blockIds: [8, 9],
        loadStateShm: st.name,
        requestId: "r-alias",
      }),
      refusedWith("INVALID_ARGUMENT", /outside its topology/),
    );
    assert.ok(
      ranks[1].verify([8, 9], hashes).badSegments > 0,
      "pp rank 1's targets were not written",
    );
    // Both real ranks still load their share, byte-exact.
    for (const r of ranks) {
      await r.load(q.leaseId, [8, 9], "r-alias");
      assert.equal(r.verify([8, 9], hashes).badSegments, 0, `pp_rank ${r.ppRank}`);
    }
  } finally {
    st.close();
    for (const r of ranks) r.close();
    await srv.stop();
  }
});
