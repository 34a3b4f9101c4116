/**
 * Races of the RDMA transport that need a thread stopped at one exact point:
 * `rdma_races.c` forces each interleaving by calling the transport's own
 * entry points in order, over `fake_ibverbs.c` (no device needed), built
 * here with ThreadSanitizer against `csrc/`. Each mode failed on the code
 * before its fix (docs/transfer.md, "RDMA: who ends a batch").
 */
import assert from "node:assert/strict";
import { build, objects, run } from "../native/_sanitized_c.ts";
import { buildFakeVerbs } from "./_fake_verbs.ts";

const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);

Deno.test("RDMA races: a late expire of an ended batch leaves the batch that took its slot and the peer alone; a peer's reason is whole when it is seen broken", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-rdma-races-" });
  try {
    const fake = await buildFakeVerbs(); // its own process loads it (rdma_races.c)
    const objs = await objects(dir, "thread");
    const exe = await build(
      dir,
      objs,
      "rdma_races",
      [],
      "thread",
      `${ROOT}tests/xfer/rdma_races.c`,
    );

    // Before: the late expire broke the peer (PF_ETIMEDOUT) and marked the
    // new batch as expiring, which then ended PF_ETIMEDOUT with nothing late.
    const stale = await run(exe, ["stale-expire", fake], "rdma_races stale-expire");
    assert.match(
      stale,
      /after a late expire of the ended batch: peer broken 0, new batch expiring 0/,
    );
    assert.match(stale, /new batch: ok 2, failed 0, timed out 0/);
    assert.match(stale, /closed/);

    // Before: the flag was set before the text was written (TSan: a data race
    // between qps_to_error's snprintf and pf_xfer_peer_error; the reader got "").
    const msg = await run(exe, ["broken-msg", fake], "rdma_races broken-msg");
    assert.doesNotMatch(msg, /ThreadSanitizer/);
    assert.match(
      msg,
      /peer broken -10: QPs moved to the error state \(batch tag 3 \(slot 0\) passed its 60000 ms deadline\); close the peer and reconnect/,
    );
    assert.match(msg, /closed/);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
