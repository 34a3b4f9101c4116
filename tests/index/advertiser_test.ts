/**
 * The advertiser between the store's events and the index: one call per
 * save and per eviction burst, evict-then-reseal in one tick cancels out,
 * and the held set is what a re-advertise sends.
 */

import assert from "node:assert/strict";
import { Buffer } from "node:buffer";
import { type AdvertisePort, IndexAdvertiser } from "../../lib/index/advertiser.ts";

interface Sent {
  op: "advertise" | "withdraw";
  ns: string;
  hexes: string[];
}

function recorder(): AdvertisePort & { sent: Sent[] } {
  const sent: Sent[] = [];
  const rec = (op: Sent["op"]) => (ns: string, hashes: readonly Uint8Array[]) => {
    sent.push({ op, ns, hexes: hashes.map((h) => Buffer.from(h).toString("hex")) });
    return Promise.resolve(true);
  };
  return { sent, advertise: rec("advertise"), withdraw: rec("withdraw") };
}

const hex = (i: number) => i.toString(16).padStart(64, "0");
const keys = (ns: string, from: number, n: number) =>
  Array.from({ length: n }, (_, i) => `${ns}:${hex(from + i)}`);
const tick = () => new Promise((r) => setTimeout(r, 0));

Deno.test("a save is one advertise and an eviction burst one withdraw, per namespace", async () => {
  const port = recorder();
  const adv = new IndexAdvertiser();
  adv.connect(port);
  adv.onSealed("ns1", keys("ns1", 0, 625));
  adv.onSealed("ns2", keys("ns2", 0, 3));
  await tick();
  assert.deepEqual(port.sent.map((s) => [s.op, s.ns, s.hexes.length]), [
    ["advertise", "ns1", 625],
    ["advertise", "ns2", 3],
  ]);
  port.sent.length = 0;
  for (let i = 0; i < 100; i++) adv.onEvicted("ns1", hex(i));
  adv.onEvicted("ns1", hex(9999)); // never held: nothing to withdraw
  await tick();
  assert.deepEqual(port.sent.map((s) => [s.op, s.ns, s.hexes.length]), [["withdraw", "ns1", 100]]);
  assert.equal(adv.held, 525 + 3);
});

Deno.test("a block evicted and sealed again in one tick stays advertised; sealed then evicted is never sent", async () => {
  const port = recorder();
  const adv = new IndexAdvertiser();
  adv.connect(port);
  adv.onSealed("ns", keys("ns", 0, 4));
  await tick();
  port.sent.length = 0;
  adv.onEvicted("ns", hex(1));
  adv.onSealed("ns", keys("ns", 1, 1)); // re-saved before the flush
  adv.onSealed("ns", keys("ns", 10, 1));
  adv.onEvicted("ns", hex(10)); // sealed and evicted in the same tick
  await tick();
  assert.deepEqual(port.sent, []);
  assert.deepEqual(
    [...adv.listSealed()].map((b) => Buffer.from(b.hash).toString("hex")).sort(),
    [hex(0), hex(1), hex(2), hex(3)],
  );
});

Deno.test("events before the index is connected only fill the held set", async () => {
  const port = recorder();
  const adv = new IndexAdvertiser();
  adv.onSealed("ns", keys("ns", 0, 5));
  adv.onEvicted("ns", hex(4));
  await tick();
  adv.connect(port);
  await tick();
  assert.deepEqual(port.sent, []);
  const listed = [...adv.listSealed()];
  assert.equal(listed.length, 4);
  assert.ok(listed.every((b) => b.namespace === "ns" && b.hash.length === 32));
});

Deno.test("blocks the index refuses (hash over 64 bytes) are reported once per namespace, never thrown", async () => {
  const refused: string[] = [];
  const adv = new IndexAdvertiser((ns, e) => refused.push(`${ns}: ${e.message}`));
  adv.connect({
    advertise: (_ns, hashes) => {
      if (hashes.some((h) => h.length > 64)) {
        return Promise.reject(new Error(`hash has ${hashes[0].length} bytes`));
      }
      return Promise.resolve(true);
    },
    withdraw: () => Promise.resolve(true),
  });
  const long = (i: number) => `ns:${i.toString(16).padStart(160, "0")}`;
  adv.onSealed("ns", [long(1), long(2)]);
  await tick();
  adv.onSealed("ns", [long(3)]);
  await tick();
  assert.deepEqual(refused, ["ns: hash has 80 bytes"]);
  assert.equal(adv.held, 3);
});
