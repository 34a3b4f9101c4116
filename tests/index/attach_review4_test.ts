/**
 * Review of the discards (lib/storage/discard.ts) against the block index's
 * hooks (lib/index/attach.ts): a tier fill (SSD prefetch) whose block a
 * discard named while its read ran commits into a block that never seals
 * (it is freed). The index must not list that block as held here: nothing
 * would ever withdraw it (no eviction comes for a block that never sealed).
 */
import assert from "node:assert/strict";
import { IndexAdvertiser } from "../../lib/index/advertiser.ts";
import { advertisedFills } from "../../lib/index/attach.ts";
import { hexBytes } from "../../lib/index/keys.ts";
import { storeTierHost } from "../../lib/storage/tier_host.ts";
import { h, makeStore, NS } from "../storage/helpers.ts";

Deno.test("a fill whose block a discard named during its read is not advertised at its commit", async () => {
  const adv = new IndexAdvertiser();
  const { store } = makeStore(16, { onEvict: (ns, hash) => adv.onEvicted(ns, hash) });
  const host = advertisedFills(storeTierHost(store), adv);
  const sent: string[] = [];
  adv.connect({
    advertise: (
      _ns,
      hashes,
    ) => (sent.push(...hashes.map((x) => `+${x.length}`)), Promise.resolve(true)),
    withdraw: (
      _ns,
      hashes,
    ) => (sent.push(...hashes.map((x) => `-${x.length}`)), Promise.resolve(true)),
  });
  const bad = hexBytes(h(1));
  const good = hexBytes(h(2));
  const fBad = host.fill(NS, bad, "ssd", "retained");
  const fGood = host.fill(NS, good, "ssd", "retained");
  assert.ok(fBad && fGood);
  // The read of h(1) runs; a rank's discard names it: the fill's block is doomed.
  const r = store.discard({ namespace: NS, instance: "eng", rank: 0, hashes: [h(1)] });
  assert.deepEqual([r.dropped, r.copiesCut], [1, 1]);
  fBad.commit();
  fGood.commit();
  assert.equal(store.blockState(NS, h(1)), "absent", "the discarded fill's block was freed");
  assert.equal(store.blockState(NS, h(2)), "sealed");
  assert.equal(adv.holds(NS, bad), false, "the index lists a block this node does not hold");
  assert.equal(adv.holds(NS, good), true);
  assert.equal(adv.held, 1);
  await Promise.resolve(); // the advertiser's microtask
  assert.deepEqual(sent, ["+8"], "only the sealed fill was advertised");
  store.verify();
});
