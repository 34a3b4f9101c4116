// The tiers below RAM as the engine sees them (LowerTiers), over the real
// KvStore and scripted Tier implementations: the tier.admit stage's
// overflow policy (marbles and a real burst), the query walk (RAM prefix,
// tiers in order, polls), the registration check's data, and shutdown.
import { deepStrictEqual as assertEquals, ok as assert, strictEqual } from "node:assert/strict";
import { map, timer } from "rxjs";
import { TestScheduler } from "rxjs/testing";
import { stage } from "../../lib/pipeline/stage.ts";
import { admitStageOptions, LowerTiers } from "../../lib/storage/lower_tiers.ts";
import type {
  StoredLayout,
  Tier,
  TierBlocks,
  TierHealth,
  TierMissReason,
  TierPrefetchAnswer,
  TierPutResult,
  TierTakeAnswer,
} from "../../lib/storage/tier.ts";
import { hashHex } from "../../lib/storage/keys.ts";
import { blockLayoutIdentity } from "../../lib/storage/layout.ts";
import { makeStore, NS, SMALL } from "./helpers.ts";

const bytes = (i: number) => new Uint8Array([0x7e, i]);

/** A tier that holds what it was told to, answers as scripted, and records every call. */
class ScriptedTier implements Tier {
  readonly label: string;
  puts: TierBlocks[] = [];
  prefetches: { requestId: string; hashes: string[] }[] = [];
  /** Request ids with a fetch; `true` while it runs (end one with {@link ScriptedTier.end}). */
  fetching = new Map<string, boolean>();
  /** Resolvers of the `settled` promises handed out, by request id. */
  #ends = new Map<string, (() => void)[]>();
  miss: TierMissReason | undefined;
  closed = false;
  constructor(readonly name: string, readonly held: Set<string> = new Set()) {
    this.label = name.toUpperCase();
  }
  has(b: TierBlocks): number {
    let n = 0;
    while (n < b.hashes.length && this.held.has(hashHex(b.hashes[n]))) n++;
    return n;
  }
  put(b: TierBlocks): TierPutResult {
    this.puts.push(b);
    return { status: "queued", blocks: b.hashes.length, duplicates: 0 };
  }
  prefetch(requestId: string, b: TierBlocks): TierPrefetchAnswer {
    this.prefetches.push({ requestId, hashes: b.hashes.map((h) => hashHex(h)) });
    if (this.miss) return { state: "miss", reason: this.miss };
    if (this.has(b) === 0) return { state: "miss", reason: "not-held" };
    this.fetching.set(requestId, true);
    return { state: "loading" };
  }
  /** The fetch of `requestId` ended: `take` answers ready, `settled` promises resolve. */
  end(requestId: string): void {
    this.fetching.set(requestId, false);
    for (const r of this.#ends.get(requestId) ?? []) r();
    this.#ends.delete(requestId);
  }
  settled(requestId: string): Promise<void> | undefined {
    if (this.fetching.get(requestId) !== true) return undefined;
    return new Promise((r) => this.#ends.set(requestId, [...this.#ends.get(requestId) ?? [], r]));
  }
  take(requestId: string): TierTakeAnswer {
    const f = this.fetching.get(requestId);
    if (f === undefined) return { state: "none" };
    if (f) return { state: "loading" };
    this.fetching.delete(requestId);
    return { state: "ready" };
  }
  drop(): number {
    return 0;
  }
  storedLayouts(_namespace: string): StoredLayout[] {
    return [{ ...blockLayoutIdentity(SMALL), blocks: this.held.size }];
  }
  health(): TierHealth {
    return { state: this.closed ? "closed" : "up", capacityBytes: 1, usedBytes: 0, blocks: 0 };
  }
  flush(): Promise<void> {
    return Promise.resolve();
  }
  close(): Promise<void> {
    this.closed = true;
    return Promise.resolve();
  }
}

Deno.test("tier.admit stage: a burst past the worker and the queue drops the newest sealed batches at once", () => {
  new TestScheduler((a, b) => assertEquals(a, b)).run(({ cold, expectObservable }) => {
    // One batch with the worker, two queued; five sealed batches in one frame; 5 frames each.
    const sealed = cold("(abcde|)");
    const out = sealed.pipe(
      stage("tier.admit", admitStageOptions(2), (b: string) => timer(5).pipe(map(() => b))),
      map((o) => `${o.input}:${o.status}`),
    );
    expectObservable(out).toBe("(xy) 1ms z 4ms v 4ms (w|)", {
      x: "d:dropped",
      y: "e:dropped",
      z: "a:done",
      v: "b:done",
      w: "c:done",
    });
  });
});

Deno.test("sealed batches past the admit queue are dropped and counted and never reach a tier; the rest reach every tier", async () => {
  const { store } = makeStore(8);
  const ssd = new ScriptedTier("ssd"), peer = new ScriptedTier("peer");
  const tiers = new LowerTiers({ ram: store, tiers: [ssd, peer], admitQueueDepth: 1 });
  // The first runs at once and holds the one credit until its turn ends; one waits; one is dropped.
  const answers = [1, 2, 3].map((i) => tiers.sealed(NS, [bytes(i), bytes(i + 10)]));
  assertEquals(answers, ["queued", "queued", "dropped"]);
  strictEqual(tiers.stats().admitDropped, 1);
  strictEqual(tiers.stats().admitDroppedBlocks, 2);
  await tiers.flush();
  for (const t of [ssd, peer]) {
    assertEquals(t.puts.map((p) => p.hashes.map((h) => hashHex(h))), [
      [bytes(1), bytes(11)].map((h) => hashHex(h)),
      [bytes(2), bytes(12)].map((h) => hashHex(h)),
    ]);
    strictEqual(t.puts[0].namespace, NS);
    strictEqual(t.puts[0].layout.fingerprint, blockLayoutIdentity(SMALL).fingerprint);
  }
  strictEqual(tiers.sealed(NS, []), "none", "nothing sealed: nothing queued");
});

Deno.test("a query whose prefix is all in RAM asks no tier", () => {
  const { store } = makeStore(8);
  const ssd = new ScriptedTier("ssd", new Set([hashHex(bytes(1))]));
  const tiers = new LowerTiers({ ram: store, tiers: [ssd] });
  const b = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [bytes(1)] });
  assert(b.ok);
  store.completeSave(b.plan, true);
  strictEqual(tiers.beforeQuery(NS, "e", [bytes(1)], "r"), false);
  strictEqual(ssd.prefetches.length, 0);
  strictEqual(tiers.beforeQuery("no-such-namespace", "e", [bytes(1)], "r"), false);
});

