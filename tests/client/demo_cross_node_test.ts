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

const ROOT = new URL("../..", import.meta.url).pathname;

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
    const out = await new Deno.Command(Deno.execPath(), {
      args: [
        "run",
        "-A",
        "lib/client/demo.ts",
        "--addr",
        b.grpc,
        "--save-addr",
        a.grpc,
        "--backend",
        "host",
        "--tokens",
        "512",
        "--layers",
        "4",
        "--requests",
        "3",
      ],
      cwd: ROOT,
      stdout: "piped",
      stderr: "piped",
    }).output();
    const text = new TextDecoder().decode(out.stdout);
    const err = new TextDecoder().decode(out.stderr);
    assert.equal(out.code, 0, `demo failed:\n${text}\n${err}`);
    assert.match(text, new RegExp(`cold saves go to ${a.grpc.replace(/\./g, "\\.")}`));
    assert.match(text, /#0 cold/);
    // 512 tokens = 32 blocks: both warm requests hit all of them, every byte as saved on A.
    const warm = text.split("\n").filter((l) => l.includes("warm"));
    assert.equal(warm.length, 2, text);
    for (const l of warm) {
      assert.match(l, /"32\/32/, l);
      assert.match(l, /all bytes/, l);
    }
    assert.match(text, /hit rate 66\.7% \(64\/96 blocks\)/);
    const metrics = await (await b.http_get("/metrics")).text();
    const ok = metrics.match(/^pegaflow_peer_fetches_total\{result="ok"\} (\d+)/m);
    assert.ok(ok && Number(ok[1]) >= 1, `B fetched nothing from A:\n${metrics}`);
    const blocks = metrics.match(/^pegaflow_peer_fetch_blocks_total (\d+)/m);
    assert.equal(Number(blocks?.[1]), 32);
  } finally {
    await b.stop();
    await a.stop();
    await redis.stop();
  }
});
