// Model-based test of KvStore: seeded random sequences of every public
// operation (engine saves of TP=1 and TP=2 namespaces, PP-style layer subsets,
// whole-block fills, queries, lease consume/load/release/expiry, transfer
// locks, checksums, clock jumps, collection, instance cleanup, evictAll)
// driven against a small reference model that predicts, after every step:
// which blocks exist and in which state, every slot's pool offset and the
// bytes a "copy" put there, which units of the pool are owned (never twice),
// the LRU order (onEvict must name the model's victim: a pinned, leased,
// locked or loading block never), every counter and gauge of stats(), and
// store.verify(). A failing sequence is shrunk and printed.
import { deepStrictEqual as assertEquals, ok as assert, strictEqual } from "node:assert/strict";
import type { BlockLayout } from "../../lib/storage/block.ts";
import { InvalidArgumentError, LeaseError, StaleHandleError } from "../../lib/storage/errors.ts";
import { hashBucket } from "../../lib/storage/keys.ts";
import { fnv1a32 } from "../../lib/storage/cache.ts";
import {
  type FillRequest,
  KvStore,
  type LoadTicket,
  type SaveBegin,
  type SavePlan,
} from "../../lib/storage/store.ts";
import type { RamFillBatch, RamPin } from "../../lib/storage/tier.ts";
import { storeTierHost } from "../../lib/storage/tier_host.ts";
import { blockExtents, type PoolExtent } from "../../lib/transfer/ranges.ts";
import { mulberry32 } from "../_seeded.ts";

const UNIT = 4096;
const NAMESPACES = ["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc", "dddddddddddddddd"];
const LAYOUTS: BlockLayout[] = [
  // TP=1, K/V split: 16 KiB per block, one unit per item.
  { layers: 2, tpSize: 1, collapseTp: false, segments: 2, segmentBytes: 4096 },
  // TP=2, K/V split: each rank saves its own slots; 32 KiB per block.
  { layers: 2, tpSize: 2, collapseTp: false, segments: 2, segmentBytes: 4096 },
  // MLA (TP collapsed), odd item size: 8 KiB stride, 24 KiB per block.
  { layers: 3, tpSize: 2, collapseTp: true, segments: 1, segmentBytes: 5000 },
  // TP=4, three items per slot, one layer: 48 KiB per block.
  { layers: 1, tpSize: 4, collapseTp: false, segments: 3, segmentBytes: 4096 },
];
const INSTANCES = ["e1", "e2", "ssd", "peer", "tier:ssd"];
const PLAIN_HASHES = 12;
const LEASE_TTL = 10_000;
const LOCK_TTL = 4_000;
const INFLIGHT_TTL = 30_000;

const geo = LAYOUTS.map((l) => {
  const R = l.collapseTp ? 1 : l.tpSize;
  const stride = Math.ceil(l.segmentBytes / UNIT) * UNIT;
  return { R, stride, slots: l.layers * R, blockBytes: l.layers * R * l.segments * stride };
});

function hex(bytes: Uint8Array): string {
  return [...bytes].map((x) => x.toString(16).padStart(2, "0")).join("");
}

/** Per namespace: 12 plain hashes, then two pairs that share a bucket (index chains). */
const UNIVERSE: string[][] = NAMESPACES.map((ns, n) => {
  const seed = fnv1a32(ns);
  const out = Array.from(
    { length: PLAIN_HASHES },
    (_, i) => (0x1000 * (n + 1) + i).toString(16).padStart(16, "0"),
  );
  const seen = new Map<number, string>();
  const buf = new Uint8Array(8);
  for (let i = 0; out.length < PLAIN_HASHES + 4; i++) {
    new DataView(buf.buffer).setUint32(0, i);
    new DataView(buf.buffer).setUint32(4, Math.imul(i ^ (n << 28), 0x9e3779b1) >>> 0);
    const x = hex(buf);
    const b = hashBucket(x, seed);
    const other = seen.get(b);
    if (other !== undefined) {
      out.push(other, x);
      seen.clear();
    } else seen.set(b, x);
  }
  return out;
});
const U = PLAIN_HASHES + 4;

function bytesOf(x: string): Uint8Array {
  return Uint8Array.from(
    { length: x.length / 2 },
    (_, i) => parseInt(x.slice(2 * i, 2 * i + 2), 16),
  );
}

// ---- seeded randomness -------------------------------------------------------

type OkSpec = "ok" | "fail" | "even" | "throw";
type Op =
  | {
    k: "save";
    ns: number;
    inst: number;
    rank: number;
    start: number;
    len: number;
    dup: number;
    layers: number;
    part: number;
    bytes: boolean;
    now: OkSpec | null;
  }
  | { k: "fill"; ns: number; start: number; len: number; peer: boolean; now: OkSpec | null }
  | { k: "complete"; pick: number; ok: OkSpec }
  | { k: "completeAgain"; pick: number }
  | {
    k: "query";
    ns: number;
    inst: number;
    start: number;
    len: number;
    world: number;
    bytes: boolean;
  }
  | {
    k: "consume";
    pick: number;
    rank: number;
    wrong: boolean;
    tp: number;
    layers: number;
    count: number;
  }
  | { k: "loadDone"; pick: number; again: boolean }
  | { k: "release"; pick: number }
  | { k: "lock"; ns: number; inst: number; start: number; len: number }
  | { k: "unlock"; pick: number }
  | { k: "checksum"; ns: number; start: number; len: number; crc: number }
  | { k: "tick"; ms: number; collect: boolean }
  | { k: "drop"; inst: number }
  | { k: "evictAll" }
  | { k: "hostFill"; ns: number; start: number; len: number; peer: boolean; okMask: number }
  | { k: "hostPin"; ns: number; start: number; len: number }
  | { k: "hostRelease"; pick: number };

interface Config {
  capacityUnits: number;
  /** TinyLFU admission on: the model takes the admitted subset from the plan and checks its shape. */
  lfu: boolean;
  parts?: number[];
  namespaces: number[];
}

function genConfig(rnd: () => number): Config {
  const sets = [[0], [0, 1], [0, 1, 2], [1, 2], [2], [0, 3], [1, 2, 3]];
  const namespaces = sets[Math.floor(rnd() * sets.length)];
  const capacityUnits = 12 + Math.floor(rnd() * 100);
  const split = rnd() < 0.5;
  const first = 1 + Math.floor(rnd() * (capacityUnits - 2));
  return {
    capacityUnits,
    namespaces,
    lfu: rnd() < 0.3,
    parts: split ? [first * UNIT, (capacityUnits - first) * UNIT] : undefined,
  };
}