Deno.test("a RAM miss asks the tiers in order with the hashes past RAM; a miss falls through to the next tier", () => {
  const { store } = makeStore(8);
  const ssd = new ScriptedTier("ssd");
  const peer = new ScriptedTier("peer", new Set([2, 3].map((i) => hashHex(bytes(i)))));
  const tiers = new LowerTiers({ ram: store, tiers: [ssd, peer] });
  const b = store.beginSave({ namespace: NS, instance: "e", rank: 0, hashes: [bytes(1)] });
  assert(b.ok);
  store.completeSave(b.plan, true);
  const hashes = [bytes(1), bytes(2), bytes(3)];
  strictEqual(tiers.beforeQuery(NS, "e", hashes, "r1"), true, "loading from the peer tier");
  const past = [bytes(2), bytes(3)].map((h) => hashHex(h));
  // A tier sees the request under its instance: "e:r1".
  assertEquals(ssd.prefetches, [{ requestId: "e:r1", hashes: past }]);
  assertEquals(peer.prefetches, [{ requestId: "e:r1", hashes: past }]);
  const q = tiers.stats().queries;
  strictEqual(q.ssd.miss["not-held"], 1);
  strictEqual(q.peer.loading, 1);
  // Every tier misses: RAM answers.
  peer.miss = "budget";
  strictEqual(tiers.beforeQuery(NS, "e", hashes, "r2"), false);
  strictEqual(tiers.stats().queries.peer.miss.budget, 1);
});

