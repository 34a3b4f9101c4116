/**
 * The demo (`lib/client/demo.ts`) as its own process across two nodes: the
 * cold request saved on one, the warm ones asked of the other, which fetches
 * the prefix from the first (tests/client/demo_cross_node_test.ts on one
 * Redis, tests/index/cluster_e2e_test.ts on a Redis Cluster).
 */
import assert from "node:assert/strict";
import type { ServerProc } from "../server/harness.ts";

const ROOT = new URL("../..", import.meta.url).pathname;
/** 512 tokens of 16: the blocks of the demo's prompt. */
export const DEMO_BLOCKS = 32;

/** Runs the demo, 3 requests: cold save on `saveAddr`, warm loads from `addr`; its stdout. */
export async function crossNodeDemo(addr: string, saveAddr: string): Promise<string> {
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

/**
 * The demo's output says #0 was cold and both warm requests hit every block,
 * every byte as saved; `b` (the node asked) counts a fetch of all of them.
 */
export async function assertFetchedAcross(text: string, b: ServerProc): Promise<void> {
  assert.match(text, /#0 cold/);
  const warm = text.split("\n").filter((l) => l.includes("warm"));
  assert.equal(warm.length, 2, text);
  for (const l of warm) {
    assert.match(l, new RegExp(`"${DEMO_BLOCKS}/${DEMO_BLOCKS}`), l);
    assert.match(l, /all bytes/, l);
  }
  const metrics = await (await b.http_get("/metrics")).text();
  const ok = metrics.match(/^pegaflow_peer_fetches_total\{result="ok"\} (\d+)/m);
  assert.ok(ok && Number(ok[1]) >= 1, `the node asked fetched nothing:\n${metrics}`);
  const blocks = metrics.match(/^pegaflow_peer_fetch_blocks_total (\d+)/m);
  assert.equal(Number(blocks?.[1]), DEMO_BLOCKS);
}
