/**
 * Test scaffolding for the SSD tier: a host-backend engine, pool and
 * completion ring; a bump allocator over the pool; block contents derived
 * from the key so every byte can be checked after a round trip.
 */
import { Engine, type Pool } from "../../ffi/native.ts";
import { type Completion, CompletionRing } from "../../ffi/ring.ts";
import { Observable } from "rxjs";
import { SSD_TAG_BASE } from "../../lib/ssd/io.ts";
import type {
  PrefetchAllocation,
  PrefetchAllocator,
  PrefetchWant,
} from "../../lib/ssd/prefetch.ts";
import { SsdTier, type SsdTierOptions } from "../../lib/ssd/tier.ts";
import type { EnqueueResult, SsdWriteBatch, SsdWriteBlock } from "../../lib/ssd/write_behind.ts";
import { layoutIdentity } from "../../lib/storage/layout.ts";
import { Logger } from "../../lib/log.ts";
import { settlesWithin } from "../../lib/http/shutdown.ts";

/** The layout the tier tests write and read under (one layer of one segment per block). */
export const TEST_LAYOUT = layoutIdentity({
  tpSize: 1,
  ppSize: 1,
  collapseTp: false,
  layers: [{ name: "test.layer", segBytes: 128 * 1024, numSegments: 1 }],
});
/** Its fingerprint, the `layout` argument of prefetch and lookupPrefix. */
export const FP = TEST_LAYOUT.fingerprint;
/** The namespace test blocks are written under. */
export const TEST_NAMESPACE = "ns-test";

/** A bump allocator over the pool that records what the tier committed and freed. */
export type TestAllocator = PrefetchAllocator & {
  freed: number;
  given: number;
  /** Committed blocks in commit order: key → pool extents. */
  committed: Map<string, { offset: number; bytes: number }[]>;
};

/** A block at a pool range that counts its pins; `resident()` false = RAM evicted it. */
export type TestBlock = SsdWriteBlock & {
  pins: number;
  extents: { offset: number; bytes: number }[];
  resident: () => boolean;
};

export interface Harness {
  engine: Engine;
  pool: Pool;
  ring: CompletionRing;
  dir: string;
  logs: string[];
  log: Logger;
  /** Pool bytes [off, off+len) filled from `key`. */
  fill(key: string, off: number, len: number): void;
  /** True when pool bytes hold the pattern of `key`. */
  holds(key: string, off: number, len: number): boolean;
  /** A write block at a pool range, with pin counting. */
  block(
    key: string,
    off: number,
    len: number,
    resident?: () => boolean,
    layout?: typeof TEST_LAYOUT,
  ): TestBlock;
  /** A write batch of test blocks: pins the resident ones when the write starts. */
  batch(blocks: TestBlock[]): SsdWriteBatch<TestBlock>;
  /** `tier.enqueueWrite(batch(blocks))`. */
  write(tier: SsdTier, blocks: TestBlock[]): EnqueueResult;
  /** Allocator over pool bytes from `base` (bump; free() counted in `freed`, commits recorded). */
  allocator(base: number, limit?: number): TestAllocator;
  /** An SsdTier on this pool, ring and log; its files go in `dir` unless `paths` says otherwise. */
  /** A tier on the harness's pool, log and dir (`paths`), and its ring unless `ring` is given. */
  openTier(
    options: Omit<SsdTierOptions, "pool" | "ring" | "log" | "paths"> & {
      paths?: string[];
      ring?: SsdTierOptions["ring"];
    },
  ): Promise<SsdTier>;
  close(): Promise<void>;
}

/** xorshift stream seeded by the key: distinct, deterministic content per block. */
function pattern(key: string, out: Uint8Array): void {
  let s = 2166136261;
  for (let i = 0; i < key.length; i++) s = Math.imul(s ^ key.charCodeAt(i), 16777619);
  s = s >>> 0 || 1;
  const w = new Uint32Array(out.buffer, out.byteOffset, out.byteLength >> 2);
  for (let i = 0; i < w.length; i++) {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    w[i] = s >>> 0;
  }
  for (let i = w.length * 4; i < out.length; i++) out[i] = (s >>> (i & 24)) & 0xff;
}

