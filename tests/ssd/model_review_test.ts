/**
 * A seeded, model-based test of the SSD tier over real io_uring and real
 * files: random bursts of write-behind batches (blocks evicted before their
 * write, duplicate keys, several namespaces and layouts), prefetches of
 * random prefixes (joined while in flight, or never polled again), flushes,
 * close and reopen (restart recovery, sometimes `--ssd-reset`), and damage
 * injected into the files between steps (a flipped payload byte, a torn
 * header, a truncated file). The segments are small and few so the ring
 * wraps many times per seed.
 *
 * After every step, against a reference model:
 *  - every block the tier says it holds reads back byte-exact (CRC verified
 *    by the tier, bytes compared here at commit) or is missed, never wrong;
 *    an intact one is served;
 *  - the index points at a record on disk with that key and sequence number,
 *    of its segment's current fill (never into a reused segment);
 *  - a block leaves the index only when its segment was reused, a newer
 *    record of it was written, or its record was damaged;
 *  - a block indexed before a close is found at the same place after the
 *    reopen unless damage lay in its segment's chain before it;
 *  - nothing stays queued, in flight, pinned, reserved or allocated once the
 *    tier settles, and every wait is bounded.
 * A broken invariant fails with the seed and the operation sequence.
 */
import { decodeHeader, PAGE_BYTES, recordBytes } from "../../lib/ssd/format.ts";
import type { SsdTier } from "../../lib/ssd/tier.ts";
import type { PrefetchAllocation, PrefetchWant } from "../../lib/ssd/prefetch.ts";
import { type LayoutIdentity, layoutIdentity } from "../../lib/storage/layout.ts";
import { type Harness, harness, type TestBlock, within } from "./_harness.ts";
import { mulberry32 } from "../_seeded.ts";

const KiB = 1024;
const MiB = 1024 * KiB;
/** Small segments, few of them: a record is 1/6 to 1/3 of a segment, the ring wraps often. */
const SEG = 128 * KiB;
/** Segments per file at the first open; a reopen may resize the files (4 to 7). */
const SEGS_PER_FILE = 6;
const FILES = 2;
/** Pool slots: write sources in [0, 16 MiB), prefetch targets in [32, 64) MiB. */
const SLOT = 64 * KiB;
const PREFETCH_BASE = 32 * MiB;
const PREFETCH_SLOTS = 512;
const KEYS_PER_NS = 36;
const STEPS = 250;
const SEEDS = [11, 23, 37, 41, 53, 67];
/** Bound on every wait: a hang fails the test instead of stalling it. */
const WAIT_MS = 5_000;

interface Lay {
  ns: string;
  id: LayoutIdentity;
  bytes: number;
}

function lay(ns: string, name: string, bytes: number): Lay {
  const id = layoutIdentity({
    tpSize: 1,
    ppSize: 1,
    collapseTp: false,
    layers: [{ name, segBytes: bytes, numSegments: 1 }],
  });
  return { ns, id, bytes };
}

/** Two namespaces; nsB has two layouts (one of an odd, not page-aligned size). */
const LAYOUTS: Lay[] = [
  lay("nsA", "a", 16 * KiB),
  lay("nsB", "b1", 40 * KiB),
  lay("nsB", "b2", 12 * KiB + 100),
];
const LAY_OF_FP = new Map(LAYOUTS.map((l) => [l.id.fingerprint, l]));
const KEYS = [...new Set(LAYOUTS.map((l) => l.ns))].flatMap((ns) =>
  Array.from({ length: KEYS_PER_NS }, (_, i) => `${ns}/k${i}`)
);

/** The bytes a block of `key` written by layout `fp` holds (content-addressed: fixed per pair). */
function contentId(key: string, fp: string): string {
  return `${key}#${fp}`;
}

/** Where one block's record was seen in the index. */
interface Seen {
  key: string;
  path: string;
  off: number;
  seq: number;
  epoch: number;
  fp: string;
  bytes: number;
}

