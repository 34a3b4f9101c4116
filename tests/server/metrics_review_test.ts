/**
 * What /metrics reports at the edges of a server's life: after a tier closed
 * (shutdown closes the tiers before the HTTP side), when one collector
 * fails, and for requests the HTTP side does not serve.
 */
import assert from "node:assert/strict";
import { Counter, Gauge, Registry } from "prom-client";
import { KvStore } from "../../lib/storage/store.ts";
import { LowerTiers } from "../../lib/storage/lower_tiers.ts";
import { storeTierHost } from "../../lib/storage/tier_host.ts";
import { SsdStorageTier } from "../../lib/ssd/ssd_tier_port.ts";
import { registerSsdMetrics } from "../../lib/ssd/metrics.ts";
import { registerTierMetrics } from "../../lib/server/tier_metrics.ts";
import { metricsResponse } from "../../lib/metrics.ts";
import { harness } from "../ssd/_harness.ts";
import { type ServerProc, startServer, uid } from "./harness.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { queryUntilReady, sim, SSD_FLAGS, until } from "../ssd/_server.ts";

const MiB = 1 << 20;

/** The value of one sample line `name{labels} v` in a Prometheus text, or undefined. */
function sample(text: string, name: string, labels = ""): number | undefined {
  const line = text.split("\n").find((l) => l.startsWith(`${name}${labels} `));
  return line === undefined ? undefined : Number(line.slice(line.lastIndexOf(" ") + 1));
}

Deno.test("after the SSD tier closed, /metrics still renders: pegaflow_tier_up reads 0 and the SSD counters keep their last values", async () => {
  const h = await harness(16 * MiB);
  const store = new KvStore({ capacityBytes: 16 * MiB });
  const ssd = await h.openTier({ capacityBytes: 64 * MiB, segmentBytes: 4 * MiB });
  const tiers = new LowerTiers({
    ram: store,
    tiers: [new SsdStorageTier(ssd, storeTierHost(store), h.log)],
  });
  const registry = new Registry();
  registerTierMetrics(registry, tiers);
  registerSsdMetrics(registry, () => ssd.stats());
  try {
    const open = await registry.metrics();
    assert.equal(sample(open, "pegaflow_tier_up", '{tier="ssd"}'), 1);
    const capacity = sample(open, "pegaflow_ssd_capacity_bytes");
    assert.ok(capacity !== undefined && capacity > 0);
    await tiers.close(); // what stopServer does before it stops the HTTP side
    await new Promise((r) => setTimeout(r, 5)); // past the per-scrape snapshot
    const res = await metricsResponse(registry);
    const text = await res.text();
    assert.equal(res.status, 200, text);
    assert.equal(sample(text, "pegaflow_tier_up", '{tier="ssd"}'), 0, "closed tier reads 0");
    assert.equal(sample(text, "pegaflow_ssd_capacity_bytes"), capacity);
    assert.equal(sample(text, "pegaflow_ssd_write_blocks_total"), 0);
  } finally {
    await tiers.close();
    await h.close();
  }
});

