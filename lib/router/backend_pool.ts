/**
 * The set of prefill or decode backends and the choice of which one serves the next request.
 *
 * Selection is least-inflight among healthy backends: an engine's queue depth is the best cheap
 * signal of its load the router has, and unlike round-robin it steers around a backend stuck on a
 * long prompt. Ties rotate so equally idle backends share the work. Health is tracked here and
 * changed from two sides: the periodic checker (`health.ts`) and the request path, which takes a
 * backend out at once when a connection to it is refused.
 *
 * @module
 */

/** Which half of the P/D split a backend serves. */
export type Role = "prefill" | "decode";

/**
 * Int32 slots per backend in a pool's state buffer: inflight count, then healthy flag (1/0).
 * Slot 0 of the buffer is the pool's tie-breaking cursor.
 */
const SLOTS_PER_BACKEND = 2;
const CURSOR_SLOT = 0;

/** One backend engine as the router sees it. */
export class Backend {
  /** Base URL, no trailing slash. */
  readonly url: string;
  /** Prefill or decode. */
  readonly role: Role;
  /** Why it was last taken out, for logs and `/health`. */
  lastError: string | null = null;
  readonly #state: Int32Array;
  readonly #slot: number;

  /**
   * @param state the pool's state buffer (see {@link BackendPool.sharedState}); its two slots at
   *   `slot` hold this backend's inflight count and healthy flag.
   */
  constructor(url: string, role: Role, state: Int32Array, slot: number) {
    this.url = url;
    this.role = role;
    this.#state = state;
    this.#slot = slot;
  }

  /** Requests the router (every worker of it, when the state is shared) has open against it. */
  get inflight(): number {
    return Atomics.load(this.#state, this.#slot);
  }
  set inflight(n: number) {
    Atomics.store(this.#state, this.#slot, n);
  }

  /** Whether it may be picked. */
  get healthy(): boolean {
    return Atomics.load(this.#state, this.#slot + 1) === 1;
  }
  set healthy(v: boolean) {
    Atomics.store(this.#state, this.#slot + 1, v ? 1 : 0);
  }

  /** Atomically adds `delta` to the inflight count; returns the value before. */
  addInflight(delta: number): number {
    return Atomics.add(this.#state, this.#slot, delta);
  }

  /** Atomically sets the healthy flag; true when this call changed it. */
  setHealthy(v: boolean): boolean {
    const to = v ? 1 : 0;
    return Atomics.compareExchange(this.#state, this.#slot + 1, 1 - to, to) === 1 - to;
  }
}

/** Called when a backend goes in or out of service. */
export type HealthChangeListener = (backend: Backend, healthy: boolean, reason: string) => void;

/** Called when a backend already out of service is out for another reason. */
export type ReasonChangeListener = (backend: Backend, reason: string) => void;

/**
 * The backends of one role.
 *
 * @example
 * ```ts
 * const pool = new BackendPool("prefill", ["http://p0:8000", "http://p1:8000"]);
 * const b = pool.pick();
 * if (b) { pool.acquire(b); try { ... } finally { pool.release(b); } }
 * ```
 */
export class BackendPool {
  /** Prefill or decode. */
  readonly role: Role;
  /** All backends, healthy or not, in configuration order. */
  readonly backends: readonly Backend[];
  /**
   * Cursor, inflight counts and healthy flags. A SharedArrayBuffer when the pool was built from
   * one (router workers share one per pool, so every worker sees the same counts and health).
   */
  readonly sharedState: SharedArrayBuffer;
  readonly #state: Int32Array;
  #listeners: HealthChangeListener[] = [];
  #reasonListeners: ReasonChangeListener[] = [];

  /**
   * @param shared the state buffer of the same pool in another thread (from its
   *   {@link sharedState}); omitted, a new one is made with every backend healthy and idle.
   */
  constructor(role: Role, urls: readonly string[], shared?: SharedArrayBuffer) {
    if (urls.length === 0) throw new Error(`a ${role} pool needs at least one backend URL`);
    const bytes = (1 + urls.length * SLOTS_PER_BACKEND) * Int32Array.BYTES_PER_ELEMENT;
    if (shared !== undefined && shared.byteLength !== bytes) {
      throw new Error(
        `${role} pool state: expected ${bytes} bytes for ${urls.length} backends, got ${shared.byteLength}`,
      );
    }
    this.role = role;
    this.sharedState = shared ?? new SharedArrayBuffer(bytes);
    this.#state = new Int32Array(this.sharedState);
    this.backends = urls.map((u, i) =>
      new Backend(u, role, this.#state, 1 + i * SLOTS_PER_BACKEND)
    );
    if (shared === undefined) { for (const b of this.backends) b.healthy = true; }
  }

  /**
   * The healthy backend with the fewest inflight requests, skipping `exclude`; ties go to the
   * first one after a rotating cursor. `undefined` when none is healthy.
   */
  pick(exclude?: ReadonlySet<Backend>): Backend | undefined {
    const n = this.backends.length;
    // Shared by all workers, so ties rotate over the whole router, not per worker.
    const start = (Atomics.add(this.#state, CURSOR_SLOT, 1) >>> 0) % n;
    let best: Backend | undefined;
    for (let i = 0; i < n; i++) {
      const b = this.backends[(start + i) % n];
      if (!b.healthy || exclude?.has(b)) continue;
      if (best === undefined || b.inflight < best.inflight) best = b;
    }
    return best;
  }

  /** Counts a request as open against `b`. */
  acquire(b: Backend): void {
    b.addInflight(1);
  }

  /** Ends a request counted by {@link acquire}. */
  release(b: Backend): void {
    if (b.addInflight(-1) <= 0) {
      b.addInflight(1);
      throw new Error(`inflight underflow on ${b.role} backend ${b.url}`);
    }
  }

  /** Takes `b` out of service (no-op if already out). */
  markDown(b: Backend, reason: string): void {
    const before = b.lastError;
    b.lastError = reason;
    if (b.setHealthy(false)) {
      for (const l of this.#listeners) l(b, false, reason);
    } else if (before !== reason) {
      for (const l of this.#reasonListeners) l(b, reason);
    }
  }

  /** Puts `b` back in service (no-op if already in). */
  markUp(b: Backend, reason: string): void {
    if (!b.setHealthy(true)) return;
    b.lastError = null;
    for (const l of this.#listeners) l(b, true, reason);
  }

  /** Number of backends in service. */
  healthyCount(): number {
    let n = 0;
    for (const b of this.backends) if (b.healthy) n++;
    return n;
  }

  /** Registers a listener for health changes. */
  onHealthChange(listener: HealthChangeListener): void {
    this.#listeners.push(listener);
  }

  /**
   * Registers a listener for a new reason on a backend that stays out of service (a
   * {@link markDown} that changes {@link Backend.lastError} but not the healthy flag).
   */
  onReasonChange(listener: ReasonChangeListener): void {
    this.#reasonListeners.push(listener);
  }
}