/** Damage injected into a file: records of fills up to `seqBound` overlapping [from, to). */
interface Damage {
  path: string;
  from: number;
  to: number;
  seqBound: number;
  /** Lost at a restart too (a torn header or a truncation ends the segment's chain). */
  chain: boolean;
}

const segStart = (off: number) => PAGE_BYTES + Math.floor((off - PAGE_BYTES) / SEG) * SEG;
const recEnd = (s: Seen) => s.off + recordBytes(s.bytes);
const seenId = (s: Seen) => `${s.key}@${s.path}:${s.off}#${s.seq}`;

class Model {
  readonly rng: () => number;
  readonly ops: string[] = [];
  readonly violations: string[] = [];
  tier!: SsdTier;
  paths: string[];
  /** key → where the index held it at the last check. */
  seen = new Map<string, Seen>();
  /** Every record ever seen indexed (a restart may bring back an older one of a key). */
  history = new Set<string>();
  damage: Damage[] = [];
  freeSlots: number[] = [];
  outstanding = 0;
  reqSeq = 0;
  /** Requests to wait for at the next settle; `poll`: polled until ready. */
  reqs = new Map<string, { poll: boolean }>();
  blocks: TestBlock[] = [];
  /** What the run exercised (printed: a model that never wraps the ring proves little). */
  readonly tally = {
    commits: 0,
    frees: 0,
    loading: 0,
    reuses: 0,
    restarts: 0,
    resets: 0,
    damage: 0,
    readFailures: 0,
  };

  segs = SEGS_PER_FILE;
  readonly writeInflight: number;
  readonly prefetchInflight: number;
  readonly hdrPages: number;

  constructor(readonly h: Harness, readonly seed: number) {
    this.rng = mulberry32(seed);
    // Per seed: 1 to 3 writers and readers, header pages for 1 to 3 blocks per io batch.
    this.writeInflight = 1 + this.int(3);
    this.prefetchInflight = 1 + this.int(3);
    this.hdrPages = (this.writeInflight + this.prefetchInflight) * (1 + this.int(3));
    this.paths = Array.from({ length: FILES }, (_, i) => `${h.dir}/m${seed}-${i}.cache`);
    for (let i = PREFETCH_SLOTS - 1; i >= 0; i--) this.freeSlots.push(i);
  }

  int(n: number): number {
    return Math.floor(this.rng() * n);
  }

  pick<T>(xs: readonly T[]): T {
    return xs[this.int(xs.length)];
  }

  op(s: string): void {
    this.ops.push(s);
  }

  violate(s: string): void {
    this.violations.push(s);
  }

  fail(s: string): never {
    throw new Error(
      `${s}\nseed ${this.seed}; other violations: ${this.violations.join(" | ") || "none"}\n` +
        `operations:\n  ${this.ops.join("\n  ")}`,
    );
  }

  assertClean(): void {
    if (this.violations.length > 0) this.fail(this.violations[0]);
  }

  async open(reset: boolean): Promise<void> {
    this.op(`open reset=${reset}`);
    this.tier = await within(
      this.h.openTier({
        paths: this.paths,
        capacityBytes: FILES * (PAGE_BYTES + this.segs * SEG),
        segmentBytes: SEG,
        reset,
        hdrPages: this.hdrPages,
        writeInflight: this.writeInflight,
        prefetchInflight: this.prefetchInflight,
        writeQueueDepth: 3,
        prefetchQueueDepth: 4,
        maxPrefetchBlocks: 12,
        ioDepth: 32,
        prefetchTtlMs: 100,
      }),
      WAIT_MS,
      "open",
    );
  }

  // ---- operations ---------------------------------------------------------

