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

/** One backend engine as the router sees it. */
export class Backend {
  /** Base URL, no trailing slash. */
  readonly url: string;
  /** Prefill or decode. */
  readonly role: Role;
  /** Requests the router currently has open against it. */
  inflight = 0;
  /** Whether it may be picked. */
  healthy = true;
  /** Why it was last taken out, for logs and `/health`. */
  lastError: string | null = null;

  constructor(url: string, role: Role) {
    this.url = url;
    this.role = role;
  }
}

/** Called when a backend goes in or out of service. */
export type HealthChangeListener = (backend: Backend, healthy: boolean, reason: string) => void;

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
  #cursor = 0;
  #listeners: HealthChangeListener[] = [];

  constructor(role: Role, urls: readonly string[]) {
    if (urls.length === 0) throw new Error(`a ${role} pool needs at least one backend URL`);
    this.role = role;
    this.backends = urls.map((u) => new Backend(u, role));
  }

  /**
   * The healthy backend with the fewest inflight requests, skipping `exclude`; ties go to the
   * first one after a rotating cursor. `undefined` when none is healthy.
   */
  pick(exclude?: ReadonlySet<Backend>): Backend | undefined {
    const n = this.backends.length;
    const start = this.#cursor;
    this.#cursor = (this.#cursor + 1) % n;
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
    b.inflight++;
  }

  /** Ends a request counted by {@link acquire}. */
  release(b: Backend): void {
    if (b.inflight <= 0) throw new Error(`inflight underflow on ${b.role} backend ${b.url}`);
    b.inflight--;
  }

  /** Takes `b` out of service (no-op if already out). */
  markDown(b: Backend, reason: string): void {
    b.lastError = reason;
    if (!b.healthy) return;
    b.healthy = false;
    for (const l of this.#listeners) l(b, false, reason);
  }

  /** Puts `b` back in service (no-op if already in). */
  markUp(b: Backend, reason: string): void {
    if (b.healthy) return;
    b.healthy = true;
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
}
