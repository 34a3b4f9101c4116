// A throw from what the store calls out to (a fill's per-block verdict, the
// onEvict listener, the lease id source) leaves the store exactly as
// consistent as a normal return: no pool byte leaked, no pin without a
// holder, no slot pending without an open plan (`verify()` after each).
import {
  deepStrictEqual as assertEquals,
  ok as assert,
  strictEqual,
  throws,
} from "node:assert/strict";
import { StaleHandleError } from "../../lib/storage/errors.ts";
import { KvStore } from "../../lib/storage/store.ts";
import { h, hs, NS } from "./helpers.ts";

const UNIT = 4096;
/** One 4 KiB item per block: one pool unit. */
const ONE_ITEM = { layers: 1, tpSize: 1, collapseTp: false, segments: 1, segmentBytes: UNIT };

function sealAll(store: KvStore, hashes: string[], namespace = NS): void {
  const b = store.beginSave({ namespace, instance: "eng", rank: 0, hashes });
  assert(b.ok, b.ok ? "" : b.error.message);
  strictEqual(store.completeSave(b.plan, true).sealed, hashes.length);
}

Deno.test("a per-block verdict that throws fails the whole fill: every slot freed, the plan closed, the error rethrown", () => {
  const store = new KvStore({ capacityBytes: 4 * UNIT });
  store.defineNamespace(NS, ONE_ITEM);
  const b = store.beginFill({ namespace: NS, instance: "peer-1", hashes: hs(0, 3) });
  assert(b.ok);
  const boom = new Error(`checksum table of peer-1 missing for block ${h(1)}`);
  throws(() =>
    store.completeSave(b.plan, (k) => {
      if (k === 1) throw boom;
      return true;
    }), (e) => e === boom);
  store.verify();
  const st = store.stats();
  assertEquals([st.freeBytes, st.inflightBlocks, st.sealedBlocks, st.inflightCopyBytes], [
    4 * UNIT,
    0,
    0,
    0,
  ]);
  throws(() => store.completeSave(b.plan, true), StaleHandleError);
});

Deno.test("an onEvict that throws mid-eviction leaves every evicted block's bytes free", () => {
  let calls = 0;
  const store = new KvStore({
    capacityBytes: 4 * UNIT,
    onEvict: (_ns, hash) => {
      if (++calls === 2) throw new Error(`index withdraw of ${hash} failed`);
    },
  });
  store.defineNamespace(NS, ONE_ITEM);
  sealAll(store, hs(0, 4)); // side by side: eviction frees them as one run
  throws(() => store.evictAll(), /index withdraw of 0000000000000001 failed/);
  store.verify();
  const st = store.stats();
  assertEquals([st.freeBytes, st.sealedBlocks, st.evictions], [2 * UNIT, 2, 2]);
  strictEqual(store.evictAll(), 2);
  strictEqual(store.stats().freeBytes, 4 * UNIT);
});

Deno.test("an onEvict that throws while a save is being placed rolls the placed columns back", () => {
  // Namespace A: one 4 KiB item per block. Namespace B: two layers of one 8 KiB item.
  const A = NS;
  const B = "fedcba9876543210";
  let evictions = 0;
  const store = new KvStore({
    capacityBytes: 6 * UNIT,
    onEvict: (ns, hash) => {
      if (++evictions === 5) throw new Error(`withdraw of ${ns}:${hash} failed`);
    },
  });
  store.defineNamespace(A, ONE_ITEM);
  store.defineNamespace(B, { ...ONE_ITEM, layers: 2, segmentBytes: 2 * UNIT });
  sealAll(store, hs(0, 6), A); // units 0..5
  // Touch the odd blocks: the LRU order becomes 0, 2, 4, 1, 3, 5.
  for (const i of [1, 3, 5]) store.releaseLease(store.query(A, [h(i)], "eng").lease!.id);
  // B's block needs 4 units: evicting 0, 2, 4, 1 frees [0, 3) and [4, 5); layer 0
  // lands in [0, 2), layer 1 finds no 2-unit hole and evicts once more: that
  // fifth onEvict throws after layer 0 was placed.
  throws(
    () => store.beginSave({ namespace: B, instance: "eng", rank: 0, hashes: [h(9)] }),
    /withdraw of 0123456789abcdef:0000000000000003 failed/,
  );
  store.verify();
  const st = store.stats();
  assertEquals([st.inflightBlocks, st.sealedBlocks, st.inflightCopyBytes, st.freeBytes], [
    0,
    1,
    0,
    5 * UNIT,
  ]);
});

Deno.test("a lease or transfer lock whose id cannot be made pins nothing", () => {
  let failIds = false;
  const store = new KvStore({
    capacityBytes: 4 * UNIT,
    randomBytes: (n) => {
      if (failIds) throw new Error("entropy source failed");
      return crypto.getRandomValues(new Uint8Array(n));
    },
  });
  store.defineNamespace(NS, ONE_ITEM);
  sealAll(store, hs(0, 2));
  failIds = true;
  throws(() => store.query(NS, hs(0, 2), "eng"), /entropy source failed/);
  store.verify();
  throws(() => store.lockForTransfer(NS, hs(0, 2), "ssd"), /entropy source failed/);
  store.verify();
  strictEqual(store.stats().pinnedBlocks, 0);
  strictEqual(store.evictAll(), 2, "nothing is left pinned by the failed lease or lock");
});
