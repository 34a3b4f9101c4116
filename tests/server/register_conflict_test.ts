/**
 * One rank, two engines: a RegisterContext for a rank that is already held
 * answers ALREADY_EXISTS only when it is the same registration (the holder
 * asking again); another engine's (other regions, geometry or layers under
 * the same instance id) is refused with FAILED_PRECONDITION naming the rank,
 * and the holder's regions stay the ones every save and load uses.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import type { PegaflowError } from "../../lib/client/client.ts";
import { hostSim, refusedWith, startServer, uid } from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };
const HELD = /instance "[^"]+" tp_rank 0 pp_rank 0 is registered by another engine/;

Deno.test("another engine registering a held rank is refused and the holder keeps its regions", async () => {
  const srv = await startServer();
  const instanceId = uid("dup");
  const namespace = uid("ns");
  const holder = hostSim(srv, { instanceId, namespace, model: MODEL, numBlocks: 16 });
  const intruder = hostSim(srv, { instanceId, namespace, model: MODEL, numBlocks: 16 });
  try {
    await holder.register();
    await assert.rejects(intruder.register(), refusedWith("FAILED_PRECONDITION", HELD));
    // The same registration again is the holder asking: ALREADY_EXISTS, as before.
    await assert.rejects(holder.register(), refusedWith("ALREADY_EXISTS", /already registered/));
    // Its handles with another geometry, or another layer name, are not the same registration.
    const g = holder.registration().geometry;
    await assert.rejects(
      holder.register({ geometry: g.map((x) => ({ ...x, numBlocks: 8 })) }),
      refusedWith("FAILED_PRECONDITION", HELD),
    );
    const names = [...holder.layerNames.slice(0, 3), "model.layers.003.other"];
    await assert.rejects(
      holder.register({ layerNames: names }),
      refusedWith("FAILED_PRECONDITION", HELD),
    );
    const refused = srv.logs().filter((l) => l.includes("registered by another engine"));
    assert.ok(refused.length > 0, "the server logs the refusal");
    const line = JSON.parse(refused[0]);
    assert.equal(line.instance, instanceId);
    assert.equal(line.tp_rank, 0);
    assert.notEqual(line.expected, line.got, "held and offered fingerprints are logged");

    // The holder's save / query / load round trip lands in the holder's memory, not the intruder's.
    const hashes = chainedBlockHashes(syntheticTokens(5, 16 * 4), 16);
    holder.fill([0, 1, 2, 3], hashes);
    const saved = await holder.save([0, 1, 2, 3], hashes);
    assert.equal(saved.blocksSaved, 4);
    const q = await holder.query(hashes, "holder");
    assert.ok(q.kind === "ready" && q.hits === 4);
    if (q.kind !== "ready") return;
    await holder.load(q.leaseId, [8, 9, 10, 11]);
    assert.equal(holder.verify([8, 9, 10, 11], hashes).badSegments, 0);
    const untouched = intruder.verify([8, 9, 10, 11], hashes);
    assert.equal(untouched.badSegments, 4 * 2 * 4, "nothing was loaded into the intruder's memory");
  } finally {
    holder.close();
    intruder.close();
    await srv.stop();
  }
});

Deno.test("once the holder's session ends, another engine registers the rank", async () => {
  const srv = await startServer();
  const instanceId = uid("restart");
  const namespace = uid("ns");
  const old = hostSim(srv, { instanceId, namespace, model: MODEL, numBlocks: 16 });
  const fresh = hostSim(srv, { instanceId, namespace, model: MODEL, numBlocks: 16 });
  try {
    await old.register();
    const session = srv.client.openSession(instanceId);
    const hashes = chainedBlockHashes(syntheticTokens(6, 16 * 2), 16);
    old.fill([0, 1], hashes);
    await old.save([0, 1], hashes);
    await assert.rejects(fresh.register(), refusedWith("FAILED_PRECONDITION", HELD));

    // The old engine is gone (its session ends): the rank is freed once it is cleaned up.
    session.close();
    const deadline = Date.now() + 20_000;
    for (;;) {
      try {
        await fresh.register();
        break;
      } catch (e) {
        const code = (e as PegaflowError).codeName;
        assert.ok(code === "FAILED_PRECONDITION" || code === "UNAVAILABLE", String(e));
        assert.ok(Date.now() < deadline, `still refused: ${e}`);
        await new Promise((r) => setTimeout(r, 50));
      }
    }
    await assert.rejects(fresh.register(), refusedWith("ALREADY_EXISTS"));
    const q = await fresh.query(hashes, "fresh");
    assert.ok(q.kind === "ready" && q.hits === 2);
    if (q.kind !== "ready") return;
    await fresh.load(q.leaseId, [4, 5]);
    assert.equal(fresh.verify([4, 5], hashes).badSegments, 0);
  } finally {
    old.close();
    fresh.close();
    await srv.stop();
  }
});
