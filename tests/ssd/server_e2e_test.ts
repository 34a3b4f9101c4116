/**
 * The SSD tier inside the real server (child process, real gRPC, host
 * backend): RAM → SSD → RAM after eviction, then stop the server, start it
 * again on the same cache path, and serve the SSD-held prefix byte-exact.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import type { SimEngine } from "../../lib/client/sim_engine.ts";
import { type ServerProc, startServer, uid } from "../server/harness.ts";
import { queryUntilReady, sim, SSD_FLAGS, until } from "./_server.ts";

const BLOCKS = 12;

Deno.test("server: evicted blocks come back from SSD, and survive a server restart, byte-exact", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-ssd-e2e-" });
  const namespace = uid("ns");
  const hashes = chainedBlockHashes(syntheticTokens(7, 16 * BLOCKS), 16);
  const src = Array.from({ length: BLOCKS }, (_, i) => 2 + i);
  const dst = Array.from({ length: BLOCKS }, (_, i) => 63 - i);
  let srv: ServerProc | undefined;
  let eng: SimEngine | undefined;
  try {
    srv = await startServer(SSD_FLAGS(dir));
    eng = sim(srv.client, namespace);
    await eng.register();
    eng.fill(src, hashes);
    assert.equal((await eng.save(src, hashes)).blocksSaved, BLOCKS);
    const s = srv;
    await until(
      "write-behind",
      async () => (await s.metric("pegaflow_ssd_write_blocks_total")) === BLOCKS,
    );
    assert.equal((await srv.http_post("/cache/memory/cleanup")).status, 200);
    const r1 = await queryUntilReady(eng, hashes, "after-eviction");
    assert.ok(r1.loading >= 1, "the first answer was loading");
    assert.equal(r1.hits, BLOCKS);
    eng.clear(dst);
    await eng.load(r1.leaseId, dst);
    assert.deepEqual(eng.verify(dst, hashes), { badSegments: 0, first: undefined });
    assert.equal(await srv.metric("pegaflow_ssd_read_blocks_total"), BLOCKS);
    assert.equal(await srv.metric("pegaflow_ssd_checksum_failures_total"), 0);
    await srv.client.unregisterContext(eng.instanceId);
    eng.close();
    eng = undefined;
    await srv.stop();
    srv = undefined;

    // A new server process on the same path: the index is rebuilt from disk.
    srv = await startServer(SSD_FLAGS(dir));
    assert.equal(await srv.metric("pegaflow_ssd_recovered_blocks"), BLOCKS);
    eng = sim(srv.client, namespace);
    await eng.register();
    const r2 = await queryUntilReady(eng, hashes, "after-restart");
    assert.ok(r2.loading >= 1);
    assert.equal(r2.hits, BLOCKS);
    eng.clear(dst);
    await eng.load(r2.leaseId, dst);
    assert.deepEqual(eng.verify(dst, hashes), { badSegments: 0, first: undefined });
  } finally {
    if (eng && srv) await srv.client.unregisterContext(eng.instanceId).catch(() => {});
    eng?.close();
    await srv?.stop();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("server: a bad SSD flag is refused before start-up, naming the flag", async () => {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", "main.ts", "--ssd-write-inflight", "0"],
    cwd: new URL("../../", import.meta.url).pathname,
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.equal(out.code, 2);
  assert.match(
    new TextDecoder().decode(out.stderr) + new TextDecoder().decode(out.stdout),
    /--ssd-write-inflight/,
  );
});

Deno.test("server: an unusable SSD path disables the tier with the reason; the RAM tier serves", async () => {
  const srv = await startServer(["--ssd-cache-path", "/proc/pegaflow-no-such-dir/cache"]);
  try {
    assert.ok(
      srv.logs().some((l) =>
        l.includes("SSD tier disabled") && l.includes("/proc/pegaflow-no-such-dir")
      ),
    );
    const eng = sim(srv.client, uid("ns"));
    try {
      await eng.register();
      const hashes = chainedBlockHashes(syntheticTokens(9, 16 * 4), 16);
      eng.fill([1, 2, 3, 4], hashes);
      await eng.save([1, 2, 3, 4], hashes);
      const q = await eng.query(hashes, "r");
      assert.equal(q.kind === "ready" ? q.hits : -1, 4);
      if (q.kind === "ready") await srv.client.release(q.leaseId);
      await srv.client.unregisterContext(eng.instanceId);
    } finally {
      eng.close();
    }
  } finally {
    await srv.stop();
  }
});
