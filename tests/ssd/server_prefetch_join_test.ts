/**
 * Prefetches from SSD in the real server (child process, real gRPC): a
 * prefix being read for one request is joined by every other query of it
 * ("loading", then a hit), and the blocks it brings in are ordinary cached
 * blocks as soon as they land, whether or not the first requester polls
 * again. Before the fix, with 8 engines at once the hits were 40,0,0,0,0,0,0,0,
 * and a prefix read for a request that never came back stayed invisible
 * until the prefetch expired.
 */
import assert from "node:assert/strict";
import type { SimEngine } from "../../lib/client/sim_engine.ts";
import { type ServerProc, uid } from "../server/harness.ts";
import { queryUntilReady, sim, ssdResidentPrefix, until } from "./_server.ts";

const BLOCKS = 40;
const ENGINES = 8;

/** Loads `leaseId` into blocks 20.. of `e` and checks every byte. */
async function loadsExact(e: SimEngine, leaseId: Uint8Array, hashes: Uint8Array[]) {
  const dst = Array.from({ length: hashes.length }, (_, i) => 20 + i);
  e.clear(dst);
  await e.load(leaseId, dst);
  assert.deepEqual(e.verify(dst, hashes), { badSegments: 0, first: undefined });
}

Deno.test("8 engines querying one SSD-resident prefix at once all end with every block hit, each block read once", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-ssd-join-" });
  const namespace = uid("ns");
  let srv: ServerProc | undefined;
  const engines: SimEngine[] = [];
  try {
    const setup = await ssdResidentPrefix(dir, namespace, 21, BLOCKS);
    srv = setup.srv;
    const s = srv;
    for (let i = 0; i < ENGINES; i++) engines.push(sim(s.client, namespace));
    for (const e of engines) await e.register();
    const results = await Promise.all(
      engines.map((e, i) => queryUntilReady(e, setup.hashes, `popular-prompt-${i}`)),
    );
    assert.deepEqual(results.map((r) => r.hits), engines.map(() => BLOCKS));
    assert.ok(results.some((r) => r.loading > 0), "the prefix was read from SSD");
    assert.equal(
      await s.metric("pegaflow_ssd_read_blocks_total"),
      BLOCKS,
      "concurrent queries joined one read instead of each reading (or missing)",
    );
    await loadsExact(engines[3], results[3].leaseId, setup.hashes);
    for (let i = 0; i < ENGINES; i++) if (i !== 3) await s.client.release(results[i].leaseId);
    for (const e of engines) await s.client.unregisterContext(e.instanceId);
  } finally {
    for (const e of engines) e.close();
    await srv?.stop();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("blocks prefetched for a request that never polls again are hits for another engine's first query", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-ssd-orphan-" });
  const namespace = uid("ns");
  let srv: ServerProc | undefined;
  let a: SimEngine | undefined, b: SimEngine | undefined;
  try {
    const setup = await ssdResidentPrefix(dir, namespace, 22, BLOCKS);
    srv = setup.srv;
    const s = srv;
    a = sim(s.client, namespace);
    b = sim(s.client, namespace);
    await a.register();
    await b.register();
    const first = await a.query(setup.hashes, "asked-once");
    assert.equal(first.kind, "loading");
    // A never polls again. The read lands on its own:
    await until(
      "the prefetch read",
      async () =>
        (await s.metric("pegaflow_ssd_read_blocks_total")) === BLOCKS &&
        (await s.metric("pegaflow_ssd_prefetch_inflight")) === 0 &&
        (await s.metric("pegaflow_ssd_prefetch_reserved_blocks")) === 0,
    );
    const q = await b.query(setup.hashes, "someone-else");
    assert.equal(q.kind, "ready", "no second read: the blocks are already in RAM");
    assert.equal(q.kind === "ready" ? q.hits : -1, BLOCKS);
    if (q.kind === "ready") await loadsExact(b, q.leaseId, setup.hashes);
    assert.equal(await s.metric("pegaflow_ssd_read_blocks_total"), BLOCKS);
    await s.client.unregisterContext(a.instanceId);
    await s.client.unregisterContext(b.instanceId);
  } finally {
    a?.close();
    b?.close();
    await srv?.stop();
    await Deno.remove(dir, { recursive: true });
  }
});
