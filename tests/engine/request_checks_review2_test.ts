/**
 * Request checks on the load, query and save path (in-process KvEngine, real
 * host backend): a request id past its limit is refused by every RPC that
 * carries one before anything is kept, counted or written; and a load state
 * in flight for one instance cannot be named by another instance's Load or
 * query-and-load (its refusal would be written into the first engine's load).
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import type { EngineError } from "../../lib/engine/errors.ts";
import { STATE_OK } from "../../lib/engine/load_state.ts";
import { MAX_REQUEST_ID_CHARS } from "../../lib/limits.ts";
import { setup } from "./setup.ts";

const rank0 = { tpRank: 0, ppRank: 0 };

Deno.test("a request_id past MAX_REQUEST_ID_CHARS is refused by Save, QueryPrefetch and Load, naming the field, its length and the limit", async () => {
  const { engine, store, sims: [sim], teardown } = await setup(["rid"]);
  const st = LoadState.create();
  try {
    const hashes = chainedBlockHashes(syntheticTokens(7, 16 * 4), 16);
    const ids = hashes.map((_, i) => i);
    sim.fill(ids, hashes);
    const ok = "r".repeat(MAX_REQUEST_ID_CHARS);
    // At the limit: accepted.
    const saved = await engine.save({
      instanceId: "rid",
      ...rank0,
      requestId: ok,
      layers: [],
      blockIds: ids,
      blockHashes: hashes,
    });
    assert.equal(saved.blocksSaved, 4);
    const q = engine.query("rid", hashes, ok);
    assert.equal(q.hits, 4);
    engine.release(q.leaseId!);

    const long = "x".repeat(2 << 20); // a 2 MiB request id
    const refused = (e: EngineError) =>
      e.code === 3 && e.message.includes("request_id") &&
      e.message.includes(String(long.length)) &&
      e.message.includes(String(MAX_REQUEST_ID_CHARS)) && e.message.length < 4096 &&
      e.fields.instance === "rid" && e.fields.expected === MAX_REQUEST_ID_CHARS &&
      e.fields.got === long.length;
    const before = store.stats();
    await assert.rejects(
      engine.save({
        instanceId: "rid",
        ...rank0,
        requestId: long,
        layers: [],
        blockIds: ids,
        blockHashes: hashes,
      }),
      refused,
    );
    assert.throws(() => engine.query("rid", hashes, long), refused);
    assert.throws(
      () =>
        engine.queryLoad("rid", hashes, long, {
          blockIds: ids.map((i) => 8 + i),
          ranks: [{ ...rank0, loadStateShm: st.name }],
        }),
      refused,
    );
    const stateBefore = st.snapshot();
    await assert.rejects(
      engine.load({
        instanceId: "rid",
        ...rank0,
        requestId: long,
        leaseId: new Uint8Array(16),
        blockIds: [8],
        loadStateShm: st.name,
      }),
      refused,
    );
    assert.deepEqual(st.snapshot(), stateBefore, "the refused Load wrote nothing into its state");
    const after = store.stats();
    assert.equal(after.queries, before.queries, "a refused query was counted");
    assert.equal(after.leasesActive, before.leasesActive, "a refused query took a lease");
  } finally {
    st.close();
    await teardown();
  }
});

Deno.test("a Load or query-and-load from instance B naming instance A's in-flight load state is refused and A's state is left as it was", async () => {
  const { engine, held, sims: [a, b], teardown } = await setup(["own-a", "own-b"]);
  const stA = LoadState.create();
  const stB = LoadState.create();
  let release = () => {};
  try {
    const hashes = chainedBlockHashes(syntheticTokens(9, 16 * 4), 16);
    const ids = hashes.map((_, i) => i);
    for (const [sim, id] of [[a, "own-a"], [b, "own-b"]] as const) {
      sim.fill(ids, hashes);
      const r = await engine.save({
        instanceId: id,
        ...rank0,
        layers: [],
        blockIds: ids,
        blockHashes: hashes,
      });
      assert.equal(r.blocksSaved, 4);
    }
    // A's load is in flight: the copy landed, its completion has not reached the server yet.
    const qa = engine.query("own-a", hashes, "ra");
    const hold = held.holdNext();
    release = hold.release;
    const la = await engine.load({
      instanceId: "own-a",
      ...rank0,
      requestId: "ra",
      leaseId: qa.leaseId!,
      blockIds: ids.map((i) => 16 + i),
      loadStateShm: stA.name,
    });
    assert.equal(await stA.waitAll(), STATE_OK);
    const aWords = stA.snapshot();

    const names = (e: EngineError) =>
      e.code === 3 && e.message.includes(stA.name) && e.message.includes(`"own-b"`) &&
      e.message.includes(`"own-a"`) && e.fields.instance === "own-b";
    // A Load from B with a lease B does not hold: its refusal would mark A's state failed.
    await assert.rejects(
      engine.load({
        instanceId: "own-b",
        ...rank0,
        requestId: "rb",
        leaseId: new Uint8Array(16),
        blockIds: [0],
        loadStateShm: stA.name,
      }),
      names,
    );
    assert.deepEqual(stA.snapshot(), aWords, "B's refused Load wrote into A's load state");
    // An instance that is not registered keeps its own refusal; A's state is not written either.
    await assert.rejects(
      engine.load({
        instanceId: "ghost",
        ...rank0,
        requestId: "rg",
        leaseId: new Uint8Array(16),
        blockIds: [0],
        loadStateShm: stA.name,
      }),
      (e: EngineError) => e.code === 9 && /instance "ghost" is not registered/.test(e.message),
    );
    assert.deepEqual(stA.snapshot(), aWords, "an unknown instance's Load wrote into A's state");

    // A query-and-load from B naming A's state: refused for that rank, A's state untouched.
    const qb = engine.queryLoad("own-b", hashes, "rb2", {
      blockIds: ids.map((i) => 24 + i),
      ranks: [{ ...rank0, loadStateShm: stA.name }],
    });
    assert.equal(qb.loads.length, 1);
    assert.ok(
      qb.loads[0].error.includes(stA.name) && qb.loads[0].error.includes(`"own-a"`),
      qb.loads[0].error,
    );
    assert.deepEqual(stA.snapshot(), aWords, "B's query-and-load wrote into A's load state");

    // B's own state still works.
    const qb3 = engine.query("own-b", hashes, "rb3");
    const lb = await engine.load({
      instanceId: "own-b",
      ...rank0,
      requestId: "rb3",
      leaseId: qb3.leaseId!,
      blockIds: ids.map((i) => 32 + i),
      loadStateShm: stB.name,
    });
    await lb.done;
    assert.equal(stB.snapshot().state, STATE_OK);
    // A's engine saw its load end and rearms the block for a load of its other instance
    // (the connector's staging instance does so), while the server has not yet seen A's
    // completion: the block is the engine's again, so that load is served.
    stA.rearm();
    const qb4 = engine.query("own-b", hashes, "rb4");
    const lb4 = await engine.load({
      instanceId: "own-b",
      ...rank0,
      requestId: "rb4",
      leaseId: qb4.leaseId!,
      blockIds: ids.map((i) => 40 + i),
      loadStateShm: stA.name,
    });
    await lb4.done;
    assert.equal(stA.snapshot().state, STATE_OK);
    assert.deepEqual(b.verify(ids.map((i) => 40 + i), hashes), {
      badSegments: 0,
      first: undefined,
    });
    hold.release();
    await la.done;
    assert.deepEqual(a.verify(ids.map((i) => 16 + i), hashes), {
      badSegments: 0,
      first: undefined,
    });
  } finally {
    release(); // a failed assertion must not leave A's load held through the teardown's drain
    stA.close();
    stB.close();
    await teardown();
  }
});