/**
 * `p`, or an error naming `what` once `ms` passed: a test of an error path
 * fails (instead of hanging) when a promise it waits for is never settled.
 */
export async function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  if (!(await settlesWithin(p, ms))) throw new Error(`${what} did not end within ${ms} ms`);
  return await p;
}

export async function harness(poolBytes = 64 << 20): Promise<Harness> {
  const engine = Engine.open({ backend: "host" });
  const pool = engine.createPool(poolBytes);
  const ring = new CompletionRing(4096);
  const dir = await Deno.makeTempDir({ prefix: "pf-ssd-test-" });
  const logs: string[] = [];
  const h: Harness = {
    engine,
    pool,
    ring,
    dir,
    logs,
    log: new Logger("debug", {}, (line) => logs.push(line)),
    fill(key, off, len) {
      pattern(key, h.pool.view(off, len));
    },
    holds(key, off, len) {
      const want = new Uint8Array(len);
      pattern(key, want);
      const got = h.pool.view(off, len);
      for (let i = 0; i < len; i++) if (got[i] !== want[i]) return false;
      return true;
    },
    block(key, off, len, resident = () => true, layout = TEST_LAYOUT) {
      return {
        key,
        namespace: TEST_NAMESPACE,
        layout,
        extents: [{ offset: off, bytes: len }],
        pins: 0,
        resident,
      };
    },
    batch(blocks) {
      return {
        blocks,
        pin(fresh) {
          const here = fresh.map((b) => b.resident());
          const pinned = fresh.filter((_, i) => here[i]);
          for (const b of pinned) b.pins++;
          let released = false;
          return {
            extents: fresh.map((b, i) => here[i] ? b.extents : undefined),
            release() {
              if (released) throw new Error("write batch released twice");
              released = true;
              for (const b of pinned) b.pins--;
            },
          };
        },
      };
    },
    write(tier, blocks) {
      return tier.enqueueWrite(h.batch(blocks));
    },
    allocator(base, limit = poolBytes) {
      let next = base;
      const fn = ((wanted: readonly PrefetchWant[]) => {
        const out: PrefetchAllocation[] = [];
        for (const w of wanted) {
          const n = w.payloadBytes;
          if (next + n > limit) break;
          const off = next;
          next += Math.ceil(n / 4096) * 4096;
          fn.given++;
          const extents = [{ offset: off, bytes: n }];
          let settled = false;
          const settle = () => {
            if (settled) throw new Error(`allocation of ${w.key} settled twice`);
            settled = true;
          };
          out.push({
            extents,
            free: () => (settle(), fn.freed++),
            commit: () => (settle(), fn.committed.set(w.key, extents)),
          });
        }
        return out;
      }) as TestAllocator;
      fn.freed = 0;
      fn.given = 0;
      fn.committed = new Map();
      return fn;
    },
    openTier(options) {
      return SsdTier.open({
        pool: pool.handle,
        log: h.log,
        ...options,
        ring: options.ring ?? ring,
        paths: options.paths ?? [dir],
      });
    },
    async close() {
      await ring.shutdown();
      ring.destroy();
      pool.close();
      engine.close();
      await Deno.remove(dir, { recursive: true });
    },
  };
  return h;
}

/**
 * The hung-disk seam: `ring` with the SSD's completion records held back while
 * `held.on` (or, given `hold`, while it says so until the first release), as a
 * disk that never completes looks to the tier; `held.release()` delivers them,
 * as the kernel finally would.
 */
export function holdingRing(
  ring: { handle: number; completions$: Observable<Completion> },
  hold?: () => boolean,
) {
  const held = { on: false, released: false, parked: [] as Completion[], release: () => {} };
  const holding = hold ? () => !held.released && hold() : () => held.on;
  const completions$ = new Observable<Completion>((sub) => {
    held.release = () => {
      held.on = false;
      held.released = true;
      for (const c of held.parked.splice(0)) sub.next(c);
    };
    return ring.completions$.subscribe({
      next: (c) => (c.tag >= SSD_TAG_BASE && holding() ? held.parked.push(c) : sub.next(c)),
      error: (e) => sub.error(e),
      complete: () => sub.complete(),
    });
  });
  return { ring: { handle: ring.handle, completions$ }, held };
}
