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

const ROOT = new URL("../..", import.meta.url).pathname;

/** The demo as its own process: cold save on `saveAddr`, warm loads from `addr`. */
async function demo(addr: string, saveAddr: string): Promise<string> {
  // deno-fmt-ignore
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", "lib/client/demo.ts", "--addr", addr, "--save-addr", saveAddr,
      "--backend", "host", "--tokens", "512", "--layers", "4", "--requests", "3"],
    cwd: ROOT,
    stdout: "piped",
    stderr: "piped",
  }).output();
  const text = new TextDecoder().decode(out.stdout);
  assert.equal(out.code, 0, `demo failed:\n${text}\n${new TextDecoder().decode(out.stderr)}`);
  return text;
}

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
        const text = await demo(b.grpc, a.grpc);
        assert.match(text, /#0 cold/);
        // 512 tokens = 32 blocks: both warm requests hit all of them, every byte as saved on A.
        const warm = text.split("\n").filter((l) => l.includes("warm"));
        assert.equal(warm.length, 2, text);
        for (const l of warm) {
          assert.match(l, /"32\/32/, l);
          assert.match(l, /all bytes/, l);
        }
        const metrics = await (await b.http_get("/metrics")).text();
        const ok = metrics.match(/^pegaflow_peer_fetches_total\{result="ok"\} (\d+)/m);
        assert.ok(ok && Number(ok[1]) >= 1, `B fetched nothing from A:\n${metrics}`);
        assert.equal(Number(metrics.match(/^pegaflow_peer_fetch_blocks_total (\d+)/m)?.[1]), 32);
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
