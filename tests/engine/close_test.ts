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