function genOps(rnd: () => number, cfg: Config, n: number): Op[] {
  const int = (m: number) => Math.floor(rnd() * m);
  const ns = () => cfg.namespaces[int(cfg.namespaces.length)];
  // Prompts mostly share the first blocks, so queries hit and saves dedup.
  const start = () => (rnd() < 0.5 ? int(3) : int(U));
  const okSpec = (): OkSpec => {
    const r = rnd();
    return r < 0.75 ? "ok" : r < 0.87 ? "fail" : r < 0.96 ? "even" : "throw";
  };
  const table: [number, () => Op][] = [
    [14, () => {
      const n = ns();
      return {
        k: "save",
        ns: n,
        inst: int(2),
        rank: rnd() < 0.02 ? LAYOUTS[n].tpSize : int(LAYOUTS[n].tpSize),
        start: start(),
        len: rnd() < 0.1 ? 1 + int(20) : 1 + int(6),
        dup: rnd() < 0.15 ? int(6) : -1,
        layers: rnd() < 0.25 ? 1 + int((1 << LAYOUTS[n].layers) - 1) : 0,
        part: rnd() < 0.5 ? int(2) : -1,
        bytes: rnd() < 0.5,
        now: rnd() < 0.5 ? okSpec() : null,
      };
    }],
    [
      4,
      () => ({
        k: "fill",
        ns: ns(),
        start: start(),
        len: 1 + int(4),
        peer: rnd() < 0.5,
        now: rnd() < 0.3 ? okSpec() : null,
      }),
    ],
    [9, () => ({ k: "complete", pick: int(1 << 20), ok: okSpec() })],
    [1, () => ({ k: "completeAgain", pick: int(1 << 20) })],
    [
      9,
      () => ({
        k: "query",
        ns: ns(),
        inst: int(2),
        start: start(),
        len: 1 + int(6),
        world: 1 + int(3),
        bytes: rnd() < 0.5,
      }),
    ],
    [7, () => ({
      k: "consume",
      pick: int(1 << 20),
      rank: rnd() < 0.9 ? int(2) : int(4),
      wrong: rnd() < 0.05,
      tp: rnd() < 0.3 ? int(3) : -1,
      layers: rnd() < 0.3 ? int(16) : 0,
      count: rnd() < 0.3 ? int(8) : -1,
    })],
    [6, () => ({ k: "loadDone", pick: int(1 << 20), again: rnd() < 0.05 })],
    [3, () => ({ k: "release", pick: int(1 << 20) })],
    [3, () => ({ k: "lock", ns: ns(), inst: int(4), start: start(), len: 1 + int(5) })],
    [3, () => ({ k: "unlock", pick: int(1 << 20) })],
    [1, () => ({ k: "checksum", ns: ns(), start: int(U), len: 1 + int(4), crc: int(2 ** 32) })],
    [4, () => ({ k: "tick", ms: rnd() < 0.7 ? int(3_000) : int(40_000), collect: rnd() < 0.5 })],
    [1, () => ({ k: "drop", inst: int(5) })],
    [
      3,
      () => ({
        k: "hostFill",
        ns: ns(),
        start: start(),
        len: 1 + int(4),
        peer: rnd() < 0.5,
        okMask: int(16),
      }),
    ],
    [3, () => ({ k: "hostPin", ns: ns(), start: start(), len: 1 + int(5) })],
    [2, () => ({ k: "hostRelease", pick: int(1 << 20) })],
    [1, () => ({ k: "evictAll" })],
  ];
  const total = table.reduce((s, [w]) => s + w, 0);
  const ops: Op[] = [];
  for (let i = 0; i < n; i++) {
    let r = rnd() * total;
    for (const [w, g] of table) {
      if ((r -= w) < 0) {
        ops.push(g());
        break;
      }
    }
  }
  return ops;
}

// ---- the reference model -----------------------------------------------------

const EMPTY = 0, PENDING = 1, FILLED = 2;

class MBlock {
  state: "inflight" | "sealed" = "inflight";
  readonly slots: Uint8Array;
  readonly offs: Float64Array;
  filled = 0;
  pending = 0;
  pins = 0;
  cls: "retained" | "reclaimable" = "retained";
  checksum = -1;
  lastWriter: string | undefined;
  constructor(readonly ns: number, readonly hash: string, readonly createdAt: number) {
    this.slots = new Uint8Array(geo[ns].slots);
    this.offs = new Float64Array(geo[ns].slots * LAYOUTS[ns].segments).fill(-1);
  }
  get key(): string {
    return `${this.ns}:${this.hash}`;
  }
}

interface MPlan {
  plan: SavePlan;
  ns: number;
  blocks: MBlock[];
  need: Uint8Array; // k * C + c
  cols: number[]; // column → slot index
  cls: "retained" | "reclaimable";
  poolBytes: number;
}
interface MLease {
  id: string;
  inst: string;
  ns: number;
  blocks: MBlock[];
  consumers: number;
  consumed: Set<number>;
  expiresAt: number;
}
interface MTicket {
  t: LoadTicket;
  blocks: MBlock[];
}

/** A store that shows the last fill plan a tier host began (the host keeps it to itself). */
class SpyStore extends KvStore {
  lastFill: SaveBegin | undefined;
  override beginFill(req: FillRequest): SaveBegin {
    return this.lastFill = super.beginFill(req);
  }
}

const tag = (b: MBlock, slot: number, seg: number) => `${b.key}/${slot}/${seg}`;

