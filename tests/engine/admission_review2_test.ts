/**
 * TinyLFU admission counts a request's hashes as accesses only once the
 * request is accepted: a query or a save refused for a malformed hash at
 * index k changes nothing, the hashes before k included (before, each
 * refusal counted them, so a client repeating a malformed request could lift
 * any block above the popular ones and have it admitted over them).
 */
import assert from "node:assert/strict";
import { KvStore } from "../../lib/storage/store.ts";

const NS = "0123456789abcdef";
const LAYOUT = { layers: 1, tpSize: 1, collapseTp: false, segments: 1, segmentBytes: 4096 };
const h = (i: number) => i.toString(16).padStart(16, "0");

/** A one-block pool holding the block `h(1)`, sealed and saved once; TinyLFU on. */
function fullStore(): KvStore {
  const store = new KvStore({ capacityBytes: 4096, lfuCapacityBlocks: 64 });
  store.defineNamespace(NS, LAYOUT);
  const b = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [h(1)] });
  assert.ok(b.ok);
  store.completeSave(b.plan, true);
  return store;
}

Deno.test("queries and saves refused for a malformed hash count none of their hashes for admission", () => {
  for (const refuse of ["query", "save", "fill"] as const) {
    const store = fullStore();
    for (let i = 0; i < 4; i++) {
      const hashes = [h(2), h(2), "not-hex"];
      assert.throws(() => {
        if (refuse === "query") store.query(NS, hashes, "e");
        else if (refuse === "save") {
          store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes });
        } else store.beginFill({ namespace: NS, instance: "tier", hashes });
      }, /hash/);
    }
    // h(2) was asked for once (this save) and h(1) once: not more popular, not admitted.
    const b = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [h(2)] });
    assert.ok(b.ok);
    assert.equal(
      b.plan.admissionRejected,
      1,
      `${refuse}: refused requests counted h(2) as accessed and it was admitted over h(1)`,
    );
    store.completeSave(b.plan, true);
    assert.equal(store.blockState(NS, h(1)), "sealed", `${refuse}: the popular block was evicted`);
  }
});
