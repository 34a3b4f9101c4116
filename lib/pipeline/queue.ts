/**
 * A bounded queue with a fixed depth, a depth gauge and one stated overflow
 * policy. It exists because RxJS 7 has no backpressure: `mergeMap(f, N)`
 * bounds concurrency but parks every other item in an unbounded buffer. Here
 * the buffer is the queue, its size is fixed, and what happens when it is
 * full is a decision written at construction time:
 *
 * | policy        | offer on a full queue                                          |
 * |---------------|----------------------------------------------------------------|
 * | `refuse`      | `{status: "refused", error: QueueFullError}`; the caller maps it to a status |
 * | `drop-newest` | the offered item is dropped (`{status: "dropped"}`), counter +1 |
 * | `drop-oldest` | the oldest queued item is dropped and returned, the new one is queued, counter +1 |
 * | `wait`        | the item parks in a bounded waiter list; `ready` emits when it enters the queue. Past `maxWaiters`, refused |
 *
 * The consumer pulls with {@link BoundedQueue.take}; it is told that items
 * are available through {@link BoundedQueue.onAvailable}.
 *
 * @module
 */

import { AsyncSubject, firstValueFrom, type Observable } from "rxjs";
import { QueueClosedError, QueueFullError } from "./errors.ts";
import { Ring } from "./ring.ts";

/** What a full queue does with a new item. See the module table. */
export type OverflowPolicy = "refuse" | "drop-newest" | "drop-oldest" | "wait";

/** Anything with `set(n)`: a prom-client Gauge (or `gauge.labels(...)`) fits. */
export interface DepthGauge {
  set(value: number): void;
}

/** Anything with `inc(n)`: a prom-client Counter fits. */
export interface EventCounter {
  inc(value?: number): void;
}

/** Metric hooks of one queue; all optional, no prom-client dependency here. */
export interface QueueMetrics {
  /** Set to the queue's depth on every change. */
  depth?: DepthGauge;
  /** Set to the number of parked waiters (`wait` policy) on every change. */
  waiters?: DepthGauge;
  /** Incremented once per dropped item (`drop-newest` / `drop-oldest`). */
  dropped?: EventCounter;
  /** Incremented once per refused offer. */
  refused?: EventCounter;
}

/** Default bound on parked waiters of a `wait` queue: as many as the queue holds. */
export const DEFAULT_MAX_WAITERS_PER_DEPTH = 1;

/** Construction options of a {@link BoundedQueue}. */
export interface BoundedQueueOptions<T> {
  /** Name used in errors and metrics (e.g. `"save.gather"`). */
  name: string;
  /** Fixed depth (items held), ≥ 1. */
  depth: number;
  /** What a full queue does with a new item. */
  policy: OverflowPolicy;
  /** `wait` only: at most this many parked offers; more are refused. Default: `depth`. */
  maxWaiters?: number;
  /** Metric hooks. */
  metrics?: QueueMetrics;
  /** Called with each item the queue drops (so its owner can release resources). */
  onDrop?: (item: T) => void;
}

/** How a `wait` offer ended: it entered the queue, or the queue closed first. */
export type WaitResult = { readonly status: "queued" } | {
  readonly status: "refused";
  readonly error: QueueClosedError;
};

/** The answer to {@link BoundedQueue.offer}. */
export type OfferResult<T> =
  /** Queued. With `drop-oldest` on a full queue, `dropped` is the item pushed out. */
  | { readonly status: "queued"; readonly dropped?: T }
  /** `drop-newest` on a full queue: this item was not queued. */
  | { readonly status: "dropped"; readonly item: T }
  /** `refuse` on a full queue, too many waiters, or a closed queue. */
  | { readonly status: "refused"; readonly error: QueueFullError | QueueClosedError }
  /** `wait` on a full queue: `ready` emits once (then completes) when the item is queued or refused. */
  | { readonly status: "waiting"; readonly ready: Observable<WaitResult> };

/** Counters of one queue, for `stats()` and tests. */
export interface QueueStats {
  name: string;
  depth: number;
  capacity: number;
  waiters: number;
  accepted: number;
  dropped: number;
  refused: number;
  highWater: number;
  closed: boolean;
}

interface Waiter<T> {
  item: T;
  ready: AsyncSubject<WaitResult>;
}

/**
 * A fixed-depth FIFO with a gauge and an explicit overflow policy.
 *
 * @example
 * ```ts
 * const q = new BoundedQueue<string>({ name: "ssd.write", depth: 2, policy: "drop-newest" });
 * q.offer("a"); q.offer("b");
 * q.offer("c"); // { status: "dropped", item: "c" }
 * q.take();     // "a"
 * ```
 */
export class BoundedQueue<T> {
  readonly name: string;
  readonly capacity: number;
  readonly policy: OverflowPolicy;
  readonly maxWaiters: number;
  readonly #items: Ring<T>;
  readonly #waiters: Ring<Waiter<T>>;
  readonly #metrics: QueueMetrics;
  readonly #onDrop?: (item: T) => void;
  #listener?: () => void;
  #closed = false;
  #accepted = 0;
  #dropped = 0;
  #refused = 0;
  #highWater = 0;

