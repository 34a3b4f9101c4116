/**
 * `deno task demo --save-addr A --addr B`: the cold request saves on node A,
 * and the warm ones ask node B, which finds the prefix in the Redis block
 * index and fetches it from A (the peer tier). Two real servers, one real
 * Redis, the demo as its own process: every warm request is a full hit on B,
 * verified byte for byte, and B's metrics count the fetch.
 */
import assert from "node:assert/strict";
import { startServer } from "../server/harness.ts";
import { startRedis } from "../index/_redis.ts";
import { assertFetchedAcross, crossNodeDemo } from "./_demo.ts";

Deno.test("demo with --save-addr saves on one node and loads the prefix on another, fetched across nodes", async () => {
  const redis = await startRedis();
  const flags = (id: string) => [
    "--pool-size",
    "64mb",
    "--index-redis",
    redis.url,
    "--node-id",
    id,
    "--transport",
    "tcp",
  ];
  const a = await startServer(flags("demo-a"));
  const b = await startServer(flags("demo-b"));
  try {
    const text = await crossNodeDemo(b.grpc, a.grpc);
    assert.match(text, new RegExp(`cold saves go to ${a.grpc.replace(/\./g, "\\.")}`));
    await assertFetchedAcross(text, b);
    assert.match(text, /hit rate 66\.7% \(64\/96 blocks\)/);
  } finally {
    await b.stop();
    await a.stop();
    await redis.stop();
  }
});