  /** One write batch; returns the (key, fp) pairs it must write unless the ring moved. */
  write(srcSlot: { next: number }, pending: Set<string>): Array<[string, string]> {
    const t = this.tier;
    const base = this.pick(LAYOUTS);
    const n = 1 + this.int(7);
    const blocks: TestBlock[] = [];
    const desc: string[] = [];
    const expect: Array<[string, string]> = [];
    const fresh = new Set<string>();
    let dups = 0;
    // Keys queued earlier in this burst may have been written (held) or ended unwritten
    // (evicted) by now: the tier may count them either way.
    let maybe = 0;
    for (let i = 0; i < n; i++) {
      // A duplicate repeats an earlier block of the batch (same key, same layout).
      const dup = i > 0 && this.rng() < 0.15 ? blocks[this.int(blocks.length)] : undefined;
      const lb = dup
        ? LAY_OF_FP.get(dup.layout.fingerprint)!
        : this.rng() < 0.2
        ? this.pick(LAYOUTS.filter((x) => x.ns === base.ns))
        : base;
      const key = dup ? dup.key : `${lb.ns}/k${this.int(KEYS_PER_NS)}`;
      const off = srcSlot.next++ * SLOT;
      this.h.fill(contentId(key, lb.id.fingerprint), off, lb.bytes);
      const evicted = this.rng() < 0.12;
      blocks.push({
        key,
        namespace: lb.ns,
        layout: lb.id,
        extents: [{ offset: off, bytes: lb.bytes }],
        pins: 0,
        resident: () => !evicted,
      });
      const held = t.lookupPrefix([key], lb.id.fingerprint) === 1;
      if (held || fresh.has(key)) dups++;
      else if (pending.has(key)) maybe++;
      else {
        fresh.add(key);
        if (!evicted) expect.push([key, lb.id.fingerprint]);
      }
      desc.push(`${key}/${lb.id.fingerprint.slice(0, 4)}${evicted ? "(evicted)" : ""}`);
    }
    this.blocks.push(...blocks);
    const r = t.enqueueWrite(this.h.batch(blocks));
    this.op(`write [${desc.join(" ")}] → ${r.status} blocks=${r.blocks} dups=${r.duplicates}`);
    if (r.status === "dropped") return [];
    if (r.duplicates < dups || r.duplicates > dups + maybe) {
      this.violate(
        `enqueueWrite counted ${r.duplicates} duplicates, the batch has ${dups} (+${maybe} maybe)`,
      );
    }
    for (const k of fresh) pending.add(k);
    return expect;
  }

  /** An allocator for layout `l`: slots from a free list, bytes checked at commit. */
  allocator(l: Lay, req: string, partial = true) {
    return (wanted: readonly PrefetchWant[]): PrefetchAllocation[] => {
      const out: PrefetchAllocation[] = [];
      const n = partial && this.rng() < 0.1 ? this.int(wanted.length + 1) : wanted.length;
      for (const w of wanted.slice(0, n)) {
        if (w.payloadBytes !== l.bytes) {
          this.violate(
            `${req}: ${w.key} offered with ${w.payloadBytes} bytes, layout has ${l.bytes}`,
          );
          break;
        }
        const slot = this.freeSlots.pop();
        if (slot === undefined) break;
        const off = PREFETCH_BASE + slot * SLOT;
        this.outstanding++;
        let settled = false;
        const settle = (how: string) => {
          if (settled) this.violate(`${req}: allocation of ${w.key} ${how} after it settled`);
          settled = true;
          this.outstanding--;
          this.freeSlots.push(slot);
        };
        out.push({
          extents: [{ offset: off, bytes: l.bytes }],
          free: () => (this.tally.frees++, settle("freed")),
          commit: () => {
            if (!this.h.holds(contentId(w.key, l.id.fingerprint), off, l.bytes)) {
              this.violate(
                `${req}: ${w.key} committed with wrong bytes (layout ${l.id.fingerprint})`,
              );
            }
            // The block goes to "RAM" and RAM evicts it at once: the slot is free again.
            this.tally.commits++;
            settle("committed");
          },
        });
      }
      return out;
    };
  }