function run(cfg: Config, ops: Op[]): void {
  let now = 1_000_000;
  const m = {
    blocks: new Map<string, MBlock>(),
    lru: { reclaimable: new Map<string, MBlock>(), retained: new Map<string, MBlock>() },
    units: new Map<number, string>(),
    mem: new Map<number, string>(),
    plans: [] as MPlan[],
    donePlans: [] as SavePlan[],
    leases: [] as MLease[],
    deadLeases: [] as string[],
    locks: [] as MLease[],
    deadLocks: [] as string[],
    tickets: [] as MTicket[],
    doneTickets: [] as LoadTicket[],
    inflightCopy: 0,
    admissionSeen: 0,
    cov: {
      tickets: 0,
      locks: 0,
      hostFills: 0,
      hostPins: 0,
      fragmentationRefusals: 0,
      leaseErrors: 0,
    },
    hostPins: [] as { pin: RamPin; lock: MLease }[],
    c: {
      queries: 0,
      hits: 0,
      misses: 0,
      savedBlocks: 0,
      deduplicated: 0,
      evictions: 0,
      evictedBytes: 0,
      saveRefusals: 0,
      staleCollected: 0,
      leasesExpired: 0,
    },
  };
  let evictedNow = 0;
  const onEvict = (namespace: string, hash: string) => {
    const v = victim();
    assert(v, `store evicted ${namespace}:${hash} but the model has nothing evictable`);
    strictEqual(
      `${NAMESPACES.indexOf(namespace)}:${hash}`,
      v.key,
      "eviction took another block than the LRU victim",
    );
    evictedNow += geo[v.ns].blockBytes;
    evictModel(v);
  };
  const store = new SpyStore({
    lfuCapacityBlocks: cfg.lfu ? 16 : undefined,
    capacityBytes: cfg.capacityUnits * UNIT,
    parts: cfg.parts,
    clock: () => now,
    leaseTtlMs: LEASE_TTL,
    transferLockTtlMs: LOCK_TTL,
    inflightTtlMs: INFLIGHT_TTL,
    onEvict,
  });
  for (const n of cfg.namespaces) store.defineNamespace(NAMESPACES[n], LAYOUTS[n]);
  const host = storeTierHost(store);

  // -- model helpers
  function victim(): MBlock | undefined {
    for (const l of [m.lru.reclaimable, m.lru.retained]) for (const b of l.values()) return b;
    return undefined;
  }
  function link(b: MBlock) {
    m.lru[b.cls].set(b.key, b);
  }
  function unlink(b: MBlock) {
    m.lru[b.cls].delete(b.key);
  }
  function pin(b: MBlock) {
    if (b.pins++ === 0) unlink(b);
  }
  function unpin(b: MBlock) {
    assert(b.pins > 0, `model unpin of ${b.key}`);
    if (--b.pins === 0 && b.state === "sealed") link(b);
  }
  function claim(off: number, stride: number, owner: string) {
    assert(
      off >= 0 && off % UNIT === 0 && off + stride <= cfg.capacityUnits * UNIT,
      `offset ${off} of ${owner} is outside the pool or misaligned`,
    );
    for (let u = off / UNIT; u < (off + stride) / UNIT; u++) {
      const have = m.units.get(u);
      assert(have === undefined, `unit ${u} handed to ${owner} is still owned by ${have}`);
      m.units.set(u, owner);
    }
  }
  function unclaim(off: number, stride: number) {
    for (let u = off / UNIT; u < (off + stride) / UNIT; u++) {
      assert(m.units.delete(u), `model freed unowned unit ${u}`);
    }
  }
  function freeSlots(b: MBlock) {
    const S = LAYOUTS[b.ns].segments;
    for (let si = 0; si < b.slots.length; si++) {
      if (b.slots[si] === EMPTY) continue;
      for (let s = 0; s < S; s++) {
        unclaim(b.offs[si * S + s], geo[b.ns].stride);
        b.offs[si * S + s] = -1;
      }
      b.slots[si] = EMPTY;
    }
  }
  function evictModel(b: MBlock) {
    assert(
      b.state === "sealed" && b.pins === 0,
      `evicted ${b.key} is ${b.state} with ${b.pins} pins`,
    );
    unlink(b);
    freeSlots(b);
    m.blocks.delete(b.key);
    m.c.evictions++;
    m.c.evictedBytes += geo[b.ns].blockBytes;
  }
  function sweep() {
    let expired = 0;
    for (const l of m.leases.filter((l) => l.expiresAt <= now)) {
      m.leases.splice(m.leases.indexOf(l), 1);
      m.deadLeases.push(l.id);
      l.blocks.forEach(unpin);
      expired++;
    }
    for (const l of m.locks.filter((l) => l.expiresAt <= now)) {
      m.locks.splice(m.locks.indexOf(l), 1);
      m.deadLocks.push(l.id);
      l.blocks.forEach(unpin);
    }
    m.c.leasesExpired += expired;
    let stale = 0;
    for (const b of [...m.blocks.values()]) {
      if (b.state === "inflight" && b.createdAt <= now - INFLIGHT_TTL && b.pending === 0) {
        freeSlots(b);
        b.filled = 0;
        m.blocks.delete(b.key);
        stale++;
      }
    }
    m.c.staleCollected += stale;
    return { leasesExpired: expired, staleFreed: stale };
  }
  const hashesOf = (ns: number, start: number, len: number) =>
    Array.from({ length: len }, (_, i) => UNIVERSE[ns][(start + i) % U]);
  const evictable = () => {
    let s = 0;
    for (const l of [m.lru.reclaimable, m.lru.retained]) {
      for (const b of l.values()) s += geo[b.ns].blockBytes;
    }
    return s;
  };
  const freeBytes = () => (cfg.capacityUnits - m.units.size) * UNIT;
  const layerSubset = (ns: number, mask: number) => {
    const out: number[] = [];
    for (let l = 0; l < LAYOUTS[ns].layers; l++) if (mask & (1 << l)) out.push(l);
    return out;
  };

  function begin(
    ns: number,
    inst: string,
    rank: number,
    hashes: string[],
    layers: number[],
    rankSlots: number[],
    cls: "retained" | "reclaimable",
    call: () => ReturnType<KvStore["beginSave"]>,
    part = -1,
  ): MPlan | null {
    sweep();
    const L = LAYOUTS[ns];
    const g = geo[ns];
    const cols: number[] = [];
    for (const l of layers) for (const r of rankSlots) cols.push(l * g.R + r);
    const C = cols.length;
    // dedup (touching held blocks), fitRoom
    let dedup = 0;
    const seen = new Set<string>();
    const cand: { i: number; b: MBlock | undefined; need: number[] }[] = [];
    for (let i = 0; i < hashes.length; i++) {
      const b = m.blocks.get(`${ns}:${hashes[i]}`);
      if (seen.has(hashes[i]) || b?.state === "sealed") {
        if (b?.state === "sealed" && b.pins === 0) {
          unlink(b);
          link(b);
        }
        dedup++;
        continue;
      }
      seen.add(hashes[i]);
      const need = cols.map((s) => (!b || b.slots[s] === EMPTY ? 1 : 0));
      if (!need.some((x) => x)) {
        dedup++;
        continue;
      }
      cand.push({ i, b, need });
    }
    m.c.deduplicated += dedup;
    const slotBytes = L.segments * g.stride;
    let count = cand.length;
    let total = cand.reduce((s, x) => s + x.need.filter((y) => y).length * slotBytes, 0);
    const room = freeBytes() + evictable();
    while (count > 0 && total > room) {
      total -= cand[--count].need.filter((y) => y).length * slotBytes;
    }
    const refused = cand.length - count;
    // TinyLFU (when on) weighs new blocks only when the save must evict.
    const admissionMay = cfg.lfu && total > freeBytes() && victim() !== undefined;
    const oneUnit = cfg.namespaces.every((n) => geo[n].stride === UNIT);
    // A plan of one column is one allocation: it fits iff free + evictable space holds its items.
    const oneColumn = C * L.segments === 1;
    const capBefore = placeable(g.stride);
    const freeBefore = freeBytes();
    evictedNow = 0;
    const r = call();
    if (!r.ok) {
      strictEqual(r.error.code, "RESOURCE_EXHAUSTED");
      m.c.saveRefusals++;
      if (count === 0 && refused > 0) {
        strictEqual(evictedNow, 0, "a save refused for room evicted blocks");
        return null;
      }
      if (admissionMay && evictedNow === 0 && refused > 0) return null; // admission turned all away
      // Refused for fragmentation: no eviction could place the items.
      m.cov.fragmentationRefusals++;
      assert(!oneUnit, `refused a save of one-unit items that fits: ${r.error.message}`);
      if (oneColumn) {
        // One allocation: refused iff no eviction could place it, and then only the
        // bytes the save needed were evicted first, never the whole cache. (A plan of
        // several columns places them one by one, greedily: no exact bound there.)
        assert(
          capBefore < count,
          `refused ${count} items with room for ${capBefore} after evicting: ${r.error.message}`,
        );
        const need = Math.max(0, total - freeBefore);
        assert(
          evictedNow < need + Math.max(...geo.map((x) => x.blockBytes)) &&
            (need > 0 || evictedNow === 0),
          `refused save evicted ${evictedNow} bytes, needed ${need}`,
        );
      }
      return null;
    }
    assert(!(count === 0 && refused > 0), `a save the pool cannot hold was planned`);
    const p = r.plan;
    let adm = cand.slice(0, count);
    if (admissionMay) {
      const idx = new Set(p.hashIndex);
      const kept = adm.filter((x) => idx.has(x.i));
      for (const x of adm) {
        if (x.b) {
          assert(idx.has(x.i), `admission turned away ${x.b.key}, a block already being saved`);
        }
      }
      strictEqual(p.admissionRejected, adm.length - kept.length, "admission rejections");
      m.admissionSeen += p.admissionRejected;
      adm = kept;
      count = adm.length;
      total = adm.reduce((s, x) => s + x.need.filter((y) => y).length * slotBytes, 0);
    } else strictEqual(p.admissionRejected, 0, "admission without eviction");
    if (oneUnit) {
      // One-unit items fit any hole: eviction stops once the bytes are free.
      const need = Math.max(0, total - freeBefore);
      assert(
        evictedNow < need + Math.max(...geo.map((x) => x.blockBytes)) &&
          (need > 0 || evictedNow === 0),
        `over-eviction: needed ${need}, evicted ${evictedNow}`,
      );
    }
    strictEqual(p.blockCount, count, "planned block count");
    assertEquals([...p.hashIndex], adm.map((x) => x.i), "planned hash indexes");
    strictEqual(p.deduplicated, dedup, "deduplicated");
    strictEqual(p.refusedForRoom, refused, "refused for room");
    assertEquals([...p.layers], layers);
    assertEquals([...p.rankSlots], rankSlots);
    strictEqual(p.rankSlot, rank >= 0 ? rankSlots[0] : -1);
    const S = L.segments;
    const need = new Uint8Array(count * C);
    const blocks: MBlock[] = [];
    let items = 0;
    for (let k = 0; k < count; k++) {
      let b = adm[k].b;
      if (!b) {
        b = new MBlock(ns, hashes[adm[k].i], now);
        m.blocks.set(b.key, b);
      }
      b.lastWriter = inst;
      for (let c = 0; c < C; c++) {
        need[k * C + c] = adm[k].need[c];
        for (let s = 0; s < S; s++) {
          const off = p.offsets[(c * S + s) * count + k];
          if (!adm[k].need[c]) {
            strictEqual(off, -1, `plan copies into held slot ${cols[c]} of ${b.key}`);
            continue;
          }
          claim(off, g.stride, `${tag(b, cols[c], s)} (pending)`);
          b.offs[cols[c] * S + s] = off;
          items++;
        }
        if (adm[k].need[c]) {
          b.slots[cols[c]] = PENDING;
          b.pending++;
        }
      }
      blocks.push(b);
    }
    strictEqual(p.bytes, items * L.segmentBytes, "plan bytes");
    if (part >= 0 && cfg.parts && oneUnit) {
      // NUMA: each column's items go to the named part whenever it holds them
      // (one-unit items: any free unit of the part does).
      const cut = cfg.parts[0] / UNIT;
      const inPart = (off: number) => (off / UNIT < cut ? 0 : 1) === part;
      let partFree = (part === 0 ? cut : cfg.capacityUnits - cut) -
        [...m.units.keys()].filter((u) => inPart(u * UNIT)).length;
      for (let c = 0; c < C * S; c++) {
        const offs = [...p.offsets.subarray(c * count, (c + 1) * count)].filter((x) => x >= 0);
        partFree += offs.filter(inPart).length; // the plan's own units were free before it
      }
      for (let c = 0; c < C * S; c++) {
        const offs = [...p.offsets.subarray(c * count, (c + 1) * count)].filter((x) => x >= 0);
        if (offs.length <= partFree) {
          assert(
            offs.every(inPart),
            `column ${c} of a save naming part ${part} spilled with ${partFree} units free there`,
          );
        }
        partFree -= offs.filter(inPart).length;
      }
    }
    const mp: MPlan = { plan: p, ns, blocks, need, cols, cls, poolBytes: items * g.stride };
    m.inflightCopy += mp.poolBytes;
    m.plans.push(mp);
    return mp;
  }

  /**
   * Ends a plan in the model; `settle`, when given, ends it in the store
   * (a tier host's settle) instead of completeSave with `spec`.
   */
  function complete(
    mp: MPlan,
    spec: OkSpec,
    settle?: { ok: (k: number) => boolean; run: () => void },
  ) {
    m.plans.splice(m.plans.indexOf(mp), 1);
    m.donePlans.push(mp.plan);
    const n = mp.blocks.length;
    const S = LAYOUTS[mp.ns].segments;
    const stride = geo[mp.ns].stride;
    const C = mp.cols.length;
    const blockOk = settle?.ok ??
      ((k: number) => spec === "ok" || (spec === "even" && k % 2 === 0));
    // The "copy": tags where the plan said; a failed copy may have written junk.
    for (let k = 0; k < n; k++) {
      for (let c = 0; c < C; c++) {
        if (!mp.need[k * C + c]) continue;
        for (let s = 0; s < S; s++) {
          const off = mp.plan.offsets[(c * S + s) * n + k];
          m.mem.set(off, blockOk(k) ? tag(mp.blocks[k], mp.cols[c], s) : "junk");
        }
      }
    }
    let thrown: unknown;
    let res: ReturnType<KvStore["completeSave"]> | undefined;
    const boom = new Error("verdict failed");
    try {
      if (settle) settle.run();
      else {res = store.completeSave(
          mp.plan,
          spec === "ok" ? true : spec === "fail" ? false : spec === "even" ? blockOk : (k) => {
            if (k === n - 1) throw boom;
            return true;
          },
        );}
    } catch (e) {
      thrown = e;
    }
    if (spec === "throw" && n > 0) strictEqual(thrown, boom);
    else if (thrown) throw thrown;
    const ok = (k: number) => spec !== "throw" && blockOk(k);
    m.inflightCopy -= mp.poolBytes;
    const sealed: string[] = [];
    let freed = 0;
    for (let k = 0; k < n; k++) {
      const b = mp.blocks[k];
      for (let c = 0; c < C; c++) {
        if (!mp.need[k * C + c]) continue;
        const si = mp.cols[c];
        b.pending--;
        if (ok(k)) {
          b.slots[si] = FILLED;
          b.filled++;
        } else {
          b.slots[si] = EMPTY;
          for (let s = 0; s < S; s++) {
            unclaim(b.offs[si * S + s], stride);
            b.offs[si * S + s] = -1;
            freed += stride;
          }
        }
      }
      if (ok(k) && b.filled === b.slots.length && b.state === "inflight") {
        b.state = "sealed";
        b.lastWriter = undefined;
        b.cls = mp.cls;
        link(b);
        m.c.savedBlocks++;
        sealed.push(b.hash);
      } else if (!ok(k) && b.filled === 0 && b.pending === 0) {
        m.blocks.delete(b.key);
      }
    }
    if (res) {
      assertEquals(res.sealedHashes, sealed, "sealed hashes");
      strictEqual(res.sealed, sealed.length);
      strictEqual(res.freedBytes, freed, "freed bytes");
    }
  }

  /** Checks a column-major table of offsets against the model and the "pool". */
  function checkOffsets(
    what: string,
    blocks: MBlock[],
    colOf: (c: number) => number,
    cols: number,
    offsets: Float64Array,
  ) {
    const n = blocks.length;
    strictEqual(offsets.length, cols * n, `${what}: offset table size`);
    for (let c = 0; c < cols; c++) {
      for (let k = 0; k < n; k++) {
        const b = blocks[k];
        const S = LAYOUTS[b.ns].segments;
        const j = colOf(c);
        const off = offsets[c * n + k];
        strictEqual(
          off,
          b.offs[j],
          `${what}: block ${b.key} column ${j} at ${off}, model says ${b.offs[j]}`,
        );
        strictEqual(
          m.mem.get(off),
          tag(b, Math.floor(j / S), j % S),
          `${what}: bytes of ${b.key} column ${j}`,
        );
      }
    }
  }

  const pick = <T>(xs: T[], i: number) => (xs.length ? xs[i % xs.length] : undefined);

  function step(o: Op) {
    switch (o.k) {
      case "save": {
        if (!cfg.namespaces.includes(o.ns)) return;
        const L = LAYOUTS[o.ns];
        const hashes = hashesOf(o.ns, o.start, o.len);
        if (o.dup >= 0) {
          hashes.splice(o.dup % hashes.length, 0, hashes[(o.dup * 7) % hashes.length]);
        }
        const layers = o.layers
          ? layerSubset(o.ns, o.layers)
          : Array.from({ length: L.layers }, (_, i) => i);
        const inst = INSTANCES[o.inst];
        const req = {
          namespace: NAMESPACES[o.ns],
          instance: inst,
          rank: o.rank,
          hashes: o.bytes ? hashes.map(bytesOf) : hashes,
          layers: o.layers ? layers : undefined,
          poolPart: o.part >= 0 ? o.part : undefined,
        };
        if (o.rank >= L.tpSize) {
          sweep();
          let e: unknown;
          try {
            store.beginSave(req);
          } catch (x) {
            e = x;
          }
          assert(e instanceof InvalidArgumentError, `bad rank ${o.rank} was not refused`);
          return;
        }
        const rs = L.collapseTp ? 0 : o.rank;
        const mp = begin(
          o.ns,
          inst,
          o.rank,
          hashes,
          layers,
          [rs],
          "retained",
          () => store.beginSave(req),
          o.part,
        );
        if (mp && o.now) complete(mp, o.now);
        return;
      }
      case "fill": {
        if (!cfg.namespaces.includes(o.ns)) return;
        const L = LAYOUTS[o.ns];
        const hashes = hashesOf(o.ns, o.start, o.len);
        const cls = o.peer ? "reclaimable" : "retained";
        const inst = o.peer ? "peer" : "ssd";
        const mp = begin(
          o.ns,
          inst,
          -1,
          hashes,
          Array.from({ length: L.layers }, (_, i) => i),
          Array.from({ length: geo[o.ns].R }, (_, i) => i),
          cls,
          () =>
            store.beginFill({
              namespace: NAMESPACES[o.ns],
              instance: inst,
              hashes: hashes.map(bytesOf),
              cacheClass: cls,
            }),
        );
        if (mp && o.now) complete(mp, o.now);
        return;
      }
      case "complete": {
        const mp = pick(m.plans, o.pick);
        if (mp) complete(mp, o.ok);
        return;
      }
      case "completeAgain": {
        const p = pick(m.donePlans, o.pick);
        if (!p) return;
        let e: unknown;
        try {
          store.completeSave(p, true);
        } catch (x) {
          e = x;
        }
        assert(e instanceof StaleHandleError, "a completed plan was completed again");
        return;
      }
      case "query": {
        if (!cfg.namespaces.includes(o.ns)) return;
        sweep();
        const hashes = hashesOf(o.ns, o.start, o.len);
        const hit: MBlock[] = [];
        for (const x of hashes) {
          const b = m.blocks.get(`${o.ns}:${x}`);
          if (b?.state !== "sealed") break;
          hit.push(b);
        }
        const inst = INSTANCES[o.inst];
        const q = store.query(
          NAMESPACES[o.ns],
          o.bytes ? hashes.map(bytesOf) : hashes,
          inst,
          o.world,
        );
        m.c.queries++;
        m.c.hits += hit.length;
        m.c.misses += hashes.length - hit.length;
        strictEqual(q.hits, hit.length, `query hits of ${hashes}`);
        if (hit.length === 0) {
          strictEqual(q.lease, undefined);
          return;
        }
        assert(q.lease);
        strictEqual(q.lease.expiresAt, now + LEASE_TTL);
        hit.forEach(pin);
        m.leases.push({
          id: q.lease.id,
          inst,
          ns: o.ns,
          blocks: hit,
          consumers: o.world,
          consumed: new Set(),
          expiresAt: q.lease.expiresAt,
        });
        return;
      }
      case "consume": {
        // Mostly a live lease; now and then one that ended (it must be refused).
        const live = m.leases.map((l) => l.id);
        const id = o.pick % 8 === 0 || !live.length
          ? pick(m.deadLeases.slice(-3), o.pick)
          : pick(live, o.pick >> 3);
        if (!id) return;
        sweep();
        const l = m.leases.find((x) => x.id === id);
        const inst = o.wrong || !l ? "e9" : l.inst;
        const L = l && LAYOUTS[l.ns];
        const layers = l && o.layers ? layerSubset(l.ns, o.layers) : undefined;
        const opts = {
          tpRank: o.tp >= 0 ? o.tp : undefined,
          layers: layers && (layers.length ? layers : [L!.layers]), // empty mask: a bad layer
          count: o.count >= 0 ? o.count : undefined,
        };
        let expect: string;
        if (!l) expect = "unknown-or-expired";
        else if (o.wrong) expect = "wrong-instance";
        else if (o.rank >= l.consumers) expect = "rank-out-of-range";
        else if (l.consumed.has(o.rank)) expect = "rank-already-consumed";
        else if (opts.count !== undefined && opts.count > l.blocks.length) expect = "invalid";
        else if (o.tp >= L!.tpSize) expect = "invalid";
        else if (layers && !layers.length) expect = "invalid";
        else expect = "ok";
        let t: LoadTicket | undefined;
        let e: unknown;
        try {
          t = store.consumeLease(id, inst, o.rank, opts);
        } catch (x) {
          e = x;
        }
        if (expect !== "ok") {
          if (expect === "invalid") {
            assert(e instanceof InvalidArgumentError, `expected INVALID_ARGUMENT, got ${e}`);
          } else {assert(
              e instanceof LeaseError && e.reason === expect,
              `expected ${expect}, got ${e}`,
            );}
          m.cov.leaseErrors++;
          return;
        }
        if (e) throw e;
        l!.consumed.add(o.rank);
        const blocks = l!.blocks.slice(0, opts.count ?? l!.blocks.length);
        const tpRank = opts.tpRank ?? o.rank % L!.tpSize;
        const rs = L!.collapseTp ? 0 : tpRank;
        const ls = layers ?? Array.from({ length: L!.layers }, (_, i) => i);
        const S = L!.segments;
        assertEquals(t!.hashes, blocks.map((b) => b.hash), "ticket hashes");
        assertEquals([...t!.layers], ls);
        strictEqual(t!.bytes, blocks.length * ls.length * S * L!.segmentBytes);
        checkOffsets(
          `ticket of lease ${id}`,
          blocks,
          (c) => (ls[Math.floor(c / S)] * geo[l!.ns].R + rs) * S + (c % S),
          ls.length * S,
          t!.offsets,
        );
        blocks.forEach(pin);
        m.tickets.push({ t: t!, blocks });
        m.cov.tickets++;
        if (l!.consumed.size === l!.consumers) {
          m.leases.splice(m.leases.indexOf(l!), 1);
          m.deadLeases.push(l!.id);
          l!.blocks.forEach(unpin);
        }
        return;
      }
      case "loadDone": {
        if (o.again) {
          const t = pick(m.doneTickets, o.pick);
          if (!t) return;
          let e: unknown;
          try {
            store.loadDone(t);
          } catch (x) {
            e = x;
          }
          assert(e instanceof StaleHandleError, "a finished load was finished again");
          return;
        }
        const t = pick(m.tickets, o.pick);
        if (!t) return;
        store.loadDone(t.t);
        m.tickets.splice(m.tickets.indexOf(t), 1);
        m.doneTickets.push(t.t);
        t.blocks.forEach(unpin);
        return;
      }
      case "release":
      case "unlock": {
        const live = o.k === "release" ? m.leases : m.locks;
        const dead = o.k === "release" ? m.deadLeases : m.deadLocks;
        const id = pick(
          [...live.map((l) => l.id), ...dead.slice(-2)].filter((x) => !x.startsWith("host:")),
          o.pick,
        );
        if (!id) return;
        sweep();
        const l = live.find((x) => x.id === id);
        let e: unknown;
        try {
          if (o.k === "release") store.releaseLease(id);
          else store.releaseTransferLock(id);
        } catch (x) {
          e = x;
        }
        if (!l) {
          assert(
            e instanceof LeaseError && e.reason === "unknown-or-expired",
            `release of ended ${id}: ${e}`,
          );
          return;
        }
        if (e) throw e;
        live.splice(live.indexOf(l), 1);
        dead.push(id);
        l.blocks.forEach(unpin);
        return;
      }
      case "lock": {
        if (!cfg.namespaces.includes(o.ns)) return;
        sweep();
        const hashes = hashesOf(o.ns, o.start, o.len);
        const found: number[] = [];
        const blocks: MBlock[] = [];
        hashes.forEach((x, i) => {
          const b = m.blocks.get(`${o.ns}:${x}`);
          if (b?.state === "sealed") {
            found.push(i);
            blocks.push(b);
          }
        });
        const inst = INSTANCES[o.inst];
        const lock = store.lockForTransfer(NAMESPACES[o.ns], hashes.map(bytesOf), inst);
        if (!blocks.length) {
          strictEqual(lock, null);
          return;
        }
        assert(lock, "no lock over sealed blocks");
        assertEquals([...lock.found], found);
        strictEqual(lock.expiresAt, now + LOCK_TTL);
        assertEquals([...lock.checksums], blocks.map((b) => b.checksum));
        const cols = geo[o.ns].slots * LAYOUTS[o.ns].segments;
        checkOffsets(`transfer lock ${lock.id}`, blocks, (c) => c, cols, lock.offsets);
        blocks.forEach(pin);
        m.cov.locks++;
        m.locks.push({
          id: lock.id,
          inst,
          ns: o.ns,
          blocks,
          consumers: 1,
          consumed: new Set(),
          expiresAt: lock.expiresAt,
        });
        return;
      }
      case "checksum": {
        if (!cfg.namespaces.includes(o.ns)) return;
        const hashes = hashesOf(o.ns, o.start, o.len);
        const crcs = hashes.map((_, i) => (o.crc + i * 0x9e3779b9) >>> 0);
        let n = 0;
        hashes.forEach((x, i) => {
          const b = m.blocks.get(`${o.ns}:${x}`);
          if (b?.state === "sealed") {
            b.checksum = crcs[i];
            n++;
          }
        });
        strictEqual(store.recordChecksums(NAMESPACES[o.ns], hashes, crcs), n);
        return;
      }
      case "tick": {
        now += o.ms;
        if (o.collect) assertEquals(store.collect(), sweep(), "collect");
        return;
      }
      case "drop": {
        const inst = INSTANCES[o.inst];
        const gone = [
          ...m.leases.filter((l) => l.inst === inst),
          ...m.locks.filter((l) => l.inst === inst),
        ];
        for (const l of gone) {
          const list = m.leases.includes(l) ? m.leases : m.locks;
          list.splice(list.indexOf(l), 1);
          (list === m.leases ? m.deadLeases : m.deadLocks).push(l.id);
          l.blocks.forEach(unpin);
        }
        let freed = 0;
        for (const b of [...m.blocks.values()]) {
          if (b.state === "inflight" && b.pending === 0 && b.lastWriter === inst) {
            freeSlots(b);
            m.blocks.delete(b.key);
            freed++;
          }
        }
        assertEquals(store.dropInstance(inst), { leases: gone.length, inflightFreed: freed });
        // Nothing of the instance is left: no lease or lock of it answers.
        for (const l of gone) {
          let e: unknown;
          try {
            if (m.deadLeases.includes(l.id)) store.releaseLease(l.id);
            else store.releaseTransferLock(l.id);
          } catch (x) {
            e = x;
          }
          assert(e instanceof LeaseError, `lease ${l.id} of dropped ${inst} still live`);
        }
        if (gone.length) sweep();
        return;
      }
      case "hostFill": {
        // A tier's batch fill through the tier host: the leading run of asked hashes planned whole.
        if (!cfg.namespaces.includes(o.ns)) return;
        const L = LAYOUTS[o.ns];
        const hashes = hashesOf(o.ns, o.start, o.len);
        const cls = o.peer ? "reclaimable" : "retained";
        let batch = null as RamFillBatch | null;
        store.lastFill = undefined;
        const mp = begin(
          o.ns,
          "tier:ssd",
          -1,
          hashes,
          Array.from({ length: L.layers }, (_, i) => i),
          Array.from({ length: geo[o.ns].R }, (_, i) => i),
          cls,
          () => {
            batch = host.fillMany(NAMESPACES[o.ns], hashes.map(bytesOf), "tier:ssd", cls);
            return store.lastFill!;
          },
        );
        if (!mp) {
          strictEqual(batch, null);
          return;
        }
        const C = mp.cols.length;
        let want = 0;
        while (
          want < mp.blocks.length && mp.plan.hashIndex[want] === want &&
          mp.need.subarray(want * C, want * C + C).every((x) => x === 1)
        ) want++;
        if (want === 0) {
          strictEqual(batch, null, "a fill with no whole leading block was handed out");
          complete(mp, "fail", { ok: () => false, run: () => {} });
          return;
        }
        assert(batch, "no fill batch for a whole leading block");
        const b = batch;
        strictEqual(b.count, want, "fill batch count");
        strictEqual(b.payloadBytes, geo[o.ns].slots * L.segments * L.segmentBytes);
        for (let k = 0; k < want; k++) {
          assertEquals(
            blockExtents(b.ranges, k),
            extentsOf(mp.blocks[k]),
            `fill ranges of ${mp.blocks[k].key}`,
          );
        }
        m.cov.hostFills++;
        const verdict = (k: number) => ((o.okMask >> (k % 4)) & 1) === 1;
        complete(mp, "ok", { ok: (k) => k < want && verdict(k), run: () => b.settle(verdict) });
        return;
      }
      case "hostPin": {
        if (!cfg.namespaces.includes(o.ns)) return;
        sweep();
        const hashes = hashesOf(o.ns, o.start, o.len);
        const held = hashes.map((x) => m.blocks.get(`${o.ns}:${x}`)).map((b) =>
          b?.state === "sealed" ? b : undefined
        );
        const rp = host.pin(NAMESPACES[o.ns], hashes.map(bytesOf), "tier:ssd");
        const blocks = held.filter((b) => b !== undefined) as MBlock[];
        if (!blocks.length) {
          strictEqual(rp, null);
          return;
        }
        assert(rp, "no pin over sealed blocks");
        const S = LAYOUTS[o.ns].segments;
        held.forEach((b, i) => {
          if (!b) return strictEqual(rp.blocks[i], undefined);
          const e = rp.blocks[i];
          assert(e, `pin lost ${b.key}`);
          assertEquals(e.extents, extentsOf(b), `pinned extents of ${b.key}`);
          strictEqual(e.checksum, b.checksum < 0 ? undefined : b.checksum);
          b.offs.forEach((off, j) =>
            strictEqual(
              m.mem.get(off),
              tag(b, Math.floor(j / S), j % S),
              `pinned bytes of ${b.key}`,
            )
          );
        });
        blocks.forEach(pin);
        const lock: MLease = {
          id: `host:${m.hostPins.length}:${now}`,
          inst: "tier:ssd",
          ns: o.ns,
          blocks,
          consumers: 1,
          consumed: new Set(),
          expiresAt: now + LOCK_TTL,
        };
        m.locks.push(lock);
        m.hostPins.push({ pin: rp, lock });
        m.cov.hostPins++;
        return;
      }
      case "hostRelease": {
        const hp = pick(m.hostPins, o.pick);
        if (!hp) return;
        m.hostPins.splice(m.hostPins.indexOf(hp), 1);
        sweep();
        hp.pin.release(); // an expired one is nothing to release
        const i = m.locks.indexOf(hp.lock);
        if (i >= 0) {
          m.locks.splice(i, 1);
          hp.lock.blocks.forEach(unpin);
        }
        return;
      }
      case "evictAll": {
        const n = [...m.lru.reclaimable.values(), ...m.lru.retained.values()].length;
        strictEqual(store.evictAll(), n);
        strictEqual(evictable(), 0);
        return;
      }
    }
  }

  /** Free extents as the model's units say: maximal free runs, never across a part boundary. */
  function freeRuns() {
    const cut = cfg.parts ? cfg.parts[0] / UNIT : -1;
    let runs = 0, largest = 0, len = 0;
    for (let u = 0; u <= cfg.capacityUnits; u++) {
      if (u === cut || u === cfg.capacityUnits || m.units.has(u)) {
        if (len > 0) runs++;
        largest = Math.max(largest, len);
        len = 0;
      }
      if (u < cfg.capacityUnits && !m.units.has(u)) len++;
    }
    return { freeExtents: runs, largestFreeBytes: largest * UNIT };
  }

  /** Items of `stride` that free units plus evictable blocks' units hold, in runs within one part. */
  function placeable(stride: number): number {
    const avail = new Uint8Array(cfg.capacityUnits).fill(1);
    for (const u of m.units.keys()) avail[u] = 0;
    for (const l of [m.lru.reclaimable, m.lru.retained]) {
      for (const b of l.values()) {
        for (const off of b.offs) {
          for (let u = off / UNIT; u < (off + geo[b.ns].stride) / UNIT; u++) {
            avail[u] = 1;
          }
        }
      }
    }
    const cut = cfg.parts ? cfg.parts[0] / UNIT : -1;
    let fit = 0, len = 0;
    for (let u = 0; u <= cfg.capacityUnits; u++) {
      if (u === cut || u === cfg.capacityUnits || !avail[u]) {
        fit += Math.floor((len * UNIT) / stride);
        len = 0;
      }
      if (u < cfg.capacityUnits && avail[u]) len++;
    }
    return fit;
  }

  /** A block's payload-order extents as the model's offsets say, adjacent items merged. */
  function extentsOf(b: MBlock): PoolExtent[] {
    const out: PoolExtent[] = [];
    const bytes = LAYOUTS[b.ns].segmentBytes;
    for (const off of b.offs) {
      const last = out[out.length - 1];
      if (last && last.offset + last.bytes === off) last.bytes += bytes;
      else out.push({ offset: off, bytes });
    }
    return out;
  }

  function check() {
    store.verify();
    const s = store.stats();
    let sealed = 0, inflight = 0, pinned = 0;
    for (const b of m.blocks.values()) {
      if (b.state === "sealed") sealed++;
      else inflight++;
      if (b.pins > 0) pinned++;
    }
    const partUsed = (cfg.parts ?? [cfg.capacityUnits * UNIT]).map(() => 0);
    const firstPartUnits = cfg.parts ? cfg.parts[0] / UNIT : Infinity;
    for (const u of m.units.keys()) partUsed[u < firstPartUnits ? 0 : 1] += UNIT;
    assertEquals(
      {
        sealedBlocks: s.sealedBlocks,
        inflightBlocks: s.inflightBlocks,
        pinnedBlocks: s.pinnedBlocks,
        leasesActive: s.leasesActive,
        transferLocksActive: s.transferLocksActive,
        loadsInflight: s.loadsInflight,
        usedBytes: s.usedBytes,
        freeBytes: s.freeBytes,
        evictableBytes: s.evictableBytes,
        inflightCopyBytes: s.inflightCopyBytes,
        partUsedBytes: s.partUsedBytes,
        freeExtents: s.freeExtents,
        largestFreeBytes: s.largestFreeBytes,
        queries: s.queries,
        hits: s.hits,
        misses: s.misses,
        savedBlocks: s.savedBlocks,
        deduplicated: s.deduplicated,
        evictions: s.evictions,
        evictedBytes: s.evictedBytes,
        saveRefusals: s.saveRefusals,
        staleCollected: s.staleCollected,
        leasesExpired: s.leasesExpired,
      },
      {
        sealedBlocks: sealed,
        inflightBlocks: inflight,
        pinnedBlocks: pinned,
        leasesActive: m.leases.length,
        transferLocksActive: m.locks.length,
        loadsInflight: m.tickets.length,
        usedBytes: m.units.size * UNIT,
        freeBytes: freeBytes(),
        evictableBytes: evictable(),
        inflightCopyBytes: m.inflightCopy,
        partUsedBytes: partUsed,
        ...freeRuns(),
        ...m.c,
      },
      "stats() against the model",
    );
    if (cfg.lfu) assert(s.admissionRejections >= m.admissionSeen);
    else strictEqual(s.admissionRejections, 0);
    for (const n of cfg.namespaces) {
      for (const x of UNIVERSE[n]) {
        strictEqual(
          store.blockState(NAMESPACES[n], x),
          m.blocks.get(`${n}:${x}`)?.state ?? "absent",
          `state of ${n}:${x}`,
        );
      }
    }
    // A lease's blocks stay (sealed, pinned) until it ends.
    for (const l of [...m.leases, ...m.locks]) {
      for (const b of l.blocks) {
        assert(m.blocks.get(b.key) === b && b.state === "sealed", `held ${b.key} is gone`);
      }
    }
  }

  for (let i = 0; i < ops.length; i++) {
    try {
      step(ops[i]);
      check();
    } catch (e) {
      throw new OpFailure(i, e);
    }
  }
  // Wind down: everything ends, is evicted, and the pool is whole again.
  try {
    for (const mp of [...m.plans]) complete(mp, "ok");
    for (const t of [...m.tickets]) {
      step({ k: "loadDone", pick: m.tickets.indexOf(t), again: false });
    }
    for (let i = 0; i < INSTANCES.length; i++) step({ k: "drop", inst: i });
    step({ k: "tick", ms: INFLIGHT_TTL + LEASE_TTL, collect: true });
    step({ k: "evictAll" });
    check();
    strictEqual(store.stats().freeBytes, store.stats().capacityBytes, "pool leaked");
    coverage?.({ ...m.c, ...m.cov, admissionRejections: store.stats().admissionRejections });
  } catch (e) {
    throw new OpFailure(ops.length, e);
  }
}

