/**
 * Redis Cluster only: a join advertise waits for the node's record (`pf:{@node}:namespaces`,
 * lib/index/rejoin.ts), which sits on another master, before its script goes out — a round
 * trip during which the namespace's own master has not seen the join. A withdraw of that
 * namespace sent meanwhile would run first and the join would then list the withdrawn blocks
 * for the incarnation's life. On one Redis both go on one connection in call order; here the
 * withdraw waits for the join's record too, and goes right after the join's script.
 *
 * @module
 */

/**
 * The joins under way, per namespace.
 *
 * @example
 * ```ts
 * const order = new JoinOrder();
 * const joined = order.join(ns, recordSent, () => redis.pfAdvertise(...args));
 * await order.after(ns); // a withdraw of ns waits only while a join is under way
 * ```
 */
export class JoinOrder {
  readonly #joining = new Map<string, Promise<void>>();

  /** Sends `script()` once `recorded` resolved (rejects without sending when it rejects). */
  async join<T>(ns: string, recorded: Promise<unknown>, script: () => Promise<T>): Promise<T> {
    // Made before the await below: its reaction runs first, so a withdraw awaiting it resumes
    // after this join's continuation has sent the script.
    const gate = recorded.then(() => {}, () => {});
    this.#joining.set(ns, gate);
    try {
      await recorded;
      return await script();
    } finally {
      if (this.#joining.get(ns) === gate) this.#joining.delete(ns);
    }
  }

  /**
   * Resolves once the latest join of `ns` under way has sent its script (or given up);
   * undefined when none is under way (send at once: no await may reorder calls).
   */
  after(ns: string): Promise<void> | undefined {
    return this.#joining.get(ns);
  }
}
