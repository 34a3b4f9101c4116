/**
 * Active health checks: every interval, GET `<backend><path>` on every backend; a 2xx answer within
 * the timeout puts the backend (back) in service, anything else takes it out.
 *
 * One failed probe is enough to take a backend out because the request path already retries P and
 * a wrongly excluded backend returns after one interval; a backend that keeps failing requests
 * costs every client a retry until then. Rounds never overlap: the next one is scheduled when the
 * previous has finished.
 *
 * @module
 */

import type { Backend, BackendPool } from "./backend_pool.ts";
import type { Logger } from "../log.ts";

/** Settings of the health checker. */
export interface HealthCheckOptions {
  intervalMs: number;
  timeoutMs: number;
  path: string;
  /** HTTP client shared with the request path (keep-alive). */
  client?: Deno.HttpClient;
  log: Logger;
}

/**
 * Runs health checks over a set of pools until {@link HealthChecker.stop}.
 *
 * @example
 * ```ts
 * const checker = new HealthChecker([prefillPool, decodePool], { intervalMs: 5000, timeoutMs: 2000, path: "/health", log });
 * await checker.checkAll(); // first round before serving
 * checker.start();
 * ```
 */
export class HealthChecker {
  readonly #pools: readonly BackendPool[];
  readonly #opts: HealthCheckOptions;
  #timer: ReturnType<typeof setTimeout> | undefined;
  #running = false;
  #round: Promise<void> | undefined;
  #abort = new AbortController();

  constructor(pools: readonly BackendPool[], opts: HealthCheckOptions) {
    this.#pools = pools;
    this.#opts = opts;
  }

  /** Probes every backend once, concurrently, and applies the results. */
  async checkAll(): Promise<void> {
    const jobs: Promise<void>[] = [];
    for (const pool of this.#pools) {
      for (const b of pool.backends) jobs.push(this.#checkOne(pool, b));
    }
    await Promise.all(jobs);
  }

  /** Starts the periodic rounds. */
  start(): void {
    if (this.#running) return;
    this.#running = true;
    this.#schedule();
  }

  /** Stops the rounds and waits for a round in progress to end. */
  async stop(): Promise<void> {
    this.#running = false;
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    this.#abort.abort(new DOMException("health checker stopped", "AbortError"));
    await this.#round;
  }

  #schedule(): void {
    this.#timer = setTimeout(() => {
      this.#round = this.checkAll().finally(() => {
        if (this.#running) this.#schedule();
      });
    }, this.#opts.intervalMs);
  }

  async #checkOne(pool: BackendPool, b: Backend): Promise<void> {
    const { timeoutMs, path, client, log } = this.#opts;
    const signal = AbortSignal.any([this.#abort.signal, AbortSignal.timeout(timeoutMs)]);
    let failure: string | null = null;
    try {
      const res = await fetch(b.url + path, { signal, client });
      // Drain so the keep-alive connection can be reused.
      await res.body?.cancel();
      if (!res.ok) failure = `health check ${path} answered HTTP ${res.status}`;
    } catch (e) {
      if (this.#abort.signal.aborted) return;
      failure = signal.aborted
        ? `health check ${path} timed out after ${timeoutMs} ms`
        : `health check ${path} failed: ${describeError(e)}`;
    }
    if (failure === null) {
      if (!b.healthy) log.info("backend back in service", { role: b.role, url: b.url });
      pool.markUp(b, "health check passed");
    } else {
      if (b.healthy) {
        log.warn("backend out of service", { role: b.role, url: b.url, reason: failure });
      }
      pool.markDown(b, failure);
    }
  }
}

/** A one-line description of a fetch failure, including its cause (Deno puts the OS error there). */
export function describeError(e: unknown): string {
  if (!(e instanceof Error)) return String(e);
  const cause = e.cause instanceof Error ? `: ${e.cause.message}` : "";
  return `${e.message}${cause}`;
}
