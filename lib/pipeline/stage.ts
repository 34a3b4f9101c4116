/**
 * A credit-bounded pipeline stage: a {@link BoundedQueue} in front of a
 * worker function, with at most `concurrency` items in flight. The stage
 * pulls the next item from its queue only when a credit frees (a worker
 * finished), so nothing ever waits in a hidden buffer: an item is either in
 * the fixed-depth queue, in one of the `concurrency` worker slots, or was
 * refused/dropped by the queue's stated policy.
 *
 * Every submitted item gets exactly one {@link StageOutcome}: `done` with the
 * worker's value, `failed` with the worker's error (errors belong to that
 * item, never to the pipeline), `refused` or `dropped`.
 *
 * Stages chain by having a worker submit into the next stage: with a `wait`
 * queue downstream, the upstream worker keeps its credit until the next stage
 * accepts, so pressure propagates to the source.
 *
 * @module
 */

import {
  AsyncSubject,
  firstValueFrom,
  from,
  map,
  Observable,
  of,
  type OperatorFunction,
  Subject,
  type Subscription,
  takeUntil,
} from "rxjs";
import type { QueueClosedError, QueueFullError } from "./errors.ts";
import {
  BoundedQueue,
  type DepthGauge,
  type EventCounter,
  type OverflowPolicy,
  type QueueMetrics,
  type QueueStats,
} from "./queue.ts";

/**
 * The work of a stage for one item. Return a Promise, or an Observable whose
 * last value (at completion) is the result. A throw, a rejection or an error
 * notification fails only this item.
 */
export type StageWorker<I, O> = (input: I) => Promise<O> | Observable<O>;

/** The single result of one submitted item. */
export type StageOutcome<I, O> =
  | { readonly status: "done"; readonly input: I; readonly value: O }
  | { readonly status: "failed"; readonly input: I; readonly error: unknown }
  | {
    readonly status: "refused";
    readonly input: I;
    readonly error: QueueFullError | QueueClosedError;
  }
  | { readonly status: "dropped"; readonly input: I };

/** Queue settings of a stage (see {@link BoundedQueue} for the policies). */
export interface StageQueueOptions {
  depth: number;
  policy: OverflowPolicy;
  maxWaiters?: number;
}

/** Metric hooks of a stage: its queue's, plus in-flight and outcome counters. */
export interface StageMetrics extends QueueMetrics {
  /** Set to the number of items in a worker on every change. */
  inflight?: DepthGauge;
  /** Incremented per item whose worker succeeded. */
  completed?: EventCounter;
  /** Incremented per item whose worker failed. */
  failed?: EventCounter;
}

/** Construction options of a {@link Stage}. */
export interface StageOptions {
  /** Most items in a worker at once (credits), ≥ 1. */
  concurrency: number;
  /** The queue in front of the workers. */
  queue: StageQueueOptions;
  /** Metric hooks. */
  metrics?: StageMetrics;
}

/** What {@link Stage.submit} returns at once; `outcome` follows later. */
export interface Submission<I, O> {
  /** What the queue did right now: accepted, parked (`wait`), refused or dropped. */
  readonly status: "accepted" | "waiting" | "refused" | "dropped";
  /** Emits the item's one outcome, then completes. Replays to late subscribers. */
  readonly outcome: Observable<StageOutcome<I, O>>;
  /**
   * Emits once whether the item got into the queue: true at once when
   * accepted, later for `waiting` (true when a place freed, false if the
   * stage was aborted first), false for refused/dropped. An upstream worker
   * awaits it to hold its own credit until this stage has room (chained
   * backpressure).
   */
  readonly admission: Observable<boolean>;
  /** The outcome as a Promise (never rejects: failures are outcomes). */
  done(): Promise<StageOutcome<I, O>>;
}

/** Counters of a stage for metrics and tests. */
export interface StageStats {
  name: string;
  concurrency: number;
  inflight: number;
  maxInflight: number;
  completed: number;
  failed: number;
  queue: QueueStats;
}

interface Job<I, O> {
  input: I;
  outcome: AsyncSubject<StageOutcome<I, O>>;
}

function settle<I, O>(job: Job<I, O>, outcome: StageOutcome<I, O>): void {
  job.outcome.next(outcome);
  job.outcome.complete();
}

