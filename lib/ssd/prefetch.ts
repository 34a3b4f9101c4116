/**
 * SSD prefetch: blocks past a query's RAM prefix are read from SSD into pool
 * space the caller plans, verified, and committed into RAM the moment each
 * one verifies — whoever asked, whether or not they poll again. A
 * credit-bounded stage (`ssd.prefetch`): a queue with policy `refuse` (a full
 * queue answers "miss" at once and counts backpressure: the query is
 * answered from RAM, a miss is cheaper than waiting) in front of `inflight`
 * readers, plus a global budget of blocks being read.
 *
 * Reads are shared: `key → read in flight`; a query that walks onto a key
 * being read for another request joins that read. A request id is polled
 * until every read it waits on ended (`ready`, once); a finished request
 * nobody polls is forgotten after a TTL (its blocks simply stay cached).
 *
 * The read itself — io batches, verification of every record, commit as
 * each verifies, the rest freed once every batch ended — is
 * prefetch_read.ts.
 *
 * @module
 */

import { Stage, type StageMetrics, type StageOptions } from "../pipeline/stage.ts";
import type { PoolExtent } from "../transfer/ranges.ts";
import type { TierMissReason } from "../storage/tier.ts";
import type { SsdIndex, SsdLocation } from "./index.ts";
import {
  type PrefetchRead,
  type PrefetchReadCounters,
  PrefetchReader,
  type PrefetchReaderDeps,
} from "./prefetch_read.ts";
import { monotonicNow } from "../clock.ts";

/** Period of the sweep that forgets finished prefetches. */
const EXPIRY_SWEEP_MS = 1_000;

/**
 * Pool space the caller allocated for one prefetched block. The tier calls
 * exactly one of `commit` (verified: the bytes are the block's, make it
 * visible) or `free` (not delivered: give the space back).
 */
export interface PrefetchAllocation {
  extents: PoolExtent[];
  free(): void;
  commit(): void;
}

/** A block a prefetch wants pool space for. */
export interface PrefetchWant {
  key: string;
  /** Its position in the keys given to {@link SsdPrefetcher.prefetch}. */
  index: number;
  payloadBytes: number;
}

/**
 * Allocates pool space for these blocks, in order. May return fewer than
 * asked (the rest is not fetched) or an empty array.
 */
export type PrefetchAllocator = (wanted: readonly PrefetchWant[]) => PrefetchAllocation[];

/** The answer to {@link SsdPrefetcher.prefetch}. */
export type PrefetchAnswer =
  | { state: "loading" }
  /** Every read this request waited for has ended; its verified blocks were committed as they landed. */
  | { state: "ready" }
  /** The Tier port's reasons (the port maps "not-on-ssd" to "not-held": ssd_tier_port.ts). */
  | { state: "miss"; reason: Exclude<TierMissReason, "not-held"> | "not-on-ssd" };

/**
 * Stage settings of prefetch: a full queue refuses at once (the query
 * answers with what RAM has: a miss is cheaper than waiting), `inflight`
 * reads run at once.
 */
export function prefetchStageOptions(queueDepth: number, inflight: number): StageOptions {
  return { concurrency: inflight, queue: { depth: queueDepth, policy: "refuse" } };
}

/** One read of blocks from SSD into pool space; queries of the same blocks join it. */
interface PrefetchJob extends PrefetchRead {
  done: boolean;
  /** When it ended (lib/clock.ts monotonicNow). */
  doneAt: number;
  /** Resolves when it ended (every allocation committed or freed). */
  ended: Promise<void>;
  end: () => void;
}

/** What a request id waits for. */
interface PrefetchRequest {
  jobs: PrefetchJob[];
}

/** Prefetch counters (part of `SsdStats`). */
export interface SsdReadStats extends PrefetchReadCounters {
  prefetchQueueDepth: number;
  prefetchInflight: number;
  prefetchBudgetBlocks: number;
  prefetchReservedBlocks: number;
  prefetchBackpressure: number;
  prefetchPartial: number;
  prefetchExpired: number;
  /** Blocks on SSD not served because another layout of their namespace asked. */
  layoutMismatches: number;
  /** Prefetches answered as a miss because the tier was degraded (stall.ts). */
  prefetchDegradedMisses: number;
}

/** What the prefetcher works on (the tier's open files, index and io) and its bounds. */
export interface SsdPrefetcherDeps extends PrefetchReaderDeps {
  queueDepth: number;
  inflight: number;
  /** Blocks being read at once, over every prefetch. */
  maxBlocks: number;
  /** A finished prefetch not polled within this is forgotten. */
  ttlMs: number;
  metrics?: StageMetrics;
  /** True while the io is stalled (stall.ts): prefetches answer a miss. */
  degraded?: () => boolean;
}

