/**
 * The clock of expiries (leases, transfer locks, stale in-flight blocks): epoch
 * milliseconds that never go backwards. `Date.now()` follows the system clock,
 * which an NTP step or an operator can set back; expiry scans that stop at the
 * first entry not yet due would then keep expired leases pinning their blocks
 * for as long as the step.
 *
 * @module
 */

/**
 * Milliseconds since the epoch as of this process's start, advanced by the
 * monotonic clock since.
 *
 * @example
 * ```ts
 * const expiresAt = monotonicNow() + ttlMs;
 * ```
 */
export function monotonicNow(): number {
  return performance.timeOrigin + performance.now();
}