  prefetch(keys: string[], l: Lay, poll: boolean): string {
    const id = `q${this.reqSeq++}`;
    const a = this.tier.prefetch(id, keys, this.allocator(l, id), l.id.fingerprint);
    this.op(
      `prefetch ${id} ${keys[0]}+${keys.length} ${l.id.fingerprint.slice(0, 4)} → ${a.state}${
        a.state === "miss" ? `(${a.reason})` : ""
      }${poll ? "" : " (never polled)"}`,
    );
    if (a.state === "ready") this.violate(`${id}: a new request answered ready`);
    if (a.state === "loading") (this.tally.loading++, this.reqs.set(id, { poll }));
    return id;
  }

  randomPrefetch(): void {
    // Mostly from a block seen on SSD, so most prefetches read something.
    const held = [...this.seen.values()];
    const from = held.length > 0 && this.rng() < 0.75 ? this.pick(held) : undefined;
    const l = from ? LAY_OF_FP.get(from.fp)! : this.pick(LAYOUTS);
    const start = from ? Number(from.key.split("/k")[1]) : this.int(KEYS_PER_NS);
    const len = 1 + this.int(8);
    const keys = Array.from({ length: len }, (_, i) => `${l.ns}/k${(start + i) % KEYS_PER_NS}`);
    this.prefetch(keys, l, this.rng() < 0.7);
    if (this.rng() < 0.4) {
      // Overlapping, right away: joins the read in flight.
      const more = Array.from(
        { length: len + this.int(4) },
        (_, i) => `${l.ns}/k${(start + i) % KEYS_PER_NS}`,
      );
      this.prefetch(more, l, this.rng() < 0.7);
    }
  }

  pollSome(): void {
    for (const [id, r] of this.reqs) {
      if (!r.poll || this.rng() < 0.5) continue;
      const p = this.tier.poll(id);
      this.op(`poll ${id} → ${p}`);
      if (p === "ready") this.reqs.delete(id);
    }
  }

  /** A burst of operations with random yields between them (reads and writes overlap). */
  async burst(): Promise<Array<[string, string]>> {
    const src = { next: 0 };
    const pending = new Set<string>();
    const expect: Array<[string, string]> = [];
    const n = 1 + this.int(6);
    for (let i = 0; i < n; i++) {
      const x = this.rng();
      if (x < 0.45) expect.push(...this.write(src, pending));
      else if (x < 0.85) this.randomPrefetch();
      else if (x < 0.92) this.pollSome();
      else {
        this.op("flushWrites");
        await within(this.tier.flushWrites(), WAIT_MS, "flushWrites");
      }
      if (this.rng() < 0.5) await new Promise((r) => setTimeout(r, this.int(3)));
    }
    return expect;
  }

  // ---- settling and checks ------------------------------------------------

  async settle(): Promise<void> {
    await within(this.tier.flushWrites(), WAIT_MS, `seed ${this.seed}: flushWrites`);
    for (const [id, r] of this.reqs) {
      await within(this.tier.prefetchSettled(id), WAIT_MS, `seed ${this.seed}: prefetch ${id}`);
      if (r.poll) {
        const p = this.tier.poll(id);
        if (p === "loading") this.violate(`${id} still loading after it settled`);
      }
    }
    this.reqs.clear();
  }

  /** What must be idle once nothing runs. */
  checkIdle(closed: boolean): void {
    const s = this.tier.stats();
    for (
      const k of [
        "writeQueueDepth",
        "writeInflight",
        "prefetchQueueDepth",
        "prefetchInflight",
        "prefetchReservedBlocks",
      ] as const
    ) {
      if (s[k] !== 0) this.violate(`${k} is ${s[k]} once settled${closed ? " (closed)" : ""}`);
    }
    if (this.outstanding !== 0) {
      this.violate(`${this.outstanding} prefetch allocations neither committed nor freed`);
    }
    for (const b of this.blocks) {
      if (b.pins !== 0) this.violate(`write block ${b.key} still pinned ${b.pins}×`);
    }
    this.blocks = [];
  }

  async header(path: string, off: number) {
    const f = await Deno.open(path, { read: true });
    try {
      const page = new Uint8Array(PAGE_BYTES);
      await f.seek(off, Deno.SeekMode.Start);
      let got = 0;
      while (got < PAGE_BYTES) {
        const n = await f.read(page.subarray(got));
        if (n === null) break;
        got += n;
      }
      return decodeHeader(page);
    } finally {
      f.close();
    }
  }

