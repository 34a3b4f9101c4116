/**
 * Whether the index's Redis answers, as seen from its calls: one log line per
 * outage (not per call), an error count per failed call, the `up` gauge, and
 * one `onRecover` call when Redis answers again after failing.
 *
 * State starts unknown, so the first outcome — success or failure — is
 * logged once too, and a first success counts as a recovery (the node then
 * advertises whatever it already holds).
 *
 * @module
 */

import type { Logger } from "../log.ts";
import type { IndexMetrics, IndexOp } from "./metrics.ts";

/**
 * Outage tracking.
 *
 * @example
 * ```ts
 * const a = new Availability(log, metrics, () => republish());
 * try { await call(); a.succeeded(); } catch (e) { a.failed("lookup", e as Error); }
 * ```
 */
export class Availability {
  #up: boolean | undefined;
  #outages = 0;
  /** This outage's log says why the connection failed. */
  #connectLogged = false;

  constructor(
    private readonly log: Logger,
    private readonly metrics: IndexMetrics | undefined,
    private readonly onRecover: () => void,
    private readonly where: string,
  ) {}

  /** True while the last outcome was a success. */
  get up(): boolean {
    return this.#up === true;
  }

  /** Outages seen so far (transitions to down). */
  get outages(): number {
    return this.#outages;
  }

  /**
   * A call or connection attempt failed: counted always, logged on the first of an outage —
   * and the outage's first failed connection attempt too when a call failed first (a call made
   * before the connection's own error says only that the stream is not writeable; the
   * connection's error says why: a TLS certificate refused, a connection refused).
   */
  failed(op: IndexOp, error: Error): void {
    this.metrics?.error(op);
    if (this.#up === false) {
      if (op !== "connect" || this.#connectLogged) return;
      this.#connectLogged = true;
      this.log.warn("block index connection failed", { redis: this.where, error: error.message });
      return;
    }
    this.#up = false;
    this.#connectLogged = op === "connect";
    this.#outages++;
    this.metrics?.up(false);
    this.log.warn("block index unreachable: serving from local tiers only until it answers", {
      redis: this.where,
      op,
      error: error.message,
    });
  }

  /** A call succeeded: on the first success after a failure (or ever), recover. */
  succeeded(): void {
    if (this.#up === true) return;
    const wasDown = this.#up === false;
    this.#up = true;
    this.metrics?.up(true);
    this.log.info(wasDown ? "block index reachable again" : "block index connected", {
      redis: this.where,
    });
    this.onRecover();
  }
}