let coverage: ((c: Record<string, number>) => void) | undefined;

class OpFailure extends Error {
  constructor(readonly at: number, readonly inner: unknown) {
    super(`op ${at}: ${inner instanceof Error ? inner.message : String(inner)}`);
  }
}

function fails(cfg: Config, ops: Op[]): OpFailure | null {
  try {
    run(cfg, ops);
    return null;
  } catch (e) {
    if (e instanceof OpFailure) return e;
    throw e;
  }
}

/** Delta-debugging shrink: drop chunks of ops while the run still fails. */
function shrink(cfg: Config, ops: Op[], first: OpFailure): { ops: Op[]; err: OpFailure } {
  let cur = ops.slice(0, first.at + 1);
  let err = first;
  let budget = 3000;
  for (let chunk = Math.max(1, cur.length >> 1); chunk >= 1 && budget > 0; chunk >>= 1) {
    for (let i = 0; i < cur.length && budget > 0;) {
      const cand = [...cur.slice(0, i), ...cur.slice(i + chunk)];
      budget--;
      const f = fails(cfg, cand);
      if (f) {
        cur = cand.slice(0, f.at + 1);
        err = f;
      } else i += chunk;
    }
  }
  return { ops: cur, err };
}

/** Seed 26 once caught a refused save that had flushed the cache (tests/storage/eviction_review_test.ts). */
const SEEDS = Array.from({ length: 32 }, (_, i) => i + 1);
const OPS_PER_SEED = 3000;

