/**
 * The server's stop on a hung disk, in process: `SsdTier.open` is wrapped
 * so the tier gets the completion-holding seam of tests/ssd/stall_test.ts
 * (the SSD's completion records held back between the ring and the tier)
 * and short deadlines. A write whose io the kernel never completes makes
 * the SSD close give up; the stop must then leave the pool and the
 * completion ring to process exit (the engine still holds them), say so in
 * an error log naming the outstanding io, and end without throwing.
 */
import assert from "node:assert/strict";
import { SsdTier, type SsdTierOptions } from "../../lib/ssd/tier.ts";
import { Logger } from "../../lib/log.ts";
import { startServer } from "../../lib/server/server.ts";
import { inProcessSsdConfig } from "./_server.ts";
import { holdingRing, TEST_LAYOUT, TEST_NAMESPACE, within } from "./_harness.ts";

const BLOCK = 64 * 1024;

Deno.test("a stop whose SSD close gave up on a hung disk leaves the pool and ring to process exit, logged with the outstanding io, and resolves", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-stop-stall-" });
  let held: ReturnType<typeof holdingRing>["held"] | undefined;
  let tier: SsdTier | undefined;
  const open = SsdTier.open;
  SsdTier.open = (o: SsdTierOptions) => {
    const r = holdingRing(o.ring);
    held = r.held;
    return open({
      ...o,
      ring: r.ring,
      ioStallMs: 60_000,
      closeTimeoutMs: 300,
    }).then((t) => (tier = t));
  };
  const logs: string[] = [];
  const log = new Logger("debug", {}, (line) => logs.push(line));
  try {
    const server = await startServer(inProcessSsdConfig(dir), log);
    assert.ok(tier, "the server opened the SSD tier through the seam");
    held!.on = true;
    // A write the kernel never completes (its pool bytes are whatever the pool holds).
    const pinned = { released: 0 };
    const r = tier.enqueueWrite({
      blocks: [{ key: `${TEST_NAMESPACE}/stuck`, namespace: TEST_NAMESPACE, layout: TEST_LAYOUT }],
      pin: () => ({
        extents: [[{ offset: 0, bytes: BLOCK }]],
        release: () => pinned.released++,
      }),
    });
    assert.equal(r.status, "queued");
    await within(server.close(), 10_000, "the server's stop on a hung disk");
    const path = tier.files[0].path;
    assert.ok(logs.some((l) => l.includes("SSD close gave up")), logs.join("\n"));
    assert.ok(
      logs.some((l) =>
        l.includes('"level":"error"') && l.includes("pinned pool and completion ring left") &&
        l.includes(path) && l.includes("write of")
      ),
      logs.join("\n"),
    );
    assert.equal(pinned.released, 0, "the pin stays while the kernel may read its pages");
    assert.ok(tier.stillOpen(), "the engine was not closed under the kernel");
  } finally {
    SsdTier.open = open;
    await Deno.remove(dir, { recursive: true }).catch(() => {});
  }
});
