/**
 * A Save that lists one block id twice under two hashes is refused before anything is
 * stored: its bytes would be kept under both hashes, one of them the wrong KV, served to
 * every later request with that prefix. The same id twice under one hash is harmless.
 */
import assert from "node:assert/strict";
import type { EngineError } from "../../lib/engine/errors.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { setup } from "./setup.ts";

Deno.test("a Save listing a block id under two hashes is refused naming it; nothing is stored", async () => {
  const { engine, store, sims: [a], teardown } = await setup(["dup"]);
  try {
    const [h0, h1, h2] = chainedBlockHashes(syntheticTokens(5, 16 * 3), 16);
    a.fill([4, 5], [h0, h1]);
    const rank = { instanceId: a.instanceId, tpRank: 0, ppRank: 0, layers: [] };
    await assert.rejects(
      engine.save({ ...rank, blockIds: [4, 5, 4], blockHashes: [h0, h1, h2] }),
      (e: EngineError) =>
        e.code === 3 &&
        /block id 4 is listed twice \(at 0 and 2\) under two different hashes/.test(e.message) &&
        e.fields.blockId === 4,
    );
    assert.equal(store.stats().sealedBlocks + store.stats().inflightBlocks, 0, "nothing stored");
    // One id twice under its one hash is stored once.
    const r = await engine.save({ ...rank, blockIds: [4, 5, 4], blockHashes: [h0, h1, h0] });
    assert.equal(r.blocksSaved, 2);
    assert.equal(engine.query(a.instanceId, [h0, h1, h2], "dup-q").hits, 2);
  } finally {
    await teardown();
  }
});
