// Random interleavings of save / complete / query / consume / load / release /
// lock / unlock / clock / collect / unregister / evict against the store (one
// pool, or one split in two NUMA parts that saves name), checked after every
// step against a small model and the store's own invariant check:
// - a leased, loading, locked or in-flight-copy block is never evicted or freed;
// - an unsealed (half-saved) block is never served;
// - pool extents never overlap and never leak: after everything ends and is
//   evicted, free bytes == capacity.
import { deepStrictEqual as assertEquals, ok as assert, strictEqual } from "node:assert/strict";
import fc from "fast-check";
import { LeaseError } from "../../lib/storage/errors.ts";
import { KvStore, type LoadTicket, type SavePlan } from "../../lib/storage/store.ts";
import { FakeClock, h } from "./helpers.ts";

const NAMESPACES = ["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"];
/** TP=2 so half-saved blocks exist; two segment sizes so holes of different sizes mix. */
const LAYOUTS = [
  { layers: 2, tpSize: 2, collapseTp: false, segments: 2, segmentBytes: 4096 },
  { layers: 1, tpSize: 2, collapseTp: false, segments: 1, segmentBytes: 12288 },
];
const UNIVERSE = 10; // distinct hashes per namespace
const INSTANCES = ["e1", "e2"];
const WORLD = 2;

const opArb = fc.oneof(
  {
    weight: 5,
    arbitrary: fc.record({
      op: fc.constant("begin" as const),
      ns: fc.nat(1),
      start: fc.nat(UNIVERSE - 1),
      len: fc.integer({ min: 1, max: 5 }),
      rank: fc.nat(1),
      inst: fc.nat(1),
      part: fc.nat(1),
    }),
  },
  {
    weight: 3,
    arbitrary: fc.record({
      op: fc.constant("saveBoth" as const),
      ns: fc.nat(1),
      start: fc.nat(UNIVERSE - 1),
      len: fc.integer({ min: 1, max: 5 }),
      inst: fc.nat(1),
      part: fc.nat(1),
    }),
  },
  {
    weight: 2,
    arbitrary: fc.record({
      op: fc.constant("fill" as const),
      ns: fc.nat(1),
      start: fc.nat(UNIVERSE - 1),
      len: fc.integer({ min: 1, max: 4 }),
      peer: fc.boolean(),
    }),
  },
  {
    weight: 5,
    arbitrary: fc.record({
      op: fc.constant("complete" as const),
      pick: fc.nat(),
      // "even": per block, only the plan's even-numbered blocks copied OK (a fill verified block by block).
      ok: fc.constantFrom(true, false, "even" as const),
    }),
  },
  {
    weight: 4,
    arbitrary: fc.record({
      op: fc.constant("query" as const),
      ns: fc.nat(1),
      start: fc.nat(UNIVERSE - 1),
      len: fc.integer({ min: 1, max: 6 }),
      inst: fc.nat(1),
    }),
  },
  {
    weight: 3,
    arbitrary: fc.record({
      op: fc.constant("consume" as const),
      pick: fc.nat(),
      rank: fc.nat(WORLD - 1),
    }),
  },
  { weight: 3, arbitrary: fc.record({ op: fc.constant("loadDone" as const), pick: fc.nat() }) },
  { weight: 2, arbitrary: fc.record({ op: fc.constant("release" as const), pick: fc.nat() }) },
  {
    weight: 2,
    arbitrary: fc.record({
      op: fc.constant("tick" as const),
      ms: fc.oneof(fc.integer({ min: 0, max: 60_000 }), fc.integer({ min: 200_000, max: 700_000 })),
    }),
  },
  {
    weight: 2,
    arbitrary: fc.record({
      op: fc.constant("lock" as const),
      ns: fc.nat(1),
      start: fc.nat(UNIVERSE - 1),
      len: fc.integer({ min: 1, max: 4 }),
      inst: fc.nat(1),
    }),
  },
  { weight: 2, arbitrary: fc.record({ op: fc.constant("unlock" as const), pick: fc.nat() }) },
  { weight: 1, arbitrary: fc.record({ op: fc.constant("drop" as const), inst: fc.nat(1) }) },
  { weight: 1, arbitrary: fc.record({ op: fc.constant("evictAll" as const) }) },
);

interface LiveLease {
  id: string;
  inst: string;
  keys: string[];
  expiresAt: number;
  consumed: Set<number>;
}

type Op = typeof opArb extends fc.Arbitrary<infer T> ? T : never;

let coverage: ((s: ReturnType<KvStore["stats"]>) => void) | undefined;

