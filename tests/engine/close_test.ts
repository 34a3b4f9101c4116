/**
 * KvEngine.close (the server stopping) cleans every instance up, even one
 * that a session drop or an UnregisterContext cleaned up while close was
 * waiting for another instance's copies to drain.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { setup } from "./setup.ts";

Deno.test("close cleans every instance up when one of them is unregistered meanwhile", async () => {
  const { engine, held, store, sims: [a], teardown } = await setup(["c-a", "c-b", "c-c"]);
  try {
    const hashes = chainedBlockHashes(syntheticTokens(9, 16 * 8), 16);
    const ids = hashes.map((_, i) => i);
    a.fill(ids, hashes);
    // A's save is copying (its completion held back): close waits on A's drain first.
    const hold = held.holdNext();
    const saving = engine.save({
      instanceId: "c-a",
      tpRank: 0,
      ppRank: 0,
      layers: [],
      blockIds: ids,
      blockHashes: hashes,
    });
    await hold.submitted;
    const closing = engine.close();
    // Meanwhile B's session drops and its cleanup runs to the end.
    assert.equal(await engine.unregister("c-b", "session_lost"), 0);
    hold.release();
    await closing;
    assert.equal((await saving).blocksSaved, 8, "A's in-flight save finished before A went");
    assert.deepEqual(engine.instances(), [], "C was cleaned up too");
    assert.equal(store.stats().inflightCopyBytes, 0);
  } finally {
    await teardown();
  }
});

Deno.test("close answers a WaitPrefetch held on a fetch that never ends: false, at once", async () => {
  let asked = "";
  const tiers = {
    sealed: () => undefined,
    drop: () => 0,
    storedLayouts: () => [],
    beforeQuery: () => true,
    // A tier whose fetch of every request runs for good (a hung disk, a silent peer).
    settled: (
      instance: string,
      request: string,
    ) => (asked = `${instance}:${request}`, new Promise<void>(() => {})),
  };
  const { engine, teardown } = await setup(["w-a"], 64, { engine: { tiers } });
  try {
    const held = engine.waitPrefetch("w-a", "r1", 60_000);
    assert.equal(asked, "w-a:r1", "the tiers were asked for that instance's request");
    const closing = engine.close();
    assert.equal(await held, false, "the hold ended with the server, not at its 60 s");
    await closing;
    await assert.rejects(engine.waitPrefetch("w-a", "r2", 10), /not registered/);
  } finally {
    await teardown(); // closes the engine (again: idempotent)
  }
});
