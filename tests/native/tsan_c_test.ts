/**
 * Data races in the C library, found by ThreadSanitizer: the programs in
 * `tests/native/c/` named here are built with `-fsanitize=thread` against
 * `csrc/` and must exit 0 (TSan fails them with exit 66 at the first race
 * it reports). Each one failed on the code before its fix (docs/native.md).
 */
import assert from "node:assert/strict";
import { build, objects, run } from "./_sanitized_c.ts";

Deno.test("C data races: a peer's state read while it connects reads the remote pool's size only once connected", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-tsan-" });
  try {
    const objs = await objects(dir, "thread");
    const state = await build(dir, objs, "xfer_state_race", [], "thread");
    const out = await run(state, [], "xfer_state_race");
    assert.doesNotMatch(out, /ThreadSanitizer/);
    assert.match(out, /connect: 0; state: connected 1, remote_bytes 1048576/);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
