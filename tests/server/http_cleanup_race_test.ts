/**
 * POST /instances/cleanup with `{"all": true}` while one instance's copy is
 * in flight: the request waits for that instance to drain, and meanwhile
 * another instance's session drops (its cleanup runs to the end) and its
 * engine registers again under the same id. The request must answer 200,
 * and the new registration must survive: it registered after the operator
 * asked. (The request cleaned the ids one after another: it answered 500,
 * "instance ... is not registered", for one cleaned up meanwhile, and it
 * cleaned up the new registration of one registered anew meanwhile.)
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { type KvEngine, PROTOCOL_VERSION } from "../../lib/engine/engine.ts";
import { httpHandler } from "../../lib/server/http.ts";
import { ServerMetrics } from "../../lib/server/metrics.ts";
import { setup, silent } from "../engine/setup.ts";

/** B's session drops: cleaned up as lib/server/grpc_service.ts does, when still registered. */
async function sessionDrop(engine: KvEngine, id: string): Promise<void> {
  if (engine.has(id)) await engine.unregister(id, "session_lost");
}

/** The engine and its two instances (A's save held in its copy), and the HTTP handler. */
async function cleanupWhileADrains(tag: string) {
  const ids = [`${tag}-a`, `${tag}-b`];
  const t = await setup(ids);
  const metrics = new ServerMetrics(() => t.store.stats());
  let started!: () => void;
  const cleanupStarted = new Promise<void>((r) => started = r);
  // What server.ts hands the handler: the cleanup a lost session does.
  const handler = httpHandler({
    engine: t.engine,
    store: t.store,
    metrics,
    log: silent,
    cleanup: async (id, reason) => {
      metrics.cleanup(reason);
      const leases = t.engine.unregister(id, reason);
      if (id === ids[0]) started();
      return await leases;
    },
  });
  const hashes = chainedBlockHashes(syntheticTokens(5, 16 * 8), 16);
  const blockIds = hashes.map((_, i) => i);
  t.sims[0].fill(blockIds, hashes);
  // A's save is copying (its completion held back): the cleanup waits on A's drain.
  const hold = t.held.holdNext();
  const saving = t.engine.save({
    instanceId: ids[0],
    tpRank: 0,
    ppRank: 0,
    layers: [],
    blockIds,
    blockHashes: hashes,
  });
  await hold.submitted;
  const answer = handler(
    new Request("http://pegaflow/instances/cleanup", {
      method: "POST",
      body: JSON.stringify({ all: true }),
    }),
  );
  await cleanupStarted;
  return { ...t, ids, hold, saving, answer };
}

Deno.test("cleanup of all instances answers 200 when one is cleaned up meanwhile", async () => {
  const { engine, ids, hold, saving, answer, teardown } = await cleanupWhileADrains("h1");
  try {
    // B's session drops and its cleanup runs to the end while A drains.
    await sessionDrop(engine, ids[1]);
    hold.release();
    const res = await answer;
    const body = await res.json();
    assert.equal(res.status, 200, JSON.stringify(body));
    assert.deepEqual(body.cleaned.map((c: { instance_id: string }) => c.instance_id), ids);
    assert.equal((await saving).blocksSaved, 8, "A's in-flight save finished before A went");
    assert.deepEqual(engine.instances(), []);
  } finally {
    hold.release();
    await teardown();
  }
});

Deno.test("cleanup of all instances leaves an instance registered anew meanwhile", async () => {
  const { engine, ids, hold, saving, answer, sims, teardown } = await cleanupWhileADrains("h2");
  try {
    // B's session drops, its cleanup runs to the end, and B's engine registers again.
    await sessionDrop(engine, ids[1]);
    assert.equal(engine.has(ids[1]), false);
    engine.register({ ...sims[1].registration(), clientVersion: PROTOCOL_VERSION });
    hold.release();
    const res = await answer;
    assert.equal(res.status, 200, JSON.stringify(await res.clone().json()));
    await res.body?.cancel();
    assert.equal((await saving).blocksSaved, 8);
    assert.deepEqual(
      engine.instances().map((i) => i.instanceId),
      [ids[1]],
      "B's new registration, made after the request, is still there",
    );
  } finally {
    hold.release();
    await teardown();
  }
});
