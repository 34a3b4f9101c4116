// Marble tests of the credit-bounded stage: each overflow policy does exactly
// what it says on a full queue, concurrency never exceeds its bound, the
// gauges report the depth, worker errors stay with their item, and completion
// drains what was accepted.
import { deepStrictEqual as assertEquals } from "node:assert/strict";
import { map, Observable, timer } from "rxjs";
import { TestScheduler } from "rxjs/testing";
import { stage, type StageOptions, type StageOutcome } from "../../lib/pipeline/stage.ts";
import type { OverflowPolicy } from "../../lib/pipeline/queue.ts";

function scheduler(): TestScheduler {
  return new TestScheduler((actual, expected) => assertEquals(actual, expected));
}

/** Renders an outcome as a short string so expectations read like marbles. */
function show(o: StageOutcome<string, string>): string {
  return o.status === "done" ? o.value : `${o.status}:${o.input}`;
}

/** A worker that takes `ms` of virtual time and upper-cases its input. */
function slowUpper(ms: number) {
  return (x: string) => timer(ms).pipe(map(() => x.toUpperCase()));
}

function opts(policy: OverflowPolicy, extra: Partial<StageOptions> = {}): StageOptions {
  return { concurrency: 1, queue: { depth: 1, policy }, ...extra };
}

Deno.test("refuse: a full queue turns the next item away at once and keeps the rest", () => {
  scheduler().run(({ cold, expectObservable }) => {
    // a runs 0→3, b waits in the queue (depth 1), c finds it full, d comes after space freed.
    const src = cold<string>("abc 5ms d|");
    const out = src.pipe(stage("t", opts("refuse"), slowUpper(3)), map(show));
    expectObservable(out).toBe("--xa--b----(d|)", {
      x: "refused:c",
      a: "A",
      b: "B",
      d: "D",
    });
  });
});

Deno.test("drop-newest: the offered item is dropped, queued ones survive", () => {
  scheduler().run(({ cold, expectObservable }) => {
    const src = cold<string>("abc 5ms d|");
    const out = src.pipe(stage("t", opts("drop-newest"), slowUpper(3)), map(show));
    expectObservable(out).toBe("--xa--b----(d|)", {
      x: "dropped:c",
      a: "A",
      b: "B",
      d: "D",
    });
  });
});

Deno.test("drop-oldest: the oldest queued item is pushed out for the new one", () => {
  scheduler().run(({ cold, expectObservable }) => {
    const src = cold<string>("abc 5ms d|");
    const out = src.pipe(stage("t", opts("drop-oldest"), slowUpper(3)), map(show));
    expectObservable(out).toBe("--xa--c----(d|)", {
      x: "dropped:b",
      a: "A",
      c: "C",
      d: "D",
    });
  });
});

Deno.test("wait: a parked item enters when space frees; past maxWaiters it is refused", () => {
  scheduler().run(({ cold, expectObservable }) => {
    // a 0→4, b queued, c parks (1 waiter allowed), d finds the waiter list full.
    const src = cold<string>("abcd|");
    const o = opts("wait");
    o.queue.maxWaiters = 1;
    const out = src.pipe(stage("t", o, slowUpper(4)), map(show));
    expectObservable(out).toBe("---xa---b---(c|)", {
      x: "refused:d",
      a: "A",
      b: "B",
      c: "C",
    });
  });
});

Deno.test("concurrency never exceeds the bound and the in-flight gauge shows it", () => {
  const inflight: number[] = [];
  const depth: number[] = [];
  scheduler().run(({ cold, expectObservable }) => {
    const src = cold<string>("(abcdefg|)");
    const out = src.pipe(
      stage("t", {
        concurrency: 3,
        queue: { depth: 10, policy: "refuse" },
        metrics: {
          inflight: { set: (v) => inflight.push(v) },
          depth: { set: (v) => depth.push(v) },
        },
      }, slowUpper(5)),
      map(show),
    );
    expectObservable(out).toBe("5ms (ABC)(DEF)(G|)", {
      A: "A",
      B: "B",
      C: "C",
      D: "D",
      E: "E",
      F: "F",
      G: "G",
    });
  });
  assertEquals(Math.max(...inflight), 3);
  assertEquals(inflight.at(-1), 0);
  // The first three are pulled as they arrive (a credit is free); the other four wait.
  assertEquals(Math.max(...depth), 4);
  assertEquals(depth.at(-1), 0);
});

Deno.test("the depth gauge reports every change of a full refusing queue", () => {
  const depth: number[] = [];
  scheduler().run(({ cold, expectObservable }) => {
    const src = cold<string>("abcd|");
    const out = src.pipe(
      stage("t", {
        concurrency: 1,
        queue: { depth: 2, policy: "refuse" },
        metrics: { depth: { set: (v) => depth.push(v) } },
      }, slowUpper(10)),
      map(show),
    );
    // a runs at once (depth 1 then 0), b and c fill the queue (1, 2), d refused.
    expectObservable(out).toBe("---x 6ms a 9ms b 9ms (c|)", {
      x: "refused:d",
      a: "A",
      b: "B",
      c: "C",
    });
  });
  assertEquals(depth, [0, 1, 0, 1, 2, 1, 0]);
});

Deno.test("a failing worker fails only its own item; the pipeline goes on", () => {
  scheduler().run(({ cold, expectObservable }) => {
    const src = cold<string>("a 4ms b 4ms c|");
    const worker = (x: string): Observable<string> => {
      if (x === "b") throw new Error("boom in b");
      if (x === "c") {
        return timer(1).pipe(map(() => {
          throw new Error("late boom in c");
        }));
      }
      return timer(1).pipe(map(() => x.toUpperCase()));
    };
    const out = src.pipe(
      stage("t", { concurrency: 1, queue: { depth: 4, policy: "refuse" } }, worker),
      map((o) => o.status === "failed" ? `failed:${(o.error as Error).message}` : show(o)),
    );
    expectObservable(out).toBe("-a 3ms b 5ms (c|)", {
      a: "A",
      b: "failed:boom in b",
      c: "failed:late boom in c",
    });
  });
});

Deno.test("completion drains: the output completes only after queued items finish", () => {
  scheduler().run(({ cold, expectObservable }) => {
    const src = cold<string>("(ab|)");
    const out = src.pipe(
      stage("t", { concurrency: 1, queue: { depth: 2, policy: "refuse" } }, slowUpper(4)),
      map(show),
    );
    expectObservable(out).toBe("4ms a 3ms (b|)", { a: "A", b: "B" });
  });
});

Deno.test("a worker that completes without a value fails its item", () => {
  scheduler().run(({ cold, expectObservable }) => {
    const src = cold<string>("a|");
    const out = src.pipe(
      stage("t", opts("refuse"), () => new Observable<string>((s) => s.complete())),
      map((o) => o.status),
    );
    expectObservable(out).toBe("f|", { f: "failed" });
  });
});
