/**
 * The tiers below RAM as the engine sees them: one object, built once by the
 * composition root over the store and the {@link Tier}s in lookup order
 * (SSD, then peer), that the engine calls at three points (and at a Save's
 * discard, {@link LowerTiers.drop}):
 *
 *  - **seal** ({@link LowerTiers.sealed}): blocks a save just sealed enter
 *    the write-behind chain;
 *  - **query** ({@link LowerTiers.beforeQuery}): a prefix that continues past
 *    RAM is fetched from the first tier that holds it, and the query answers
 *    "loading" until the tier's reads ended;
 *  - **register** ({@link LowerTiers.storedLayouts}): a topology is checked
 *    against the layouts the tiers keep its namespace under.
 *
 * Write-behind is a chain of bounded stages (lib/pipeline), each with a fixed
 * depth, a depth gauge and one stated overflow policy; nothing upstream ever
 * waits on a tier:
 *
 * | stage          | where                     | queue (policy, depth)                      | workers                  | full queue                                    |
 * | -------------- | ------------------------- | ------------------------------------------ | ------------------------ | --------------------------------------------- |
 * | `save.gather`  | engine                    | refuse, 64                                 | 4                        | Save answers RESOURCE_EXHAUSTED (engine retries or recomputes) |
 * | seal           | end of the gather worker  | none: it runs in the gather worker's credit | —                       | cannot overflow                               |
 * | `tier.admit`   | here                      | drop-newest, `admitQueueDepth` (64)        | 1                        | batch dropped, counted; blocks stay RAM-only   |
 * | `ssd.write`    | the SSD tier              | drop-newest, `--ssd-write-queue-depth`     | `--ssd-write-inflight`   | batch dropped, counted; never pinned           |
 *
 * The admit worker turns a sealed batch into one `put` per tier (each tier
 * skips what it holds or queues already and pins only when its write
 * starts); the depth gauges are `pegaflow_queue_depth{queue="tier.admit"}`
 * and `{queue="ssd.write"}`.
 *
 * @module
 */

import { errorText, Logger } from "../log.ts";
import { Stage, type StageMetrics, type StageOptions } from "../pipeline/stage.ts";
import { blockLayoutIdentity } from "./layout.ts";
import type { KvStore } from "./store.ts";
import type { DiscardRequest, DiscardResult } from "./discard.ts";
import type { StoredLayout, Tier, TierBlocks, TierMissReason } from "./tier.ts";

/** Default depth of the `tier.admit` queue (sealed batches waiting for the tiers). */
export const DEFAULT_ADMIT_QUEUE_DEPTH = 64;

/**
 * Stage settings of `tier.admit`: a full queue drops the newest sealed batch
 * (a save never waits on a lower tier; the blocks simply stay RAM-only), one
 * worker (its work is bookkeeping, not I/O).
 */
export function admitStageOptions(depth: number): StageOptions {
  return { concurrency: 1, queue: { depth, policy: "drop-newest" } };
}

/** What RAM must answer for the tiers (a {@link KvStore} fits). */
export type TierRam = Pick<KvStore, "blockState" | "layoutOf">;

/** A layout a tier keeps a namespace's blocks under, with where. */
export interface TierStoredLayout extends StoredLayout {
  /** The tier's {@link Tier.label} (`SSD`). */
  where: string;
}

/** Construction options of {@link LowerTiers}. */
export interface LowerTiersOptions {
  ram: TierRam;
  /** In lookup order: a query asks the first tier first. */
  tiers: readonly Tier[];
  /** Depth of the `tier.admit` queue. Default {@link DEFAULT_ADMIT_QUEUE_DEPTH}. */
  admitQueueDepth?: number;
  /** Metric hooks of the `tier.admit` stage. */
  stageMetrics?: (stage: string) => StageMetrics;
  /** Where a tier's failed put is reported. Default: a stderr logger at "info". */
  log?: Logger;
}

/** Per-tier answers to queries (hit attribution), for /metrics. */
export interface TierQueryCounts {
  /** Queries a fetch from this tier was started or joined for. */
  loading: number;
  /** Polls that found this tier's fetch ended (the next RAM lookup hits its blocks). */
  ready: number;
  /** Queries this tier could not serve, by reason. */
  miss: Record<TierMissReason, number>;
}

/**
 * Where a query's answer came from (hit attribution): `ram` (its prefix was in
 * the pool), a tier's name (the fetch this request waited for brought it),
 * or `miss` (no block of it anywhere).
 */
export interface QuerySourceCounts {
  /** Final answers (not "loading") by source. */
  queries: Record<string, number>;
  /** Blocks of the prefix the answers held, by source. */
  blocks: Record<string, number>;
}

/** Counters of {@link LowerTiers}. */
export interface LowerTiersStats {
  admitQueueDepth: number;
  /** Sealed batches dropped by a full `tier.admit` queue, and their blocks. */
  admitDropped: number;
  admitDroppedBlocks: number;
  /** Sealed batches a tier's `put` threw on, by tier (the other tiers still got them). */
  admitFailed: Record<string, number>;
  queries: Record<string, TierQueryCounts>;
  sources: QuerySourceCounts;
}