Deno.test("one collector that throws leaves the rest of /metrics served and names itself", async () => {
  const registry = new Registry();
  new Counter({ name: "pegaflow_fine_total", help: "fine", registers: [registry] }).inc(3);
  new Gauge({
    name: "pegaflow_broken",
    help: "reads a closed handle",
    registers: [registry],
    collect() {
      throw new Error("pf_xfer_info: PF_EHANDLE");
    },
  });
  const res = await metricsResponse(registry);
  const text = await res.text();
  assert.equal(res.status, 200);
  assert.equal(sample(text, "pegaflow_fine_total"), 3);
  assert.equal(sample(text, "pegaflow_broken"), undefined, "no made-up value");
  assert.match(text, /^# pegaflow_broken unavailable: .*PF_EHANDLE/m);
});

/** One raw request on a fresh connection; the status line's code, or null if none came back. */
async function rawStatus(port: number, request: string): Promise<number | null> {
  const conn = await Deno.connect({ hostname: "127.0.0.1", port });
  // The server may answer and close before it read all of a huge request: a failed write is fine.
  const sent = conn.write(new TextEncoder().encode(request)).catch(() => 0);
  const timer = setTimeout(() => conn.close(), 10_000);
  let head = "";
  try {
    const buf = new Uint8Array(4096);
    while (!head.includes("\r\n")) {
      const n = await conn.read(buf);
      if (n === null) break;
      head += new TextDecoder().decode(buf.subarray(0, n));
    }
  } catch {
    // reset by the server after its answer: the head read so far decides
  } finally {
    clearTimeout(timer);
    await sent;
    try {
      conn.close();
    } catch {
      // closed by the timer
    }
  }
  const m = /^HTTP\/1\.1 (\d{3})/.exec(head);
  return m ? Number(m[1]) : null;
}

Deno.test("the HTTP side answers a wrong method with 405 and Allow, HEAD like GET, an unknown path 404, huge headers 4xx; /metrics keeps answering", async () => {
  const srv = await startServer();
  const port = Number(srv.http.slice(srv.http.lastIndexOf(":") + 1));
  const base = `http://${srv.http}`;
  try {
    for (
      const [method, path, allow] of [
        ["POST", "/metrics", "GET, HEAD"],
        ["PUT", "/health", "GET, HEAD"],
        ["DELETE", "/instances", "GET, HEAD"],
        ["GET", "/instances/cleanup", "POST"],
        ["GET", "/cache/memory/cleanup", "POST"],
      ]
    ) {
      const res = await fetch(`${base}${path}`, { method });
      const body = await res.json();
      assert.equal(res.status, 405, `${method} ${path}`);
      assert.equal(res.headers.get("allow"), allow, `${method} ${path}`);
      assert.match(body.error, new RegExp(`${path} only accepts`));
    }
    const head = await fetch(`${base}/metrics`, { method: "HEAD" });
    assert.equal(head.status, 200, "HEAD /metrics");
    assert.match(head.headers.get("content-type") ?? "", /^text\/plain/);
    assert.equal(await head.text(), "");
    const nf = await fetch(`${base}/metrics/nope`);
    assert.equal(nf.status, 404);
    const nfBody = await nf.json();
    assert.match(nfBody.error, /no route GET \/metrics\/nope/);
    assert.ok(
      nfBody.routes.includes("GET /health"),
      "a 404 lists the routes a probe may have meant",
    );
    const big = await rawStatus(
      port,
      `GET /metrics HTTP/1.1\r\nhost: x\r\nx-big: ${"a".repeat(1 << 20)}\r\n\r\n`,
    );
    assert.ok(big === null || (big >= 400 && big < 500), `huge header answered ${big}`);
    const after = await srv.http_get("/metrics");
    assert.equal(after.status, 200);
    assert.match(await after.text(), /^pegaflow_pool_capacity_bytes \d+/m);
  } finally {
    await srv.stop();
  }
});

Deno.test("hit attribution adds up: every final QueryPrefetch answer has one source, and ram + ssd blocks are the hits", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-metrics-attribution-" });
  const hashes = chainedBlockHashes(syntheticTokens(77, 16 * 6), 16);
  const longer = chainedBlockHashes(syntheticTokens(77, 16 * 8), 16); // `hashes` + 2 never saved
  const strangers = chainedBlockHashes(syntheticTokens(78, 16 * 6), 16);
  const ids = [1, 2, 3, 4, 5, 6];
  let srv: ServerProc | undefined;
  const eng = { close() {} } as { close(): void; instanceId?: string };
  try {
    srv = await startServer(SSD_FLAGS(dir));
    const s = srv;
    const e = sim(s.client, uid("ns"));
    Object.assign(eng, { close: () => e.close(), instanceId: e.instanceId });
    await e.register();
    e.fill(ids, hashes);
    assert.equal((await e.save(ids, hashes)).blocksSaved, 6);
    await until(
      "write-behind",
      async () => (await s.metric("pegaflow_ssd_write_blocks_total")) === 6,
    );
    const answers: { requested: number; hits: number }[] = [];
    const final = async (hs: Uint8Array[], id: string) => {
      const r = await queryUntilReady(e, hs, id);
      answers.push({ requested: hs.length, hits: r.hits });
      return r.hits;
    };
    // RAM emptied before any hit: a lease would pin the blocks through the cleanup.
    assert.equal((await s.http_post("/cache/memory/cleanup")).status, 200);
    assert.equal(await final(hashes, "back-from-ssd"), 6);
    assert.equal(await final(hashes, "all-in-ram"), 6);
    assert.equal(await final(strangers, "nowhere"), 0);
    assert.equal(await final(longer, "ram-then-nothing"), 6);

    const src = async (source: string) =>
      await s.metric("pegaflow_query_source_total", `{source="${source}"}`);
    const srcBlocks = async (source: string) =>
      await s.metric("pegaflow_query_source_blocks_total", `{source="${source}"}`);
    assert.deepEqual(
      { ram: await src("ram"), ssd: await src("ssd"), miss: await src("miss") },
      { ram: 2, ssd: 1, miss: 1 },
    );
    const hits = answers.reduce((n, a) => n + a.hits, 0);
    const requested = answers.reduce((n, a) => n + a.requested, 0);
    assert.equal(await s.metric("pegaflow_query_blocks_total", '{result="hit"}'), hits);
    assert.equal(
      await s.metric("pegaflow_query_blocks_total", '{result="miss"}'),
      requested - hits,
    );
    assert.equal((await srcBlocks("ram")) + (await srcBlocks("ssd")), hits);
    assert.equal(await srcBlocks("ssd"), 6);
    assert.equal(await s.metric("pegaflow_cache_hits_total"), hits);
  } finally {
    if (eng.instanceId && srv) await srv.client.unregisterContext(eng.instanceId).catch(() => {});
    eng.close();
    await srv?.stop();
    await Deno.remove(dir, { recursive: true });
  }
});