  damaged(s: Seen, chainOnly: boolean): boolean {
    return this.damage.some((d) =>
      d.path === s.path && (!chainOnly || d.chain) && recEnd(s) > d.from && s.off < d.to &&
      s.epoch <= d.seqBound
    );
  }

  /** Reads the index for every key, checks it against the disk and the last observation. */
  async observe(): Promise<Map<string, Seen>> {
    const t = this.tier;
    const now = new Map<string, Seen>();
    for (const key of KEYS) {
      const loc = t.locate(key);
      const holders = LAYOUTS.filter((l) =>
        key.startsWith(`${l.ns}/`) && t.lookupPrefix([key], l.id.fingerprint) === 1
      );
      if (!loc) {
        if (holders.length > 0) this.violate(`${key}: lookupPrefix holds it, locate does not`);
        continue;
      }
      if (holders.length !== 1) {
        this.violate(`${key}: located, held by ${holders.length} layouts`);
        continue;
      }
      const l = holders[0];
      if (loc.payloadBytes !== l.bytes) {
        this.violate(`${key}: indexed with ${loc.payloadBytes} bytes, its layout has ${l.bytes}`);
      }
      const h = await this.header(loc.path, loc.fileOffset);
      const s: Seen = {
        key,
        path: loc.path,
        off: loc.fileOffset,
        seq: loc.seq,
        epoch: typeof h === "string" ? -1 : h.epoch,
        fp: l.id.fingerprint,
        bytes: loc.payloadBytes,
      };
      const prev = this.seen.get(key);
      const known = prev && seenId(prev) === seenId(s) ? prev : undefined;
      if (known) s.epoch = known.epoch; // a header we tore keeps the epoch it had
      if (typeof h === "string") {
        if (!known || !this.damaged(known, false)) {
          this.violate(
            `${key}: the index points at ${loc.path}:${loc.fileOffset}, no header (${h})`,
          );
        }
      } else if (h.key !== key || h.seq !== loc.seq || h.layout !== l.id.fingerprint) {
        this.violate(
          `${key}: the index points at ${loc.path}:${loc.fileOffset} seq ${loc.seq}, the disk ` +
            `holds ${h.key} seq ${h.seq} (a reused segment?)`,
        );
      } else {
        const first = await this.header(loc.path, segStart(loc.fileOffset));
        if (typeof first !== "string" && first.epoch === first.seq && first.seq !== h.epoch) {
          this.violate(
            `${key}: indexed record of fill ${h.epoch}, its segment's current fill is ${first.seq}`,
          );
        }
      }
      now.set(key, s);
      this.history.add(seenId(s));
    }
    return now;
  }

  /** May `prev` have left the index (or moved) by now? */
  async mayVanish(prev: Seen, cur: Seen | undefined): Promise<boolean> {
    if (cur && cur.seq > prev.seq) return true; // rewritten (another layout)
    if (this.damaged(prev, false)) return true;
    const first = await this.header(prev.path, segStart(prev.off));
    return typeof first !== "string" && first.seq > prev.seq; // its segment was reused
  }

  async check(expect: Array<[string, string]>, reusedOrSkipped: boolean): Promise<void> {
    const now = await this.observe();
    for (const [key, prev] of this.seen) {
      const cur = now.get(key);
      if (cur && seenId(cur) === seenId(prev)) continue;
      if (!(await this.mayVanish(prev, cur))) {
        this.violate(
          `${key}: left the index (was ${seenId(prev)}, now ${cur ? seenId(cur) : "none"}) ` +
            `though its segment was not reused nor its record damaged`,
        );
      }
    }
    if (!reusedOrSkipped) {
      for (const [key, fp] of expect) {
        if (this.tier.lookupPrefix([key], fp) === 1) continue;
        const cur = now.get(key);
        if (cur && cur.fp !== fp) continue; // a later write of it by another layout
        this.violate(`${key}/${fp.slice(0, 4)}: queued and resident, not written (no reuse)`);
      }
    }
    this.seen = now;
  }