interface AdmitJob {
  namespace: string;
  hashes: readonly Uint8Array[];
}

function emptyCounts(): TierQueryCounts {
  return {
    loading: 0,
    ready: 0,
    miss: {
      "not-held": 0,
      "other-layout": 0,
      budget: 0,
      "queue-full": 0,
      "no-pool-space": 0,
      degraded: 0,
      closed: 0,
    },
  };
}

/**
 * The lower tiers behind one object.
 *
 * @example
 * ```ts
 * const tiers = new LowerTiers({ ram: store, tiers: [new SsdStorageTier(ssd, storeTierHost(store), log)] });
 * const engine = new KvEngine({ ..., tiers });
 * // engine: after completeSave → tiers.sealed(ns, sealedHashBytes)
 * //         in QueryPrefetch    → if (tiers.beforeQuery(ns, inst, hashes, reqId)) answer "loading"
 * await tiers.close();
 * ```
 */
export class LowerTiers {
  readonly tiers: readonly Tier[];
  readonly #ram: TierRam;
  readonly #admit: Stage<AdmitJob, void>;
  readonly #admitPending = new Set<Promise<unknown>>();
  readonly #queries = new Map<string, TierQueryCounts>();
  readonly #admitFailed: Record<string, number> = {};
  readonly #log: Logger;
  readonly #sources: QuerySourceCounts = {
    queries: { ram: 0, miss: 0 },
    blocks: { ram: 0, miss: 0 },
  };
  #admitDropped = 0;
  #admitDroppedBlocks = 0;
  #closing: Promise<void> | undefined;

  constructor(opts: LowerTiersOptions) {
    this.tiers = opts.tiers;
    this.#ram = opts.ram;
    this.#log = opts.log ?? new Logger("info", { component: "tier.admit" });
    for (const t of opts.tiers) {
      this.#admitFailed[t.name] = 0;
      this.#queries.set(t.name, emptyCounts());
      this.#sources.queries[t.name] = 0;
      this.#sources.blocks[t.name] = 0;
    }
    this.#admit = new Stage<AdmitJob, void>(
      "tier.admit",
      {
        ...admitStageOptions(opts.admitQueueDepth ?? DEFAULT_ADMIT_QUEUE_DEPTH),
        metrics: opts.stageMetrics?.("tier.admit"),
      },
      (job) => Promise.resolve(this.#admitJob(job)),
    );
  }

  /**
   * Blocks a save just sealed (the engine's hash bytes): offered to every
   * tier through the `tier.admit` stage. Never waits.
   */
  sealed(namespace: string, hashes: readonly Uint8Array[]): "queued" | "dropped" | "none" {
    if (hashes.length === 0 || this.tiers.length === 0) return "none";
    const sub = this.#admit.submit({ namespace, hashes });
    if (sub.status !== "accepted") {
      this.#admitDropped++;
      this.#admitDroppedBlocks += hashes.length;
      return "dropped";
    }
    const ended = sub.done();
    this.#admitPending.add(ended);
    ended.then(() => this.#admitPending.delete(ended));
    return "queued";
  }

  #admitJob(job: AdmitJob): void {
    const layout = this.#ram.layoutOf(job.namespace);
    if (!layout) return; // sealed blocks always have a namespace
    const blocks: TierBlocks = {
      namespace: job.namespace,
      hashes: job.hashes,
      layout: blockLayoutIdentity(layout),
    };
    // One tier's failure is its own: the tiers after it still get the batch.
    for (const t of this.tiers) {
      try {
        t.put(blocks);
      } catch (e) {
        this.#admitFailed[t.name]++;
        this.#log.warn("tier put failed: sealed blocks stay out of this tier", {
          tier: t.name,
          namespace: job.namespace,
          blocks: job.hashes.length,
          error: errorText(e),
        });
      }
    }
  }

  /**
   * In QueryPrefetch, before the RAM lookup. True: answer "loading" (a tier
   * is bringing this request's prefix into RAM). False: the RAM lookup gives
   * the answer — everything a tier fetched for this request was committed
   * into RAM as it landed.
   *
   * A request id with a fetch in a tier is polled there (`take`): loading
   * while it runs, then ready once. Otherwise the hashes past the RAM prefix
   * are offered to each tier in order; the first that starts or joins reads
   * answers the query.
   */
  beforeQuery(
    namespace: string,
    instance: string,
    hashes: readonly Uint8Array[],
    request: string,
  ): boolean {
    if (this.tiers.length === 0) return false;
    const requestId = tierRequestId(instance, request);
    const layout = this.#ram.layoutOf(namespace);
    if (!layout) return this.#answered("miss", 0);
    let ended: string | undefined;
    for (const t of this.tiers) {
      const a = t.take(requestId);
      if (a.state === "loading") return true;
      if (a.state === "ready") {
        this.#queries.get(t.name)!.ready++;
        ended ??= t.name;
      }
    }
    let ram = 0;
    while (ram < hashes.length && this.#ram.blockState(namespace, hashes[ram]) === "sealed") ram++;
    // The fetch this request waited for has ended: RAM answers, nothing new starts.
    if (ended !== undefined) return this.#answered(ram > 0 ? ended : "miss", ram);
    if (ram === hashes.length) return this.#answered(ram > 0 ? "ram" : "miss", ram);
    const rest: TierBlocks = {
      namespace,
      hashes: hashes.slice(ram),
      layout: blockLayoutIdentity(layout),
    };
    for (const t of this.tiers) {
      const a = t.prefetch(requestId, rest);
      const counts = this.#queries.get(t.name)!;
      if (a.state === "loading") {
        counts.loading++;
        return true;
      }
      counts.miss[a.reason]++;
    }
    return this.#answered(ram > 0 ? "ram" : "miss", ram);
  }

  /**
   * For WaitPrefetch: resolves (never rejects) once no tier runs a fetch for
   * `request` of `instance` any more, so the next {@link LowerTiers.beforeQuery}
   * answers from RAM; undefined when none runs now. Forgets nothing: the
   * query after it still takes the `ready` (and counts it).
   */
  settled(instance: string, request: string): Promise<void> | undefined {
    const requestId = tierRequestId(instance, request);
    const running: Promise<void>[] = [];
    for (const t of this.tiers) {
      const p = t.settled(requestId);
      if (p) running.push(p);
    }
    if (running.length === 0) return undefined;
    return running.length === 1 ? running[0] : Promise.all(running).then(() => {});
  }

  /** Counts a final answer (hit attribution) and returns false: RAM answers it. */
  #answered(source: string, blocks: number): false {
    this.#sources.queries[source]++;
    this.#sources.blocks[source] += blocks;
    return false;
  }

  /**
   * Discarded blocks (a Save's `discard_hashes`, after the store's discard):
   * every tier forgets `hashes` of `namespace`, so none serves that garbage
   * again once the store's tombstones expire, nor after a restart. Never
   * waits; one tier's failure is its own. Returns the blocks the tiers forgot.
   */
  drop(namespace: string, hashes: readonly Uint8Array[]): number {
    let n = 0;
    for (const t of this.tiers) {
      try {
        n += t.drop(namespace, hashes);
      } catch (e) {
        this.#log.error("tier drop failed: it may serve discarded blocks again", {
          tier: t.name,
          namespace,
          blocks: hashes.length,
          error: errorText(e),
        });
      }
    }
    return n;
  }

  /** Every tier's layouts of `namespace` (a registration must match one of each tier's). */
  storedLayouts(namespace: string): TierStoredLayout[] {
    const out: TierStoredLayout[] = [];
    for (const t of this.tiers) {
      for (const l of t.storedLayouts(namespace)) out.push({ ...l, where: t.label });
    }
    return out;
  }

  /** Resolves when every sealed batch accepted so far went through every tier's write. */
  async flush(): Promise<void> {
    while (this.#admitPending.size > 0) await Promise.all(this.#admitPending);
    await Promise.all(this.tiers.map((t) => t.flush()));
  }

  /** Counters for /metrics and tests. */
  stats(): LowerTiersStats {
    return {
      admitQueueDepth: this.#admit.queued,
      admitDropped: this.#admitDropped,
      admitDroppedBlocks: this.#admitDroppedBlocks,
      admitFailed: { ...this.#admitFailed },
      queries: Object.fromEntries(this.#queries),
      sources: {
        queries: { ...this.#sources.queries },
        blocks: { ...this.#sources.blocks },
      },
    };
  }

  /** Stops admitting, lets accepted batches reach their tiers, then closes every tier. Idempotent. */
  close(): Promise<void> {
    return this.#closing ??= (async () => {
      await this.#admit.drain();
      await Promise.all(this.tiers.map((t) => t.close()));
    })();
  }
}

/**
 * The id a tier keys a request's fetch by: the instance's own, so two engines sending the same
 * request id (a P/D pair's prefill and decode engines) never poll or wait on each other's fetch.
 * Instance ids have no ':' (lib/engine/registration.ts checkName).
 */
function tierRequestId(instance: string, request: string): string {
  return `${instance}:${request}`;
}

/**
 * Discards `req.hashes` of `req.namespace` in RAM (the store's discard:
 * evicted, doomed while pinned, refused for a while), then in every lower
 * tier: a lower tier's copy (an SSD record written from RAM) must not come
 * back once the store's tombstones expire. The one order both callers need:
 * a failed load's discard (lib/engine/save_discard.ts) and a block a peer
 * found damaged here (lib/peer/damage_report.ts).
 *
 * @example
 * ```ts
 * const { store: r, tierDropped } = discardEverywhere(store, tiers, { namespace, instance, rank, hashes });
 * ```
 */
export function discardEverywhere(
  store: Pick<KvStore, "discard">,
  tiers: Pick<LowerTiers, "drop"> | undefined,
  req: DiscardRequest & { hashes: readonly Uint8Array[] },
): { store: DiscardResult; tierDropped: number } {
  const r = store.discard(req);
  return { store: r, tierDropped: tiers?.drop(req.namespace, req.hashes) ?? 0 };
}
