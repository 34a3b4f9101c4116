/**
 * The longest delay a JS timer honours, and the clamp every deadline timer
 * goes through: `setTimeout` / `setInterval` with a delay above 2^31 - 1 ms
 * (about 24.8 days) fire after 1 ms instead, so a longer deadline (Infinity:
 * none) would fire at once.
 *
 * @module
 */

/**
 * Longest delay a timer can wait, in ms (2^31 - 1, about 24.8 days). Every
 * flag in milliseconds that sets a timer stays at or below it.
 */
export const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * `ms` as a timer delay: clamped to 0..{@link MAX_TIMER_MS}, so a longer
 * deadline waits the longest a timer can instead of firing at once.
 *
 * @example
 * ```ts
 * setTimeout(onLate, timerDelay(Infinity)); // fires after ~24.8 days, not 1 ms
 * ```
 */
export function timerDelay(ms: number): number {
  return Math.min(Math.max(0, ms), MAX_TIMER_MS);
}