  /** Reads every indexed block alone: an intact one must be served, byte-exact. */
  async readBack(sample: number): Promise<void> {
    const all = [...this.seen.values()];
    for (let i = 0; i < sample && all.length > 0; i++) {
      const s = all.splice(this.int(all.length), 1)[0];
      const l = LAY_OF_FP.get(s.fp)!;
      const before = this.outstanding;
      let committed = false;
      const alloc = this.allocator(l, `readback ${s.key}`, false);
      const id = `rb${this.reqSeq++}`;
      const a = this.tier.prefetch(id, [s.key], (w) => {
        const out = alloc(w);
        return out.map((x) => ({ ...x, commit: () => (committed = true, x.commit()) }));
      }, s.fp);
      if (a.state === "loading") {
        await within(this.tier.prefetchSettled(id), WAIT_MS, `read back ${s.key}`);
        this.tier.poll(id);
      }
      if (!committed && !this.damaged(s, false)) {
        this.violate(
          `${s.key}: intact at ${seenId(s)}, read back → ${a.state}${
            a.state === "miss" ? ` (${a.reason})` : ""
          }, not served`,
        );
      }
      if (this.outstanding !== before) this.violate(`read back ${s.key}: allocation not settled`);
    }
  }

  // ---- damage ---------------------------------------------------------------

  /** The highest fill epoch on disk now: fills opened later have larger ones. */
  async seqBound(): Promise<number> {
    let m = 0;
    for (const s of this.seen.values()) m = Math.max(m, s.seq);
    for (const path of this.paths) {
      for (let k = 0; k < this.segs; k++) {
        const h = await this.header(path, PAGE_BYTES + k * SEG);
        if (typeof h !== "string") m = Math.max(m, h.seq);
      }
    }
    return m;
  }

  tallyTier(): void {
    const s = this.tier.stats();
    this.tally.reuses += s.segmentsReused;
    this.tally.readFailures += s.checksumFailures + s.readFailures;
  }

  async poke(path: string, off: number, bytes: Uint8Array): Promise<void> {
    const f = await Deno.open(path, { read: true, write: true });
    try {
      await f.seek(off, Deno.SeekMode.Start);
      await f.write(bytes);
    } finally {
      f.close();
    }
  }

  async flipPayload(): Promise<void> {
    const all = [...this.seen.values()];
    if (all.length === 0) return;
    const s = this.pick(all);
    const at = s.off + PAGE_BYTES + this.int(s.bytes);
    const f = await Deno.open(s.path, { read: true, write: true });
    const b = new Uint8Array(1);
    await f.seek(at, Deno.SeekMode.Start);
    await f.read(b);
    b[0] ^= 1 << this.int(8);
    await f.seek(at, Deno.SeekMode.Start);
    await f.write(b);
    f.close();
    this.tally.damage++;
    this.op(`damage: flip payload byte of ${seenId(s)} at ${at}`);
    this.damage.push({ path: s.path, from: at, to: at + 1, seqBound: s.epoch, chain: false });
  }

  async tearHeader(): Promise<void> {
    const all = [...this.seen.values()];
    if (all.length === 0) return;
    const s = this.pick(all);
    const at = s.off + 8 + this.int(80);
    await this.poke(s.path, at, Uint8Array.from([0xde, 0xad, 0xbe, 0xef]));
    this.tally.damage++;
    this.op(`damage: tear header of ${seenId(s)} at ${at}`);
    const bound = await this.seqBound();
    this.damage.push({
      path: s.path,
      from: s.off,
      to: segStart(s.off) + SEG,
      seqBound: bound,
      chain: true,
    });
  }

  /** (Tier closed.) Cuts a file inside or after a record. */
  async truncate(): Promise<void> {
    const all = [...this.seen.values()];
    if (all.length === 0) return;
    const s = this.pick(all);
    const cut = s.off + this.int(recordBytes(s.bytes));
    await Deno.truncate(s.path, cut);
    this.tally.damage++;
    this.op(`damage: truncate ${s.path} at ${cut} (inside ${seenId(s)})`);
    const bound = await this.seqBound();
    this.damage.push({ path: s.path, from: cut, to: Infinity, seqBound: bound, chain: true });
  }