export function runSeed(seed: number, n = OPS_PER_SEED): void {
  const rnd = mulberry32(seed);
  const cfg = genConfig(rnd);
  const ops = genOps(rnd, cfg, n);
  const f = fails(cfg, ops);
  if (!f) return;
  const { ops: small, err } = shrink(cfg, ops, f);
  console.error(`seed ${seed} config ${JSON.stringify(cfg)}; shrunk to ${small.length} ops:`);
  for (const o of small) console.error("  " + JSON.stringify(o));
  console.error(err.inner);
  throw new Error(`model test seed ${seed}: ${err.message}`);
}

Deno.test("model: random store operations keep every block, byte, pin and counter where the model says", () => {
  for (const seed of SEEDS) runSeed(seed);
});

Deno.test("model: the random sequences reach hits, evictions, refusals, expiries, stale collection", () => {
  const sum: Record<string, number> = {};
  coverage = (c) => {
    for (const [k, v] of Object.entries(c)) sum[k] = (sum[k] ?? 0) + v;
  };
  try {
    for (const seed of SEEDS.slice(0, 8)) runSeed(seed);
  } finally {
    coverage = undefined;
  }
  console.log(sum);
  for (const [k, v] of Object.entries(sum)) assert(v > 0, `no sequence reached ${k}`);
});