function run(ops: Op[], capacityBlocks: number, lfu: boolean, split: boolean): void {
  const clock = new FakeClock();
  const store = new KvStore({
    capacityBytes: capacityBlocks * 32 * 1024,
    // Two NUMA parts: saves name one; eviction frees victims of both as runs.
    parts: split
      ? [Math.floor(capacityBlocks / 2) * 32 * 1024, Math.ceil(capacityBlocks / 2) * 32 * 1024]
      : undefined,
    clock: clock.read,
    lfuCapacityBlocks: lfu ? 32 : undefined,
  });
  NAMESPACES.forEach((ns, i) => store.defineNamespace(ns, LAYOUTS[i]));
  const plans: { plan: SavePlan; keys: string[] }[] = [];
  const leases: LiveLease[] = [];
  const tickets: { t: LoadTicket; keys: string[] }[] = [];
  const locks: LiveLease[] = [];
  /** Model: ranks whose slots of a block completed OK since it last existed. */
  const done = new Map<string, Set<number>>();
  const keyOf = (ns: number, i: number) => `${NAMESPACES[ns]}:${h(i % UNIVERSE)}`;
  const state = (key: string) => {
    const [ns, hash] = key.split(":");
    return store.blockState(ns, hash);
  };
  const live = (l: LiveLease) => clock.now < l.expiresAt;

  for (const o of ops) {
    switch (o.op) {
      case "begin": {
        const hashes = Array.from({ length: o.len }, (_, k) => h((o.start + k) % UNIVERSE));
        const r = store.beginSave({
          namespace: NAMESPACES[o.ns],
          instance: INSTANCES[o.inst],
          rank: o.rank,
          hashes,
          poolPart: o.part,
        });
        if (r.ok) {
          plans.push({
            plan: r.plan,
            keys: [...r.plan.hashIndex].map((i) => keyOf(o.ns, o.start + i)),
          });
        } else strictEqual(r.error.code, "RESOURCE_EXHAUSTED");
        break;
      }
      case "saveBoth": {
        // Both TP ranks save and complete at once: the common, sealing case.
        const hashes = Array.from({ length: o.len }, (_, k) => h((o.start + k) % UNIVERSE));
        for (const rank of [0, 1]) {
          const r = store.beginSave({
            namespace: NAMESPACES[o.ns],
            instance: INSTANCES[o.inst],
            rank,
            hashes,
            poolPart: o.part,
          });
          if (!r.ok) continue;
          store.completeSave(r.plan, true);
          for (const i of r.plan.hashIndex) {
            const k = keyOf(o.ns, o.start + i);
            if (!done.has(k)) done.set(k, new Set());
            done.get(k)!.add(rank);
          }
        }
        break;
      }
      case "fill": {
        // SSD prefetch or peer fetch: whole blocks, completed later like a save.
        const hashes = Array.from({ length: o.len }, (_, k) => h((o.start + k) % UNIVERSE));
        const r = store.beginFill({
          namespace: NAMESPACES[o.ns],
          instance: o.peer ? "peer" : "ssd",
          hashes,
          cacheClass: o.peer ? "reclaimable" : "retained",
        });
        if (r.ok) {
          plans.push({
            plan: r.plan,
            keys: [...r.plan.hashIndex].map((i) => keyOf(o.ns, o.start + i)),
          });
        }
        break;
      }
      case "complete": {
        if (plans.length === 0) break;
        const [{ plan, keys }] = plans.splice(o.pick % plans.length, 1);
        const blockOk = (b: number) => o.ok === true || (o.ok === "even" && b % 2 === 0);
        store.completeSave(plan, o.ok === "even" ? blockOk : o.ok);
        if (o.ok) {
          // Which ranks this plan wrote for each block: the slots it did not skip.
          const n = plan.blockCount;
          keys.forEach((k, b) => {
            if (!blockOk(b)) return;
            if (!done.has(k)) done.set(k, new Set());
            plan.rankSlots.forEach((r, ri) => {
              if (plan.offsets[ri * plan.segments * n + b] !== -1) done.get(k)!.add(r);
            });
          });
        }
        break;
      }
      case "query": {
        const hashes = Array.from({ length: o.len }, (_, k) => h((o.start + k) % UNIVERSE));
        const q = store.query(NAMESPACES[o.ns], hashes, INSTANCES[o.inst], WORLD);
        const keys = hashes.slice(0, q.hits).map((x) => `${NAMESPACES[o.ns]}:${x}`);
        // Never serve an unsealed block: every hit had all TP ranks complete.
        for (const k of keys) {
          strictEqual(done.get(k)?.size, 2, `served ${k} with ranks ${[...(done.get(k) ?? [])]}`);
        }
        if (q.lease) {
          leases.push({
            id: q.lease.id,
            inst: INSTANCES[o.inst],
            keys,
            expiresAt: q.lease.expiresAt,
            consumed: new Set(),
          });
        }
        break;
      }
      case "consume": {
        if (leases.length === 0) break;
        const l = leases[o.pick % leases.length];
        const expectOk = live(l) && !l.consumed.has(o.rank);
        try {
          const t = store.consumeLease(l.id, l.inst, o.rank);
          assert(expectOk, "a used-up or expired lease was honoured");
          l.consumed.add(o.rank);
          assertEquals(t.hashes, l.keys.map((k) => k.split(":")[1]));
          tickets.push({ t, keys: l.keys });
          if (l.consumed.size === WORLD) leases.splice(leases.indexOf(l), 1);
        } catch (e) {
          if (!(e instanceof LeaseError)) throw e;
          assert(!expectOk, `a live lease was refused: ${e.message}`);
          if (!live(l)) leases.splice(leases.indexOf(l), 1);
        }
        break;
      }
      case "loadDone": {
        if (tickets.length === 0) break;
        const [{ t }] = tickets.splice(o.pick % tickets.length, 1);
        store.loadDone(t);
        break;
      }
      case "release": {
        if (leases.length === 0) break;
        const [l] = leases.splice(o.pick % leases.length, 1);
        try {
          store.releaseLease(l.id);
          assert(live(l), "an expired lease was released");
        } catch (e) {
          if (!(e instanceof LeaseError)) throw e;
          assert(!live(l), "a live lease could not be released");
        }
        break;
      }
      case "lock": {
        // A transfer lock (SSD writer, peer read) pins the sealed subset until released or expired.
        const hashes = Array.from({ length: o.len }, (_, k) => h((o.start + k) % UNIVERSE));
        const lock = store.lockForTransfer(NAMESPACES[o.ns], hashes, INSTANCES[o.inst]);
        if (lock) {
          const keys = [...lock.found].map((i) => `${NAMESPACES[o.ns]}:${hashes[i]}`);
          for (const k of keys) strictEqual(state(k), "sealed", `locked ${k} is not sealed`);
          locks.push({
            id: lock.id,
            inst: INSTANCES[o.inst],
            keys,
            expiresAt: lock.expiresAt,
            consumed: new Set(),
          });
        }
        break;
      }
      case "unlock": {
        if (locks.length === 0) break;
        const [l] = locks.splice(o.pick % locks.length, 1);
        try {
          store.releaseTransferLock(l.id);
          assert(live(l), "an expired transfer lock was released");
        } catch (e) {
          if (!(e instanceof LeaseError)) throw e;
          assert(!live(l), "a live transfer lock could not be released");
        }
        break;
      }
      case "tick":
        clock.tick(o.ms);
        store.collect();
        break;
      case "drop": {
        store.dropInstance(INSTANCES[o.inst]);
        for (const held of [leases, locks]) {
          for (let i = held.length - 1; i >= 0; i--) {
            if (held[i].inst === INSTANCES[o.inst]) held.splice(i, 1);
          }
        }
        break;
      }
      case "evictAll":
        store.evictAll();
        break;
    }
    // Forget blocks the store dropped (evicted, collected, failed), then check.
    for (const k of [...done.keys()]) if (state(k) === "absent") done.delete(k);
    store.verify();
    for (const l of [...leases, ...locks]) {
      if (live(l)) {
        for (const k of l.keys) strictEqual(state(k), "sealed", `leased or locked ${k} was freed`);
      }
    }
    for (const { keys } of tickets) {
      for (const k of keys) strictEqual(state(k), "sealed", `loading ${k} was freed`);
    }
    for (const { keys } of plans) {
      for (const k of keys) strictEqual(state(k), "inflight", `copy target ${k} was freed`);
    }
    for (const k of done.keys()) {
      if (state(k) === "sealed") {
        strictEqual(done.get(k)!.size, 2, `${k} sealed with a rank missing`);
      }
    }
  }

  coverage?.(store.stats());
  // Wind down: every plan and load ends, every lease goes, everything is evicted.
  for (const { plan } of plans) store.completeSave(plan, true);
  for (const { t } of tickets) store.loadDone(t);
  for (const inst of [...INSTANCES, "ssd", "peer"]) store.dropInstance(inst);
  clock.tick(10 * 60_000);
  store.collect();
  store.evictAll();
  store.verify();
  const st = store.stats();
  strictEqual(st.freeBytes, st.capacityBytes);
  assertEquals([
    st.sealedBlocks,
    st.inflightBlocks,
    st.pinnedBlocks,
    st.leasesActive,
    st.transferLocksActive,
    st.loadsInflight,
  ], [0, 0, 0, 0, 0, 0]);
}

