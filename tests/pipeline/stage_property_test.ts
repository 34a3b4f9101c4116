// Random arrival times, worker durations, failures, depths, concurrencies and
// policies, run in virtual time: every item gets exactly one outcome, the
// bounds hold at every instant, each policy does only what it states, and
// the output completes.
import { deepStrictEqual as assertEquals, ok as assert, strictEqual } from "node:assert/strict";
import fc from "fast-check";
import { map, merge, type Observable, timer } from "rxjs";
import { TestScheduler } from "rxjs/testing";
import { stage, type StageOutcome } from "../../lib/pipeline/stage.ts";
import type { OverflowPolicy } from "../../lib/pipeline/queue.ts";

interface Item {
  id: number;
  at: number;
  work: number;
  fail: boolean;
}

const itemsArb = fc.array(
  fc.record({ at: fc.nat(30), work: fc.integer({ min: 1, max: 8 }), fail: fc.boolean() }),
  { minLength: 1, maxLength: 40 },
);

Deno.test("property: bounds hold and every item gets exactly one outcome under every policy", () => {
  fc.assert(
    fc.property(
      itemsArb,
      fc.constantFrom<OverflowPolicy>("refuse", "drop-newest", "drop-oldest", "wait"),
      fc.integer({ min: 1, max: 4 }),
      fc.integer({ min: 1, max: 4 }),
      fc.integer({ min: 0, max: 3 }),
      (raw, policy, depth, concurrency, maxWaiters) => {
        const items: Item[] = raw.map((r, id) => ({ id, ...r }));
        let running = 0;
        let peakRunning = 0;
        let peakDepth = 0;
        let peakWaiters = 0;
        const outcomes: StageOutcome<Item, number>[] = [];
        let completed = false;
        const scheduler = new TestScheduler((a, b) => assertEquals(a, b));
        scheduler.run(({ flush }) => {
          const source: Observable<Item> = merge(
            ...items.map((it) => timer(it.at).pipe(map(() => it))),
          );
          const worker = (it: Item) => {
            running++;
            peakRunning = Math.max(peakRunning, running);
            return timer(it.work).pipe(map(() => {
              running--;
              if (it.fail) throw new Error(`item ${it.id} failed`);
              return it.id;
            }));
          };
          source.pipe(
            stage("p", {
              concurrency,
              queue: { depth, policy, maxWaiters },
              metrics: {
                depth: { set: (v) => (peakDepth = Math.max(peakDepth, v)) },
                waiters: { set: (v) => (peakWaiters = Math.max(peakWaiters, v)) },
              },
            }, worker),
          ).subscribe({ next: (o) => outcomes.push(o), complete: () => (completed = true) });
          flush();
        });
        assert(completed, "the output completes after the source and the drain");
        // Exactly one outcome per item.
        assertEquals(
          outcomes.map((o) => o.input.id).sort((a, b) => a - b),
          items.map((it) => it.id),
        );
        assert(peakRunning <= concurrency, `ran ${peakRunning} > ${concurrency}`);
        assert(peakDepth <= depth, `queue held ${peakDepth} > ${depth}`);
        assert(peakWaiters <= (policy === "wait" ? maxWaiters : 0));
        const count = (s: string) => outcomes.filter((o) => o.status === s).length;
        // Each policy only does what it states.
        if (policy !== "drop-newest" && policy !== "drop-oldest") strictEqual(count("dropped"), 0);
        if (policy !== "refuse" && policy !== "wait") strictEqual(count("refused"), 0);
        for (const o of outcomes) {
          if (o.status === "done") strictEqual(o.value, o.input.id);
          if (o.status === "failed") assert(o.input.fail);
          if (o.status === "done") assert(!o.input.fail);
        }
        // Nothing is refused or dropped unless the stage was saturated: with room for
        // every item at once, all of them run.
        if (items.length <= depth + concurrency) {
          strictEqual(count("done") + count("failed"), items.length);
        }
      },
    ),
    { numRuns: 300 },
  );
});