  constructor(opts: BoundedQueueOptions<T>) {
    if (!Number.isInteger(opts.depth) || opts.depth < 1) {
      throw new RangeError(`queue "${opts.name}": depth must be an integer ≥ 1, got ${opts.depth}`);
    }
    const maxWaiters = opts.maxWaiters ?? opts.depth * DEFAULT_MAX_WAITERS_PER_DEPTH;
    if (!Number.isInteger(maxWaiters) || maxWaiters < 0) {
      throw new RangeError(
        `queue "${opts.name}": maxWaiters must be an integer ≥ 0, got ${opts.maxWaiters}`,
      );
    }
    this.name = opts.name;
    this.capacity = opts.depth;
    this.policy = opts.policy;
    this.maxWaiters = opts.policy === "wait" ? maxWaiters : 0;
    this.#items = new Ring<T>(opts.depth);
    this.#waiters = new Ring<Waiter<T>>(this.maxWaiters);
    this.#metrics = opts.metrics ?? {};
    this.#onDrop = opts.onDrop;
    this.#publish();
  }

  /** Items queued now. */
  get size(): number {
    return this.#items.size;
  }

  /** Offers parked by the `wait` policy. */
  get waiting(): number {
    return this.#waiters.size;
  }

  /** True once {@link close} was called. */
  get closed(): boolean {
    return this.#closed;
  }

  /**
   * Offers an item; never blocks. The result says what the policy did.
   */
  offer(item: T): OfferResult<T> {
    if (item === undefined) {
      throw new TypeError(
        `queue "${this.name}": undefined cannot be queued (take() uses it for empty)`,
      );
    }
    if (this.#closed) return this.#refuse(new QueueClosedError(this.name));
    if (this.#items.push(item)) {
      this.#accepted++;
      this.#publish();
      this.#listener?.();
      return { status: "queued" };
    }
    switch (this.policy) {
      case "refuse":
        return this.#refuse(new QueueFullError(this.name, this.capacity));
      case "drop-newest":
        this.#drop(item);
        return { status: "dropped", item };
      case "drop-oldest": {
        const oldest = this.#items.shift() as T;
        this.#items.push(item);
        this.#accepted++;
        this.#drop(oldest);
        this.#publish();
        this.#listener?.();
        return { status: "queued", dropped: oldest };
      }
      case "wait": {
        const ready = new AsyncSubject<WaitResult>();
        if (!this.#waiters.push({ item, ready })) {
          return this.#refuse(new QueueFullError(this.name, this.capacity, this.#waiters.size));
        }
        this.#publish();
        return { status: "waiting", ready: ready.asObservable() };
      }
    }
  }

  /**
   * Offers and, under the `wait` policy, resolves once the item is queued.
   * Under other policies it resolves at once with what {@link offer} said.
   */
  async put(item: T): Promise<OfferResult<T>> {
    const r = this.offer(item);
    if (r.status !== "waiting") return r;
    return await firstValueFrom(r.ready);
  }

  /**
   * Removes the head item (undefined when empty). A parked waiter, if any,
   * takes the freed place at once and its `ready` emits `queued`.
   */
  take(): T | undefined {
    const item = this.#items.shift();
    if (item === undefined) return undefined;
    const waiter = this.#waiters.shift();
    if (waiter) {
      this.#items.push(waiter.item);
      this.#accepted++;
    }
    this.#publish();
    if (waiter) {
      waiter.ready.next({ status: "queued" });
      waiter.ready.complete();
    }
    return item;
  }

  /**
   * Registers the single consumer's wake-up: called (synchronously) after
   * an item becomes available. The consumer then pulls with {@link take}.
   */
  onAvailable(listener: () => void): void {
    this.#listener = listener;
  }

  /**
   * Stops accepting offers. Queued items stay for the consumer to drain, and
   * offers already parked by `wait` still enter as space frees (they were
   * accepted to wait). Use {@link cancelWaiters} to turn those away too.
   */
  close(): void {
    this.#closed = true;
  }

  /**
   * Refuses every parked `wait` offer with {@link QueueClosedError} (for
   * shutdown, where nothing new will be pulled). Returns how many were refused.
   */
  cancelWaiters(): number {
    let n = 0;
    for (let w = this.#waiters.shift(); w; w = this.#waiters.shift()) {
      n++;
      this.#refused++;
      this.#metrics.refused?.inc(1);
      w.ready.next({ status: "refused", error: new QueueClosedError(this.name) });
      w.ready.complete();
    }
    if (n > 0) this.#publish();
    return n;
  }

  /** Counters for metrics and tests. */
  stats(): QueueStats {
    return {
      name: this.name,
      depth: this.#items.size,
      capacity: this.capacity,
      waiters: this.#waiters.size,
      accepted: this.#accepted,
      dropped: this.#dropped,
      refused: this.#refused,
      highWater: this.#highWater,
      closed: this.#closed,
    };
  }

  #refuse(error: QueueFullError | QueueClosedError): OfferResult<T> {
    this.#refused++;
    this.#metrics.refused?.inc(1);
    return { status: "refused", error };
  }

  #drop(item: T): void {
    this.#dropped++;
    this.#metrics.dropped?.inc(1);
    this.#onDrop?.(item);
  }

  #publish(): void {
    const depth = this.#items.size;
    if (depth > this.#highWater) this.#highWater = depth;
    this.#metrics.depth?.set(depth);
    this.#metrics.waiters?.set(this.#waiters.size);
  }
}
