/**
 * intArg (lib/cli/flags.ts): the one parser of every integer flag, so each
 * refusal names the flag and the range the same way.
 */
import assert from "node:assert/strict";
import { InvalidArgumentError } from "commander";
import { intArg } from "../../lib/cli/flags.ts";

Deno.test("an integer flag takes whole numbers in its range, ends included, spaces trimmed", () => {
  const parse = intArg("--xfer-streams", 1, 64);
  assert.deepEqual(["1", "64", " 7 ", "007"].map(parse), [1, 64, 7, 7]);
});

Deno.test("an integer flag refuses signs, fractions, exponents and values out of range, naming flag and range", () => {
  const parse = intArg("--xfer-streams", 1, 64);
  for (
    const bad of ["0", "65", "-1", "+3", "1.5", "1e3", "0x10", "", "ten", "99999999999999999999"]
  ) {
    assert.throws(
      () => parse(bad),
      (e: unknown) =>
        e instanceof InvalidArgumentError &&
        e.message === `--xfer-streams must be an integer in 1..64, got "${bad}"`,
      `"${bad}" was accepted or refused with another message`,
    );
  }
});