/**
 * The prefetch flow of one SSD tier.
 *
 * @example
 * ```ts
 * const p = new SsdPrefetcher({ io, files, index, log, chunk: 64, queueDepth: 256,
 *   inflight: 8, maxBlocks: 4096, ttlMs: 30_000 });
 * p.prefetch("req-1", keysPastRam, allocate, fingerprint); // { state: "loading" }
 * p.poll("req-1");                                          // "loading" … "ready"
 * ```
 */
export class SsdPrefetcher {
  readonly #index: SsdIndex;
  readonly #reader: PrefetchReader;
  readonly #maxBlocks: number;
  readonly #ttlMs: number;
  readonly #stage: Stage<PrefetchJob, void>;
  /** Request id → the reads it waits for (its own and the ones it joined). */
  readonly #requests = new Map<string, PrefetchRequest>();
  /** Key → the read bringing it into the pool now. */
  readonly #fetching = new Map<string, PrefetchJob>();
  readonly #expiryTimer: number;
  readonly #degraded: () => boolean;
  #reserved = 0;
  #closed = false;
  readonly #s = {
    prefetchBackpressure: 0,
    prefetchPartial: 0,
    prefetchExpired: 0,
    layoutMismatches: 0,
    prefetchDegradedMisses: 0,
  };

  constructor(d: SsdPrefetcherDeps) {
    this.#index = d.index;
    this.#reader = new PrefetchReader(d);
    this.#maxBlocks = d.maxBlocks;
    this.#ttlMs = d.ttlMs;
    this.#degraded = d.degraded ?? (() => false);
    this.#stage = new Stage<PrefetchJob, void>(
      "ssd.prefetch",
      { ...prefetchStageOptions(d.queueDepth, d.inflight), metrics: d.metrics },
      (job) => this.#prefetchJob(job),
    );
    // Finished prefetches nobody came back for are forgotten even on an idle server.
    this.#expiryTimer = Number(setInterval(() => this.#expire(), EXPIRY_SWEEP_MS));
    Deno.unrefTimer(this.#expiryTimer);
  }

  /** True while request `reqId` has a prefetch loading or not yet answered `ready`. */
  has(reqId: string): boolean {
    return this.#requests.has(reqId);
  }

  /**
   * Polls request `reqId`: `loading` while any read it waits on runs, then
   * `ready` once (the request is forgotten); undefined for an unknown id.
   */
  poll(reqId: string): "loading" | "ready" | undefined {
    const req = this.#requests.get(reqId);
    if (!req) return undefined;
    if (req.jobs.some((j) => !j.done)) return "loading";
    this.#requests.delete(reqId);
    return "ready";
  }

  /**
   * Resolves once every read request `reqId` waits on ended (`poll` then
   * answers `ready`); undefined for an unknown id or one whose reads ended.
   */
  settled(reqId: string): Promise<void> | undefined {
    const req = this.#requests.get(reqId);
    if (!req) return undefined;
    const running = req.jobs.filter((j) => !j.done);
    if (running.length === 0) return undefined;
    return Promise.all(running.map((j) => j.ended)).then(() => {});
  }

  /**
   * The prefetch protocol of QueryPrefetch, keyed by request id:
   *  - first call: walks `keys` (the part of the prefix past RAM) from the
   *    first: a key being read for another request joins that read; a key
   *    on SSD under layout `layout` is read into pool space from `allocate`
   *    (within the global budget); the walk stops at the first key that is
   *    neither. Something to wait for → `loading`, else `miss` with why;
   *  - later calls with the same id: `loading` while any of those reads
   *    runs, then `ready` once (the request is forgotten).
   * Every verified block is committed (its allocation's `commit`) the moment
   * it lands, so it is an ordinary cached block for every query, whether or
   * not anyone polls again. A block that fails verification ends its read
   * there; it is dropped from the index and counted.
   */
  prefetch(
    reqId: string,
    keys: readonly string[],
    allocate: PrefetchAllocator,
    layout: string,
  ): PrefetchAnswer {
    const polled = this.poll(reqId);
    if (polled) return { state: polled };
    if (this.#closed) return { state: "miss", reason: "closed" };
    if (this.#degraded()) {
      // A stalled disk: a read would wait behind it (and hold pool space) for no one.
      this.#s.prefetchDegradedMisses++;
      return { state: "miss", reason: "degraded" };
    }
    const { joined, mine, locs, stop } = this.#walk(keys, layout);
    if (stop === "other-layout") {
      this.#s.layoutMismatches++;
      if (joined.size === 0 && mine.length === 0) return { state: "miss", reason: "other-layout" };
    }
    if (stop === "budget") {
      if (joined.size === 0 && mine.length === 0) {
        this.#s.prefetchBackpressure++;
        return { state: "miss", reason: "budget" };
      }
      if (mine.length > 0) this.#s.prefetchPartial++;
    }
    if (joined.size === 0 && mine.length === 0) return { state: "miss", reason: "not-on-ssd" };
    const jobs = [...joined];
    if (mine.length > 0) {
      const own = this.#startRead(mine, locs, allocate, layout);
      if (own === "queue-full") {
        this.#s.prefetchBackpressure++;
        if (jobs.length === 0) return { state: "miss", reason: own };
      } else if (own === "no-pool-space") {
        // Joined reads still serve this request: only a request left with nothing counts.
        if (jobs.length === 0) {
          this.#s.prefetchBackpressure++;
          return { state: "miss", reason: own };
        }
      } else jobs.push(own);
    }
    // Swept here too (not only by the timer) so the table stays bounded under a burst;
    // not on the miss paths above, which every cold query takes.
    this.#expire();
    this.#requests.set(reqId, { jobs });
    return { state: "loading" };
  }

  /**
   * Walks `keys` from the first: reads in flight to join, then keys on SSD
   * under `layout` to read (within the budget), up to the first key that is
   * neither (`stop` says why).
   */
  #walk(keys: readonly string[], layout: string): {
    joined: Set<PrefetchJob>;
    mine: PrefetchWant[];
    locs: SsdLocation[];
    stop: "not-on-ssd" | "other-layout" | "budget" | undefined;
  } {
    const joined = new Set<PrefetchJob>();
    const mine: PrefetchWant[] = [];
    const locs: SsdLocation[] = [];
    const room = this.#maxBlocks - this.#reserved;
    for (let index = 0; index < keys.length; index++) {
      const key = keys[index];
      const running = this.#fetching.get(key);
      if (running) {
        if (running.layout !== layout) return { joined, mine, locs, stop: "other-layout" };
        joined.add(running);
        continue;
      }
      const loc = this.#index.get(key);
      if (!loc) return { joined, mine, locs, stop: "not-on-ssd" };
      if (loc.layout !== layout) return { joined, mine, locs, stop: "other-layout" };
      if (mine.length >= room) return { joined, mine, locs, stop: "budget" };
      mine.push({ key, index, payloadBytes: loc.payloadBytes });
      locs.push(loc);
    }
    return { joined, mine, locs, stop: undefined };
  }

  /**
   * Allocates pool space for `mine` and queues one read of what got space.
   * Returns the read, or why none was started (its space given back).
   */
  #startRead(
    mine: PrefetchWant[],
    locs: SsdLocation[],
    allocate: PrefetchAllocator,
    layout: string,
  ): PrefetchJob | "no-pool-space" | "queue-full" {
    const allocations = allocate(mine).slice(0, mine.length);
    const n = allocations.length;
    if (n === 0) return "no-pool-space";
    let end = () => {};
    const ended = new Promise<void>((r) => end = r);
    const job: PrefetchJob = {
      keys: mine.slice(0, n).map((w) => w.key),
      locs: locs.slice(0, n),
      allocations,
      layout,
      done: false,
      doneAt: 0,
      ended,
      end,
    };
    const sub = this.#stage.submit(job);
    if (sub.status === "refused" || sub.status === "dropped") {
      // A free that throws must neither escape the query nor keep the others' space.
      this.#reader.freeFrom(job, 0);
      return "queue-full";
    }
    this.#reserved += n;
    for (const k of job.keys) this.#fetching.set(k, job);
    return job;
  }

  async #prefetchJob(job: PrefetchJob): Promise<void> {
    try {
      // A key leaves the table as its block commits: from then on queries find it in RAM.
      await this.#reader.read(job, (key) => this.#fetching.delete(key));
    } finally {
      for (const k of job.keys) if (this.#fetching.get(k) === job) this.#fetching.delete(k);
      this.#reserved -= job.allocations.length;
      job.done = true;
      job.doneAt = monotonicNow();
      job.end();
    }
  }

  /** Forgets finished prefetches nobody polled for (their blocks stay cached). */
  #expire(): void {
    const cutoff = monotonicNow() - this.#ttlMs;
    for (const [id, req] of this.#requests) {
      if (req.jobs.every((j) => j.done && j.doneAt < cutoff)) {
        this.#requests.delete(id);
        this.#s.prefetchExpired++;
      }
    }
  }

  /** Counters and gauges. */
  stats(): SsdReadStats {
    const p = this.#stage.stats();
    return {
      ...this.#reader.stats(),
      ...this.#s,
      prefetchQueueDepth: p.queue.depth,
      prefetchInflight: p.inflight,
      prefetchBudgetBlocks: this.#maxBlocks,
      prefetchReservedBlocks: this.#reserved,
    };
  }

  /**
   * Stops accepting prefetches (later ones miss), lets running reads land,
   * and forgets every request. Their blocks were committed or freed.
   */
  async close(): Promise<void> {
    this.#closed = true;
    clearInterval(this.#expiryTimer);
    await this.#stage.drain();
    this.#requests.clear();
    this.#reserved = 0;
  }
}