function submission<I, O>(
  status: Submission<I, O>["status"],
  subject: AsyncSubject<StageOutcome<I, O>>,
  admission: Observable<boolean> = of(status === "accepted"),
): Submission<I, O> {
  const outcome = subject.asObservable();
  return { status, outcome, admission, done: () => firstValueFrom(outcome) };
}

/**
 * Queue → worker with at most `concurrency` in flight.
 *
 * @example
 * ```ts
 * const gather = new Stage<SaveJob, number>("save.gather",
 *   { concurrency: 2, queue: { depth: 64, policy: "refuse" } },
 *   async (job) => await copyEngine.gather(job));
 * const s = gather.submit(job);
 * if (s.status === "refused") return status(RESOURCE_EXHAUSTED);
 * const out = await s.done(); // { status: "done", value } or { status: "failed", error }
 * ```
 */
export class Stage<I, O> {
  readonly name: string;
  readonly concurrency: number;
  readonly #queue: BoundedQueue<Job<I, O>>;
  readonly #worker: StageWorker<I, O>;
  readonly #metrics: StageMetrics;
  readonly #running = new Map<Job<I, O>, { sub: Subscription; fail: (e: Error) => void }>();
  readonly #drained = new AsyncSubject<void>();
  #inflight = 0;
  #maxInflight = 0;
  #completed = 0;
  #failed = 0;
  #pumping = false;

  constructor(name: string, opts: StageOptions, worker: StageWorker<I, O>) {
    if (!Number.isInteger(opts.concurrency) || opts.concurrency < 1) {
      throw new RangeError(
        `stage "${name}": concurrency must be an integer ≥ 1, got ${opts.concurrency}`,
      );
    }
    this.name = name;
    this.concurrency = opts.concurrency;
    this.#worker = worker;
    this.#metrics = opts.metrics ?? {};
    this.#queue = new BoundedQueue<Job<I, O>>({
      name,
      depth: opts.queue.depth,
      policy: opts.queue.policy,
      maxWaiters: opts.queue.maxWaiters,
      metrics: opts.metrics,
      onDrop: (job) => settle(job, { status: "dropped", input: job.input }),
    });
    this.#queue.onAvailable(() => this.#pump());
    this.#metrics.inflight?.set(0);
  }

  /** Items in a worker now (≤ concurrency). */
  get inflight(): number {
    return this.#inflight;
  }

  /** Items waiting in the queue now (≤ depth). */
  get queued(): number {
    return this.#queue.size;
  }

  /** Submits one item; the returned status says what the queue did. Never throws for a full queue. */
  submit(input: I): Submission<I, O> {
    const job: Job<I, O> = { input, outcome: new AsyncSubject() };
    const r = this.#queue.offer(job);
    switch (r.status) {
      case "queued":
        return submission("accepted", job.outcome);
      case "dropped":
        // onDrop already settled the job.
        return submission("dropped", job.outcome);
      case "refused":
        settle(job, { status: "refused", input, error: r.error });
        return submission("refused", job.outcome);
      case "waiting":
        r.ready.subscribe((w) => {
          if (w.status === "refused") settle(job, { status: "refused", input, error: w.error });
        });
        return submission(
          "waiting",
          job.outcome,
          r.ready.pipe(map((w) => w.status === "queued")),
        );
    }
  }

  /**
   * Stops accepting items; what is queued and in flight still runs. The
   * returned Observable emits once (then completes) when the stage is empty.
   */
  close(): Observable<void> {
    this.#queue.close();
    this.#checkDrained();
    return this.#drained.asObservable();
  }

  /** {@link close} as a Promise. */
  drain(): Promise<void> {
    return firstValueFrom(this.close());
  }

  /**
   * Tears the stage down now: closes the queue, unsubscribes running
   * Observable workers (a Promise cannot be cancelled; its result is ignored)
   * and settles every queued and running item as `failed` with `reason`.
   */
  abort(reason: Error): void {
    this.#queue.close();
    this.#queue.cancelWaiters();
    for (let job = this.#queue.take(); job !== undefined; job = this.#queue.take()) {
      this.#failed++;
      this.#metrics.failed?.inc(1);
      settle(job, { status: "failed", input: job.input, error: reason });
    }
    for (const { sub, fail } of [...this.#running.values()]) {
      sub.unsubscribe();
      fail(reason);
    }
    this.#checkDrained();
  }

  /** Counters for metrics and tests. */
  stats(): StageStats {
    return {
      name: this.name,
      concurrency: this.concurrency,
      inflight: this.#inflight,
      maxInflight: this.#maxInflight,
      completed: this.#completed,
      failed: this.#failed,
      queue: this.#queue.stats(),
    };
  }

  /** Pulls while a credit is free. Re-entrant calls (a worker finishing synchronously) fold into the loop. */
  #pump(): void {
    if (this.#pumping) return;
    this.#pumping = true;
    try {
      while (this.#inflight < this.concurrency) {
        const job = this.#queue.take();
        if (job === undefined) break;
        this.#start(job);
      }
    } finally {
      this.#pumping = false;
    }
    this.#checkDrained();
  }

  #start(job: Job<I, O>): void {
    this.#inflight++;
    if (this.#inflight > this.#maxInflight) this.#maxInflight = this.#inflight;
    this.#metrics.inflight?.set(this.#inflight);
    let finished = false;
    let hasValue = false;
    let last: O | undefined;
    const finish = (outcome: StageOutcome<I, O>) => {
      if (finished) return;
      finished = true;
      this.#running.delete(job);
      this.#inflight--;
      this.#metrics.inflight?.set(this.#inflight);
      if (outcome.status === "done") {
        this.#completed++;
        this.#metrics.completed?.inc(1);
      } else {
        this.#failed++;
        this.#metrics.failed?.inc(1);
      }
      settle(job, outcome);
      this.#pump();
    };
    let source: Observable<O>;
    try {
      source = from(this.#worker(job.input));
    } catch (error) {
      finish({ status: "failed", input: job.input, error });
      return;
    }
    const sub = source.subscribe({
      next: (v) => {
        hasValue = true;
        last = v;
      },
      error: (error) => finish({ status: "failed", input: job.input, error }),
      complete: () =>
        finish(
          hasValue ? { status: "done", input: job.input, value: last as O } : {
            status: "failed",
            input: job.input,
            error: new Error(`stage "${this.name}": worker completed without a value`),
          },
        ),
    });
    if (!finished) {
      this.#running.set(job, {
        sub,
        fail: (error) => finish({ status: "failed", input: job.input, error }),
      });
    }
  }

  #checkDrained(): void {
    const q = this.#queue;
    if (q.closed && q.size === 0 && q.waiting === 0 && this.#inflight === 0) {
      if (!this.#drained.closed) {
        this.#drained.next();
        this.#drained.complete();
      }
    }
  }
}

