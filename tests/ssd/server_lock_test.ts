/**
 * One server per SSD cache file: a second server given the same
 * `--ssd-cache-path` exits non-zero before its readiness line, naming the
 * file and the pid holding it, and the first keeps serving its blocks.
 * Before the fix both opened the file and the first silently lost its
 * cache. The lock is the kernel's, so a killed holder does not keep it.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { runServerToEnd, startServer, uid } from "../server/harness.ts";
import { queryUntilReady, sim, SSD_FLAGS, until } from "./_server.ts";

Deno.test("a second server on the same SSD cache file exits non-zero naming the file and the holder pid; the first keeps serving", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-ssd-lock-" });
  const namespace = uid("ns");
  const file = `${dir}/pegaflow-ssd.cache`;
  const first = await startServer(SSD_FLAGS(dir));
  const eng = sim(first.client, namespace);
  try {
    await eng.register();
    const hashes = chainedBlockHashes(syntheticTokens(31, 16 * 6), 16);
    const ids = [1, 2, 3, 4, 5, 6];
    eng.fill(ids, hashes);
    await eng.save(ids, hashes);
    await until(
      "write-behind",
      async () => (await first.metric("pegaflow_ssd_write_blocks_total")) === 6,
    );

    const second = await runServerToEnd(SSD_FLAGS(dir));
    assert.notEqual(second.code, 0, "the second server must refuse to start");
    assert.ok(!second.stdout.includes("listening"), `no readiness line: ${second.stdout}`);
    assert.ok(second.stderr.includes(file), second.stderr);
    assert.ok(second.stderr.includes(`process ${first.pid}`), second.stderr);

    // The first server still owns its cache: evicted from RAM, served back from SSD.
    assert.equal((await first.http_post("/cache/memory/cleanup")).status, 200);
    const r = await queryUntilReady(eng, hashes, "after-refusal");
    assert.equal(r.hits, 6);
    const dst = [20, 21, 22, 23, 24, 25];
    eng.clear(dst);
    await eng.load(r.leaseId, dst);
    assert.deepEqual(eng.verify(dst, hashes), { badSegments: 0, first: undefined });
    assert.equal(await first.metric("pegaflow_ssd_read_blocks_total"), 6);
    await first.client.unregisterContext(eng.instanceId);
  } finally {
    eng.close();
    await first.stop();
  }
  try {
    // Killed or stopped, a holder's lock goes with it: the next server starts.
    const next = await startServer(SSD_FLAGS(dir));
    try {
      assert.equal(await next.metric("pegaflow_ssd_recovered_blocks"), 6);
      Deno.kill(next.pid, "SIGKILL");
      await next.status;
    } finally {
      await next.stop();
    }
    const afterKill = await startServer(SSD_FLAGS(dir));
    try {
      assert.equal(await afterKill.metric("pegaflow_ssd_recovered_blocks"), 6);
    } finally {
      await afterKill.stop();
    }
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