  // ---- restart --------------------------------------------------------------

  async restart(): Promise<void> {
    // Sometimes close with writes and reads still running: close drains them.
    if (this.rng() < 0.5) await this.burst();
    this.op("close");
    this.tallyTier();
    await within(this.tier.close(), WAIT_MS, `seed ${this.seed}: close`);
    this.tally.restarts++;
    this.reqs.clear();
    this.checkIdle(true);
    await this.check([], true);
    const pre = this.seen;
    if (this.rng() < 0.3) await this.truncate();
    if (this.rng() < 0.3) await this.tearHeader();
    const reset = this.rng() < 0.2;
    if (this.rng() < 0.2) {
      // Resized: the segments past the new end are dropped with their records.
      const segs = 4 + this.int(4);
      this.op(`resize ${this.segs} → ${segs} segments per file`);
      if (segs < this.segs) {
        const bound = await this.seqBound();
        for (const path of this.paths) {
          this.damage.push({
            path,
            from: PAGE_BYTES + segs * SEG,
            to: Infinity,
            seqBound: bound,
            chain: true,
          });
        }
      }
      this.segs = segs;
    }
    await this.open(reset);
    const t = this.tier;
    if (reset) {
      this.tally.resets++;
      for (const key of KEYS) {
        if (t.locate(key)) this.violate(`${key}: indexed after --ssd-reset`);
      }
      this.damage = [];
      this.history.clear();
      this.seen = new Map();
      return;
    }
    for (const [key, s] of pre) {
      const loc = t.locate(key);
      if (loc && loc.path === s.path && loc.fileOffset === s.off && loc.seq === s.seq) continue;
      if (this.damaged(s, true)) continue;
      if (loc && loc.seq > s.seq) continue; // a newer record of it (checked below)
      this.violate(
        `${key}: indexed at ${seenId(s)} before the close, ${
          loc ? `at ${loc.path}:${loc.fileOffset}#${loc.seq}` : "not indexed"
        } after the reopen, no damage before it in its segment`,
      );
    }
    const now = await this.observe();
    for (const [key, s] of now) {
      const p = pre.get(key);
      if (p && seenId(p) === seenId(s)) continue;
      if (!this.history.has(seenId(s))) {
        this.violate(`${key}: recovered at ${seenId(s)}, a record never indexed before`);
      }
    }
    this.seen = now;
  }
}

async function runSeed(h: Harness, seed: number): Promise<void> {
  const m = new Model(h, seed);
  await m.open(m.rng() < 0.5);
  try {
    for (let step = 0; step < STEPS; step++) {
      m.op(`-- step ${step}`);
      const x = m.rng();
      if (x < 0.1) {
        await m.restart();
      } else if (x < 0.16) {
        await m.flipPayload();
      } else if (x < 0.2) {
        await m.tearHeader();
      } else {
        const s0 = m.tier.stats();
        const expect = await m.burst();
        await m.settle();
        const s1 = m.tier.stats();
        m.checkIdle(false);
        const moved = s1.segmentsReused !== s0.segmentsReused ||
          s1.writeSkippedNoSpace !== s0.writeSkippedNoSpace;
        await m.check(expect, moved);
        if (m.rng() < 0.3) await m.readBack(4);
      }
      m.assertClean();
    }
    await m.readBack(KEYS.length);
    m.assertClean();
  } finally {
    m.tallyTier();
    await m.tier.close();
  }
  console.log(`seed ${seed}: ${JSON.stringify(m.tally)}`);
}

for (const seed of SEEDS) {
  Deno.test(`SSD tier against its model, seed ${seed}: never wrong bytes, no loss, no leak`, async () => {
    const h = await harness();
    try {
      await runSeed(h, seed);
    } finally {
      await h.close();
    }
  });
}