/**
 * The stage as an RxJS operator over a push source: each source value is
 * submitted; the output is one {@link StageOutcome} per value (refused and
 * dropped ones included, so nothing vanishes silently), in the order the
 * outcomes happen (with concurrency > 1, not necessarily source order). The output completes
 * when the source completed and every accepted item finished (drain).
 *
 * `wait` queues park at most `maxWaiters` values; a push source cannot be
 * paused, so past that they are refused like with `refuse`.
 *
 * @example
 * ```ts
 * requests$.pipe(stage("save.seal", { concurrency: 1, queue: { depth: 128, policy: "drop-newest" } },
 *   (r) => seal(r)));
 * ```
 */
export function stage<I, O>(
  name: string,
  opts: StageOptions,
  worker: StageWorker<I, O>,
): OperatorFunction<I, StageOutcome<I, O>> {
  return (source) =>
    new Observable<StageOutcome<I, O>>((subscriber) => {
      const s = new Stage<I, O>(name, opts, worker);
      // Teardown is registered before the source is subscribed: a consumer that
      // leaves while a synchronous source is still emitting (take(n) downstream)
      // must stop that source at once, not after it ran every value through the
      // worker (or forever, for an endless one).
      const stop = new Subject<void>();
      subscriber.add(() => {
        stop.next();
        s.abort(new Error(`stage "${name}": unsubscribed`));
      });
      let pending = 0;
      let sourceDone = false;
      const maybeComplete = () => {
        if (sourceDone && pending === 0) subscriber.complete();
      };
      source.pipe(takeUntil(stop)).subscribe({
        next: (input) => {
          pending++;
          s.submit(input).outcome.subscribe((o) => {
            pending--;
            subscriber.next(o);
            maybeComplete();
          });
        },
        error: (e) => subscriber.error(e),
        complete: () => {
          sourceDone = true;
          s.close();
          maybeComplete();
        },
      });
    });
}
