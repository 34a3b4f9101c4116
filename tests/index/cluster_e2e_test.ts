/**
 * End to end over a real 3-master Redis Cluster (tests/index/_redis_cluster.ts): two real
 * servers started with `--index-redis <seeds> --index-redis-cluster`, the demo saving the cold
 * request on node A (`--save-addr A`) and asking node B for the warm ones. B finds the prefix
 * in the cluster's index and fetches it from A: every warm request is a full hit, verified byte
 * for byte, B's metrics count the fetch, and the namespace's registry sits on one master with
 * both nodes in it.
 */
import assert from "node:assert/strict";
import { startServer } from "../server/harness.ts";
import { startRedisCluster } from "./_redis_cluster.ts";
import { assertFetchedAcross, crossNodeDemo } from "../client/_demo.ts";

Deno.test("on a Redis Cluster, a prefix saved on node A is found in the index and loaded on node B, bytes verified", async () => {
  const cluster = await startRedisCluster();
  const flags = (id: string) => [
    "--pool-size",
    "64mb",
    "--index-redis",
    cluster.url,
    "--index-redis-cluster",
    "--node-id",
    id,
    "--transport",
    "tcp",
  ];
  try {
    const a = await startServer(flags("e2e-a"));
    try {
      const b = await startServer(flags("e2e-b"));
      try {
        await assertFetchedAcross(await crossNodeDemo(b.grpc, a.grpc), b);
        // The registry of the demo's namespace: on one master, naming A (B joined it when its
        // own load filled the blocks).
        const registries: string[][] = [];
        for (let i = 0; i < cluster.ports.length; i++) {
          for (const key of await cluster.admin(i).keys("pf:{*}:nodes")) {
            registries.push(Object.keys(await cluster.admin(i).hgetall(key)).sort());
          }
        }
        assert.ok(
          registries.some((nodes) => nodes.includes("e2e-a")),
          `no registry names e2e-a: ${JSON.stringify(registries)}`,
        );
        for (const srv of [a, b]) {
          assert.equal(await srv.metric("pegaflow_index_redis_up"), 1, "the index is up");
          // Not once down: every call answered (first calls to each master included).
          const down = srv.logs().filter((l) => l.includes("block index unreachable"));
          assert.deepEqual(down, [], "the index went down during the run");
        }
      } finally {
        await b.stop();
      }
    } finally {
      await a.stop();
    }
  } finally {
    await cluster.stop();
  }
});
