// Adversarial checks of the pipeline's outcome contract (review).
import { deepStrictEqual as assertEquals, ok as assert, strictEqual } from "node:assert/strict";
import { firstValueFrom, Observable, of, range, take, toArray } from "rxjs";
import { stage } from "../../lib/pipeline/stage.ts";

Deno.test("a consumer that unsubscribes stops a synchronous source: no worker runs after", async () => {
  let calls = 0;
  let emitted = 0;
  const src = new Observable<number>((s) => {
    for (let i = 0; i < 10_000 && !s.closed; i++) {
      emitted++;
      s.next(i);
    }
    s.complete();
  });
  const out = await firstValueFrom(
    src.pipe(
      stage("sync", { concurrency: 1, queue: { depth: 1, policy: "refuse" } }, (x) => {
        calls++;
        return of(x);
      }),
      take(1),
      toArray(),
    ),
  );
  strictEqual(out.length, 1);
  assert(emitted <= 2, `the source went on emitting ${emitted} values after the consumer left`);
  assert(calls <= 1, `the worker ran ${calls} times after the consumer left`);
});

Deno.test("an endless synchronous source ends when the consumer takes what it needs", async () => {
  const out = await firstValueFrom(
    range(0, Number.MAX_SAFE_INTEGER).pipe(
      stage(
        "endless",
        { concurrency: 2, queue: { depth: 2, policy: "drop-newest" } },
        (x) => of(x),
      ),
      take(3),
      toArray(),
    ),
  );
  assertEquals(out.map((o) => o.status), ["done", "done", "done"]);
});

Deno.test("unsubscribing mid-flight tears down running Observable workers (no timer left)", () => {
  let tornDown = 0;
  const worker = (x: number) =>
    new Observable<number>((s) => {
      const t = setTimeout(() => (s.next(x), s.complete()), 60_000);
      return () => (clearTimeout(t), tornDown++);
    });
  const sub = range(0, 5).pipe(
    stage("td", { concurrency: 2, queue: { depth: 4, policy: "refuse" } }, worker),
  ).subscribe();
  sub.unsubscribe();
  strictEqual(tornDown, 2);
  // Deno's op/timer sanitizers fail this test if a worker's timer outlived the teardown.
});
