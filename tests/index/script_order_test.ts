/**
 * The order of one node's index calls survives Redis forgetting its scripts
 * (SCRIPT FLUSH, or a failover whose new master never ran them) while the
 * connection stays up: the advertiser sends an advertise and a later
 * withdraw of the same block without waiting in between, so Redis must apply
 * them in the order they were sent.
 */

import assert from "node:assert/strict";
import { RedisBlockIndex } from "../../lib/index/block_index.ts";
import { WITHDRAW_LUA } from "../../lib/index/scripts.ts";
import { startRedis, waitFor } from "./_redis.ts";

const NS = "0123456789abcdef";

function hash(i: number): Uint8Array {
  const h = new Uint8Array(32).fill(0x5a);
  new DataView(h.buffer).setUint32(0, i);
  return h;
}

function indexNode(url: string, id: string): RedisBlockIndex {
  const index = new RedisBlockIndex({
    url,
    nodeId: id,
    advertiseAddr: `${id}.local:50055`,
    listSealed: () => [],
    nodeTtlMs: 60_000,
  });
  index.start();
  return index;
}

Deno.test("a block advertised then withdrawn is not listed, even when Redis flushed its scripts in between", async () => {
  const redis = await startRedis();
  const a = indexNode(redis.url, "a");
  const b = indexNode(redis.url, "b");
  try {
    await waitFor("both nodes connected", () => a.up && b.up);
    // Both scripts have run on a's connection: later calls of each may go by SHA.
    assert.equal(await a.advertise(NS, [hash(0)]), true);
    assert.equal(await a.withdraw(NS, [hash(0)]), true);
    assert.equal(await a.advertise(NS, [hash(1)]), true);
    const admin = redis.admin();
    await admin.script("FLUSH");
    // Another node's call put one script back in the cache (any EVAL caches its script).
    await admin.script("LOAD", WITHDRAW_LUA);
    // Sealed then evicted in two ticks: the advertiser sends both without waiting.
    const advertised = a.advertise(NS, [hash(2)]);
    const withdrawn = a.withdraw(NS, [hash(2)]);
    assert.deepEqual([await advertised, await withdrawn], [true, true]);
    assert.deepEqual(
      await b.lookup(NS, [hash(1), hash(2)]),
      { length: 1, owners: [{ nodeId: "a", addr: "a.local:50055", length: 1 }], available: true },
      "a withdrawn block is still listed under node a",
    );
  } finally {
    await a.close();
    await b.close();
    await redis.stop();
  }
});
