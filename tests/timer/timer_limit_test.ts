/**
 * lib/timer_limit.ts: the clamp of deadline timers and the races on them (`within`,
 * `withinOrThrow`), which the SSD tier, the HTTP stop, the block index, the local RPC client's
 * dial, the body reader and the socket probe share.
 */
import assert from "node:assert/strict";
import { LATE, MAX_TIMER_MS, timerDelay, within, withinOrThrow } from "../../lib/timer_limit.ts";

const never = () => new Promise<never>(() => {});
const after = <T>(ms: number, v: T) => new Promise<T>((r) => setTimeout(() => r(v), ms));

Deno.test("timerDelay clamps a deadline into what a timer can wait", () => {
  assert.equal(timerDelay(Infinity), MAX_TIMER_MS);
  assert.equal(timerDelay(-5), 0);
  assert.equal(timerDelay(250), 250);
});

Deno.test("within answers the promise's value, LATE past the deadline, and rethrows an early rejection", async () => {
  assert.equal(await within(Promise.resolve(7), 1_000), 7);
  assert.equal(await within(never(), 10), LATE);
  await assert.rejects(within(Promise.reject(new Error("boom")), 1_000), /boom/);
  // A deadline past what a timer can wait does not fire at once.
  assert.equal(await within(after(20, "v"), Infinity), "v");
});

Deno.test("withinOrThrow rejects with the caller's error when late, and leaves no timer behind", async () => {
  let made = 0;
  const late = () => (made++, new RangeError("no answer within 10 ms"));
  await assert.rejects(withinOrThrow(never(), 10, late), RangeError);
  assert.equal(made, 1);
  assert.equal(await withinOrThrow(after(5, "ok"), 1_000, late), "ok");
  await assert.rejects(
    withinOrThrow(Promise.reject(new TypeError("first")), 1_000, late),
    TypeError,
  );
  assert.equal(made, 1, "the late error is made only when the deadline came first");
  // Deno's test sanitizer fails this test if a timer of the 1 s deadlines above were left running.
});
