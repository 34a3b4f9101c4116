/**
 * Which layout refusals were logged already: a namespace used by two KV
 * layouts on two nodes is a configuration error that repeats at every fetch,
 * so each side logs it once per key (lib/peer/locks.ts: requester, namespace
 * and layout; lib/peer/peer_tier.ts: owner and namespace) and past
 * {@link MAX_LAYOUT_WARNINGS} keys only counts it.
 *
 * @module
 */

/** Distinct layout refusals logged at most per side (then only counted). */
export const MAX_LAYOUT_WARNINGS = 1024;

/**
 * Keys logged so far, bounded.
 *
 * @example
 * ```ts
 * const warned = new LayoutWarnings();
 * if (warned.first(`${addr}\n${namespace}`)) log.warn("...");
 * ```
 */
export class LayoutWarnings {
  readonly #seen = new Set<string>();

  /** True the first time `key` is asked while fewer than the bound were logged. */
  first(key: string): boolean {
    if (this.#seen.has(key) || this.#seen.size >= MAX_LAYOUT_WARNINGS) return false;
    this.#seen.add(key);
    return true;
  }
}
