/**
 * A degraded SSD tier (an io batch past its stall deadline) behind the
 * `Tier` port, wired through `LowerTiers` and the tier metrics as the
 * server wires it: its health is `degraded` (not `closed`), a query's miss
 * is counted as `miss_degraded`, and /metrics says so
 * (`pegaflow_tier_degraded{tier="ssd"} 1`, `pegaflow_tier_up` 0); once the
 * io completes it is `up` again. The seam holds back the SSD's completion
 * records, as tests/ssd/stall_test.ts does.
 */
import assert from "node:assert/strict";
import { Registry } from "prom-client";
import { SsdStorageTier } from "../../lib/ssd/ssd_tier_port.ts";
import { LowerTiers } from "../../lib/storage/lower_tiers.ts";
import type { TierHost } from "../../lib/storage/tier.ts";
import { registerTierMetrics } from "../../lib/server/tier_metrics.ts";
import { makeStore, NS } from "../storage/helpers.ts";
import { harness, holdingRing, TEST_NAMESPACE, within } from "./_harness.ts";

const MiB = 1 << 20;
const BLOCK = 64 * 1024;

function sample(text: string, name: string, labels: string): number | undefined {
  const line = text.split("\n").find((l) => l.startsWith(`${name}${labels} `));
  return line === undefined ? undefined : Number(line.slice(line.lastIndexOf(" ") + 1));
}

async function until(cond: () => boolean, ms: number, what: string): Promise<void> {
  const end = performance.now() + ms;
  while (!cond()) {
    if (performance.now() > end) throw new Error(`${what} did not happen within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

Deno.test("a degraded SSD tier reads degraded, not closed: its health, its query misses (miss_degraded) and pegaflow_tier_degraded; up again once the io completes", async () => {
  const h = await harness();
  const { ring, held } = holdingRing(h.ring);
  const ssd = await h.openTier({ ring, capacityBytes: 8 * MiB, segmentBytes: MiB, ioStallMs: 200 });
  try {
    // Only payloadBytes is reached: a degraded tier misses before it plans pool space.
    const host = { payloadBytes: () => BLOCK } as unknown as TierHost;
    const port = new SsdStorageTier(ssd, host, h.log);
    const { store } = makeStore(8);
    const tiers = new LowerTiers({ ram: store, tiers: [port], log: h.log });
    const reg = new Registry();
    registerTierMetrics(reg, tiers);
    held.on = true;
    assert.equal(h.write(ssd, [h.block(`${TEST_NAMESPACE}/stuck`, 0, BLOCK)]).status, "queued");
    await until(() => ssd.degraded, 5_000, "the tier degrading");
    assert.equal(port.health().state, "degraded");
    assert.equal(tiers.beforeQuery(NS, "e", [new Uint8Array(16).fill(7)], "r1"), false);
    assert.equal(tiers.stats().queries.ssd.miss.degraded, 1);
    assert.equal(tiers.stats().queries.ssd.miss.closed, 0);
    let text = await reg.metrics();
    assert.equal(sample(text, "pegaflow_tier_degraded", '{tier="ssd"}'), 1, text);
    assert.equal(sample(text, "pegaflow_tier_up", '{tier="ssd"}'), 0, text);
    assert.equal(
      sample(text, "pegaflow_tier_queries_total", '{tier="ssd",answer="miss_degraded"}'),
      1,
      text,
    );
    held.release();
    await until(() => !ssd.degraded, 5_000, "the tier recovering");
    assert.equal(port.health().state, "up");
    text = await reg.metrics();
    assert.equal(sample(text, "pegaflow_tier_degraded", '{tier="ssd"}'), 0, text);
    assert.equal(sample(text, "pegaflow_tier_up", '{tier="ssd"}'), 1, text);
  } finally {
    held.release();
    await within(ssd.close(), 5_000, "tier.close");
    await h.close();
  }
});
