/**
 * What the block index answered for a prefix, kept for a moment: the peer
 * tier's `has` (asked on every query, no I/O allowed) reads it instead of a
 * lookup of its own.
 *
 * @module
 */
import { monotonicNow } from "../clock.ts";

/** A lookup result answers `has` for this long. */
export const LOOKUP_MEMO_MS = 1_000;

/**
 * Prefix lengths by prefix key, each fresh for {@link LOOKUP_MEMO_MS}.
 *
 * @example
 * ```ts
 * const memo = new LookupMemo();
 * memo.record(key, found.length);
 * memo.length(key); // found.length, for a second
 * ```
 */
export class LookupMemo {
  readonly #entries = new Map<string, { length: number; at: number }>();

  /** The index found `length` blocks of the prefix under `key`. */
  record(key: string, length: number): void {
    this.#entries.set(key, { length, at: monotonicNow() });
  }

  /** What the last lookup of `key` found while it is fresh; 0 otherwise. */
  length(key: string): number {
    const m = this.#entries.get(key);
    return m && monotonicNow() - m.at < LOOKUP_MEMO_MS ? m.length : 0;
  }

  /** Forgets what is no longer fresh. */
  sweep(): void {
    const old = monotonicNow() - LOOKUP_MEMO_MS;
    for (const [k, m] of this.#entries) if (m.at < old) this.#entries.delete(k);
  }
}
