/**
 * Review of the node-id conflict (lib/index/rejoin.ts NodeIdConflict): a
 * process kept out of the index retries its join where it was refused. That
 * retry must succeed once the other process is gone even when the refusing
 * namespace's whole registry is gone (expired with every node of it), and a
 * close() while kept out leaves no timer or call behind (the test
 * sanitizers fail a leaked interval or op).
 */
import assert from "node:assert/strict";
import { Registry } from "prom-client";
import { RedisBlockIndex, type SealedBlock } from "../../lib/index/block_index.ts";
import { registerIndexMetrics } from "../../lib/index/metrics.ts";
import { Logger } from "../../lib/log.ts";
import { startRedis, waitFor } from "./_redis.ts";

const NS = "0123456789abcdef";
const REGISTRY = `pf:{${NS}}:nodes`;

function hashes(n: number, chain: number): Uint8Array[] {
  return Array.from({ length: n }, (_, i) => new Uint8Array([chain, i, 0xa5, 0x5a]));
}

function node(url: string, addr: string, held: Uint8Array[], nodeId = "dup") {
  const blocks: SealedBlock[] = held.map((hash) => ({ namespace: NS, hash }));
  const index = new RedisBlockIndex({
    url,
    nodeId,
    advertiseAddr: addr,
    listSealed: () => blocks,
    nodeTtlMs: 1000,
    heartbeatMs: 100,
    log: new Logger("error", {}, () => {}),
    metrics: registerIndexMetrics(new Registry()),
  });
  index.start();
  return index;
}

Deno.test("a node kept out joins once the other is gone, even with the refusing registry gone whole; close() while kept out leaks nothing", async () => {
  const redis = await startRedis();
  const xs = hashes(3, 1), ys = hashes(3, 2);
  const x = node(redis.url, "host-x:50055", xs);
  let y: RedisBlockIndex | undefined;
  let z: RedisBlockIndex | undefined;
  try {
    await waitFor("x connected", () => x.up);
    assert.equal(await x.advertise(NS, xs), true);
    y = node(redis.url, "host-y:50055", ys);
    await waitFor("y kept out", () => y!.stats().conflictWith === "host-x:50055");
    // x dies (no heartbeat any more) and the namespace's registry goes whole (its TTL, or a
    // flush): y's retried join is accepted there and it re-advertises what it holds.
    await x.close();
    await redis.admin().del(REGISTRY);
    await waitFor("y joined", () => y!.stats().conflictWith === null);
    const reader = node(redis.url, "host-r:50055", [], "reader");
    try {
      await waitFor("y's blocks are found", async () => {
        const r = await reader.lookup(NS, ys);
        return r.length === 3;
      });
    } finally {
      await reader.close();
    }
    // A third process under the id is kept out while y lives; closing it then leaks nothing.
    z = node(redis.url, "host-z:50055", hashes(2, 3));
    await waitFor("z kept out", () => z!.stats().conflictWith === "host-y:50055");
    await z.close();
    const field = await redis.admin().hget(REGISTRY, "dup");
    assert.match(field!, / host-y:50055$/, "z took the id while kept out");
  } finally {
    await x.close();
    await y?.close();
    await z?.close();
    await redis.stop();
  }
});
