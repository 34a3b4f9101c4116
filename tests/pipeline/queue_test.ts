// Plain tests of BoundedQueue and Stage where promises read more clearly than marbles.
import {
  deepStrictEqual as assertEquals,
  ok as assert,
  strictEqual,
  throws,
} from "node:assert/strict";
import { firstValueFrom } from "rxjs";
import { BoundedQueue } from "../../lib/pipeline/queue.ts";
import { QueueClosedError, QueueFullError } from "../../lib/pipeline/errors.ts";
import { Stage } from "../../lib/pipeline/stage.ts";

function counter() {
  const c = { n: 0, inc: (v = 1) => void (c.n += v) };
  return c;
}

Deno.test("refuse: a full queue returns a QueueFullError naming the queue and its depth", () => {
  const refused = counter();
  const q = new BoundedQueue<number>({
    name: "save.gather",
    depth: 2,
    policy: "refuse",
    metrics: { refused },
  });
  strictEqual(q.offer(1).status, "queued");
  strictEqual(q.offer(2).status, "queued");
  const r = q.offer(3);
  assert(r.status === "refused");
  assert(r.error instanceof QueueFullError);
  strictEqual(r.error.code, "RESOURCE_EXHAUSTED");
  strictEqual(r.error.queue, "save.gather");
  strictEqual(r.error.depth, 2);
  strictEqual(refused.n, 1);
  assertEquals([q.take(), q.take(), q.take()], [1, 2, undefined]);
});

Deno.test("drop-newest and drop-oldest count every drop and hand the dropped item to onDrop", () => {
  const droppedNew: number[] = [];
  const dn = counter();
  const qn = new BoundedQueue<number>({
    name: "n",
    depth: 1,
    policy: "drop-newest",
    metrics: { dropped: dn },
    onDrop: (x) => droppedNew.push(x),
  });
  qn.offer(1);
  assertEquals(qn.offer(2), { status: "dropped", item: 2 });
  assertEquals(qn.offer(3), { status: "dropped", item: 3 });
  assertEquals([droppedNew, dn.n, qn.take()], [[2, 3], 2, 1]);

  const droppedOld: number[] = [];
  const dold = counter();
  const qo = new BoundedQueue<number>({
    name: "o",
    depth: 2,
    policy: "drop-oldest",
    metrics: { dropped: dold },
    onDrop: (x) => droppedOld.push(x),
  });
  qo.offer(1);
  qo.offer(2);
  assertEquals(qo.offer(3), { status: "queued", dropped: 1 });
  assertEquals([droppedOld, dold.n, qo.take(), qo.take()], [[1], 1, 2, 3]);
  strictEqual(qo.stats().dropped, 1);
});

Deno.test("wait: put resolves only when a take frees a place, in FIFO order", async () => {
  const q = new BoundedQueue<string>({ name: "w", depth: 1, policy: "wait", maxWaiters: 2 });
  await q.put("a");
  let bIn = false;
  const b = q.put("b").then((r) => (bIn = true, r));
  const c = q.put("c");
  await Promise.resolve();
  strictEqual(bIn, false);
  strictEqual(q.waiting, 2);
  strictEqual(q.offer("d").status, "refused"); // waiter list full
  strictEqual(q.take(), "a");
  assertEquals(await b, { status: "queued" });
  strictEqual(q.take(), "b");
  assertEquals(await c, { status: "queued" });
  strictEqual(q.take(), "c");
  strictEqual(q.size, 0);
});

Deno.test("close refuses new offers; parked waiters still enter unless cancelled", async () => {
  const q = new BoundedQueue<number>({ name: "c", depth: 1, policy: "wait", maxWaiters: 2 });
  q.offer(1);
  const w1 = q.offer(2);
  assert(w1.status === "waiting");
  q.close();
  const r = q.offer(3);
  assert(r.status === "refused" && r.error instanceof QueueClosedError);
  strictEqual(r.error.code, "UNAVAILABLE");
  strictEqual(q.take(), 1);
  assertEquals(await firstValueFrom(w1.ready), { status: "queued" });

  const q2 = new BoundedQueue<number>({ name: "c2", depth: 1, policy: "wait" });
  q2.offer(1);
  const w2 = q2.offer(2);
  assert(w2.status === "waiting");
  strictEqual(q2.cancelWaiters(), 1);
  const res = await firstValueFrom(w2.ready);
  assert(res.status === "refused" && res.error instanceof QueueClosedError);
  strictEqual(q2.take(), 1);
  strictEqual(q2.take(), undefined);
});