Deno.test("property: random interleavings never free a held block, never serve a half-saved one, never leak", () => {
  fc.assert(
    fc.property(
      fc.array(opArb, { minLength: 20, maxLength: 120 }),
      fc.integer({ min: 2, max: 12 }),
      fc.boolean(),
      fc.boolean(),
      run,
    ),
    { numRuns: 1000 },
  );
});

Deno.test("the random interleavings reach hits, loads, evictions, refusals, expiries, stale collection and locks", () => {
  // Guards the generator: a property over runs that never evict proves nothing.
  const sum: Record<string, number> = {};
  coverage = (st) => {
    for (const [k, v] of Object.entries(st)) sum[k] = (sum[k] ?? 0) + v;
  };
  try {
    fc.assert(
      fc.property(
        fc.array(opArb, { minLength: 20, maxLength: 120 }),
        fc.integer({ min: 2, max: 12 }),
        fc.boolean(),
        fc.boolean(),
        run,
      ),
      { numRuns: 200, seed: 42 },
    );
  } finally {
    coverage = undefined;
  }
  for (
    const k of [
      "hits",
      "evictions",
      "saveRefusals",
      "leasesExpired",
      "staleCollected",
      "admissionRejections",
      "transferLocksActive",
    ]
  ) {
    assert(sum[k] > 0, `no run reached ${k}`);
  }
});