Deno.test("a request with a fetch in a tier is polled: loading while it runs, ready once, then RAM answers and nothing new starts", () => {
  const { store } = makeStore(8);
  const ssd = new ScriptedTier("ssd", new Set([hashHex(bytes(5))]));
  const tiers = new LowerTiers({ ram: store, tiers: [ssd] });
  strictEqual(tiers.beforeQuery(NS, "e", [bytes(5)], "r"), true);
  strictEqual(tiers.beforeQuery(NS, "e", [bytes(5)], "r"), true, "still loading");
  strictEqual(ssd.prefetches.length, 1, "a poll starts nothing");
  ssd.end("e:r"); // its reads ended
  strictEqual(tiers.beforeQuery(NS, "e", [bytes(5)], "r"), false, "ready: RAM answers");
  strictEqual(ssd.prefetches.length, 1, "ready does not start another fetch");
  strictEqual(tiers.stats().queries.ssd.ready, 1);
});

Deno.test("the layouts tiers keep a namespace under name where they are kept", () => {
  const { store } = makeStore(8);
  const tiers = new LowerTiers({
    ram: store,
    tiers: [new ScriptedTier("ssd", new Set(["01"]))],
  });
  assertEquals(tiers.storedLayouts(NS), [
    { ...blockLayoutIdentity(SMALL), blocks: 1, where: "SSD" },
  ]);
});

Deno.test("closing lets accepted sealed batches reach their tiers, then closes every tier", async () => {
  const { store } = makeStore(8);
  const ssd = new ScriptedTier("ssd");
  const tiers = new LowerTiers({ ram: store, tiers: [ssd], admitQueueDepth: 4 });
  tiers.sealed(NS, [bytes(1)]);
  tiers.sealed(NS, [bytes(2)]); // queued behind the first
  await tiers.close();
  strictEqual(ssd.puts.length, 2);
  strictEqual(ssd.closed, true);
  strictEqual(tiers.sealed(NS, [bytes(3)]), "dropped", "closed: nothing is admitted");
  await tiers.close(); // idempotent
});

Deno.test("two instances sending the same request id have their own fetches (a P/D pair's engines)", () => {
  const { store } = makeStore(8);
  const ssd = new ScriptedTier("ssd", new Set([hashHex(bytes(5))]));
  const tiers = new LowerTiers({ ram: store, tiers: [ssd] });
  strictEqual(tiers.beforeQuery(NS, "prefill", [bytes(5)], "req-7"), true);
  strictEqual(tiers.beforeQuery(NS, "decode", [bytes(5)], "req-7"), true);
  assertEquals(ssd.prefetches.map((p) => p.requestId), ["prefill:req-7", "decode:req-7"]);
  ssd.end("prefill:req-7");
  strictEqual(
    tiers.beforeQuery(NS, "prefill", [bytes(5)], "req-7"),
    false,
    "prefill's fetch ended",
  );
  strictEqual(tiers.beforeQuery(NS, "decode", [bytes(5)], "req-7"), true, "decode's still runs");
});

Deno.test("settled: resolves when the request's fetch ends (keyed by instance, like the polls), undefined when none runs; the query after it takes the ready", async () => {
  const { store } = makeStore(8);
  const ssd = new ScriptedTier("ssd", new Set([hashHex(bytes(5))]));
  const peer = new ScriptedTier("peer");
  const tiers = new LowerTiers({ ram: store, tiers: [ssd, peer] });
  strictEqual(tiers.settled("e", "r"), undefined, "nothing runs before the query");
  strictEqual(tiers.beforeQuery(NS, "e", [bytes(5)], "r"), true);
  strictEqual(tiers.settled("other", "r"), undefined, "another instance's request of that id");
  const s = tiers.settled("e", "r");
  assert(s instanceof Promise);
  let done = false;
  s.then(() => (done = true));
  await Promise.resolve();
  strictEqual(done, false, "still loading");
  ssd.end("e:r");
  await s;
  strictEqual(tiers.settled("e", "r"), undefined, "nothing runs any more");
  strictEqual(
    tiers.beforeQuery(NS, "e", [bytes(5)], "r"),
    false,
    "the next query answers from RAM",
  );
  strictEqual(
    tiers.stats().queries.ssd.ready,
    1,
    "settled forgot nothing: the query took the ready",
  );
});
