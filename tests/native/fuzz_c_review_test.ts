/**
 * The batch entry points under a seeded fuzz: `tests/native/c/fuzz_descriptors.c`
 * feeds pf_copy_submit, pf_io_submit, pf_pool_crc32c, pf_pool_checksums and
 * pf_xfer_submit random bytes and valid descriptors with one field broken,
 * and the text/struct calls (file paths, region handles, peer addresses, a
 * listener that stalls mid-hello, ring waits) bad input, on the host backend
 * with a uring over a temp file and a TCP endpoint pair on loopback. Built
 * with AddressSanitizer, UBSan and LeakSanitizer against `csrc/` (as
 * races_c_test.ts builds its programs); every seed must exit 0: each
 * malformed call refused with a PF_E* and no completion record, valid batches
 * byte-exact afterwards, every object closed, nothing leaked.
 */
import assert from "node:assert/strict";
import { build, objects, run } from "./_sanitized_c.ts";

/** Seeds run by every test run (fixed: a failure names its seed and case and replays). */
const SEEDS = ["1", "0x5eed", "20240611"];
const ROUNDS = "2000";

Deno.test("C fuzz: every malformed batch, path, handle and address is refused with a PF_E* and no completion, a stalled hello times out, and valid batches still move exact bytes", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-fuzz-" });
  try {
    const exe = await build(dir, await objects(dir), "fuzz_descriptors");
    for (const seed of SEEDS) {
      const out = await run(exe, [seed, ROUNDS, dir], `fuzz_descriptors seed ${seed}`, true);
      assert.match(out, new RegExp(`^fuzz seed ${seed}: ${ROUNDS} rounds, \\d+ refused`, "m"));
      assert.match(out, /every object closed/);
    }
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