Deno.test("bad queue and stage settings are refused with the name and the value", () => {
  throws(() => new BoundedQueue({ name: "x", depth: 0, policy: "refuse" }), /"x".*got 0/);
  throws(
    () =>
      new Stage(
        "s",
        { concurrency: 0, queue: { depth: 1, policy: "refuse" } },
        () => Promise.resolve(1),
      ),
    /"s".*got 0/,
  );
  const q = new BoundedQueue<number | undefined>({ name: "u", depth: 1, policy: "refuse" });
  throws(() => q.offer(undefined), TypeError);
});

Deno.test("Stage with promise workers: results per item, a rejection fails only its item", async () => {
  let running = 0;
  let peak = 0;
  const s = new Stage<number, number>(
    "sq",
    { concurrency: 2, queue: { depth: 8, policy: "refuse" } },
    async (x) => {
      running++;
      peak = Math.max(peak, running);
      await new Promise((r) => setTimeout(r, 1));
      running--;
      if (x === 3) throw new Error("three is bad");
      return x * x;
    },
  );
  const subs = [1, 2, 3, 4, 5].map((x) => s.submit(x));
  assert(subs.every((x) => x.status === "accepted"));
  const outs = await Promise.all(subs.map((x) => x.done()));
  assertEquals(
    outs.map((o) => o.status === "done" ? o.value : o.status),
    [1, 4, "failed", 16, 25],
  );
  strictEqual(peak, 2);
  await s.drain();
  const st = s.stats();
  assertEquals([st.completed, st.failed, st.inflight, st.maxInflight], [4, 1, 0, 2]);
});

Deno.test("Stage refuse: the submission says refused at once and its outcome carries the error", async () => {
  let release!: () => void;
  const gate = new Promise<void>((r) => (release = r));
  const s = new Stage<number, number>(
    "g",
    { concurrency: 1, queue: { depth: 1, policy: "refuse" } },
    async (x) => {
      await gate;
      return x;
    },
  );
  strictEqual(s.submit(1).status, "accepted"); // running
  strictEqual(s.submit(2).status, "accepted"); // queued
  const third = s.submit(3);
  strictEqual(third.status, "refused");
  const o = await third.done();
  assert(o.status === "refused" && o.error instanceof QueueFullError);
  release();
  await s.drain();
  strictEqual(s.stats().completed, 2);
});

Deno.test("Stage wait chains backpressure: upstream holds its credit until downstream admits", async () => {
  let releaseDown!: () => void;
  const downGate = new Promise<void>((r) => (releaseDown = r));
  const down = new Stage<number, number>(
    "down",
    { concurrency: 1, queue: { depth: 1, policy: "wait", maxWaiters: 4 } },
    async (x) => {
      await downGate;
      return x;
    },
  );
  const admitted: number[] = [];
  const up = new Stage<number, number>(
    "up",
    { concurrency: 1, queue: { depth: 4, policy: "refuse" } },
    async (x) => {
      // Keep this stage's only credit until `down` has room for the item.
      if (await firstValueFrom(down.submit(x).admission)) admitted.push(x);
      return x;
    },
  );
  const ups = [1, 2, 3, 4].map((x) => up.submit(x));
  await new Promise((r) => setTimeout(r, 5));
  // down runs 1 and queues 2; 3 is parked in down, so up is stuck on 3 with 4 still queued in up.
  assertEquals(admitted, [1, 2]);
  assertEquals([down.inflight, down.queued, up.inflight, up.queued], [1, 1, 1, 1]);
  releaseDown();
  await Promise.all(ups.map((u) => u.done()));
  await up.drain();
  await down.drain();
  assertEquals(admitted, [1, 2, 3, 4]);
  strictEqual(down.stats().completed, 4);
});

Deno.test("abort fails queued and running items with the reason and drains", async () => {
  const s = new Stage<number, number>(
    "ab",
    { concurrency: 1, queue: { depth: 4, policy: "refuse" } },
    () => new Promise<number>(() => {}), // never settles
  );
  const a = s.submit(1);
  const b = s.submit(2);
  s.abort(new Error("shutdown"));
  const [oa, ob] = await Promise.all([a.done(), b.done()]);
  assert(oa.status === "failed" && (oa.error as Error).message === "shutdown");
  assert(ob.status === "failed" && (ob.error as Error).message === "shutdown");
  await s.drain();
  strictEqual(s.inflight, 0);
});
