/**
 * WaitPrefetch's holds: an engine told "loading" waits here for the lower
 * tier's fetch of its request to end instead of asking QueryPrefetch again
 * and again while the fetch runs (each query costs the server's event loop
 * while it should be committing the fetch's blocks). A hold ends when the
 * fetch ends (true), after its wait (false), or at shutdown (false); one
 * timer per hold, never per block.
 *
 * @example
 * ```ts
 * const waits = new PrefetchWaits();
 * const settled = await waits.hold(tiers.settled(instance, request), 500);
 * waits.close(); // at shutdown: every hold answers false
 * ```
 *
 * @module
 */

/** The holds in flight; {@link PrefetchWaits.close} ends them all. */
export class PrefetchWaits {
  readonly #open = new Set<(settled: boolean) => void>();
  #closed = false;

  /** Holds in flight (`pegaflow_prefetch_waits`). */
  get size(): number {
    return this.#open.size;
  }

  /**
   * True once `fetch` resolves, false after `waitMs` or at close. No fetch
   * (undefined): true at once, nothing runs for the request.
   */
  hold(fetch: Promise<void> | undefined, waitMs: number): Promise<boolean> {
    if (fetch === undefined) return Promise.resolve(true);
    if (this.#closed) return Promise.resolve(false);
    return new Promise<boolean>((resolve) => {
      const end = (settled: boolean) => {
        if (!this.#open.delete(end)) return;
        clearTimeout(timer);
        resolve(settled);
      };
      this.#open.add(end);
      const timer = setTimeout(() => end(false), waitMs);
      fetch.then(() => end(true), () => end(true));
    });
  }

  /** Ends every hold (false) and answers later ones at once: the server is shutting down. */
  close(): void {
    this.#closed = true;
    for (const end of [...this.#open]) end(false);
  }
}
