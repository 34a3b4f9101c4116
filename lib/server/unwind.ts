/**
 * What a server start has opened so far, closed in reverse order when a
 * later step fails. The start opens a dozen things (the pinned pool, the
 * store's collector timer, the tiers, the transfer endpoint, the gRPC
 * server and its listeners, the HTTP handler, the block index); a step that
 * throws must leave none of them open — no socket file, no port, no timer
 * keeping the process alive — so an embedder can retry and a supervisor's
 * next start finds the addresses free. Each step records its close right
 * after it opens; the start's one `catch` runs them, last opened first.
 *
 * @module
 */
import type { Logger } from "../log.ts";

/** One opened thing: what it is (for the log line of a close that fails) and how to close it. */
interface Step {
  what: string;
  close: () => unknown;
}

/**
 * A stack of closes.
 *
 * @example
 * ```ts
 * const opened = new Unwind(log);
 * try {
 *   const timer = setInterval(tick, 1_000);
 *   opened.push("collector timer", () => clearInterval(timer));
 *   await nextStep(); // throws
 * } catch (e) {
 *   await opened.close(); // clears the timer
 *   throw e;
 * }
 * ```
 */
export class Unwind {
  readonly #steps: Step[] = [];
  readonly #log: Logger;

  constructor(log: Logger) {
    this.#log = log;
  }

  /** Records that `what` is open; `close` runs when the start unwinds. */
  push(what: string, close: () => unknown): void {
    this.#steps.push({ what, close });
  }

  /**
   * Closes everything recorded, last opened first, and forgets it. A close
   * that throws is logged naming what it closed, and the others still run:
   * the start's own error is the one that goes up.
   */
  async close(): Promise<void> {
    for (const step of this.#steps.splice(0).reverse()) {
      try {
        await step.close();
      } catch (e) {
        this.#log.warn("closing what a failed start opened failed", {
          opened: step.what,
          error: (e as Error).message,
        });
      }
    }
  }
}
