/**
 * The longest delay a JS timer honours, and the clamp every deadline timer
 * goes through: `setTimeout` / `setInterval` with a delay above 2^31 - 1 ms
 * (about 24.8 days) fire after 1 ms instead, so a longer deadline (Infinity:
 * none) would fire at once. And {@link within}, the race of a promise
 * against such a timer ({@link withinOrThrow}: the same, rejecting when late).
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

/** What {@link within} answers when the deadline came first. */
export const LATE = Symbol("late");

/**
 * `p`'s outcome, or {@link LATE} once `ms` passed first (`p` goes on; its
 * rejection within the deadline is rethrown). The timer is cleared either way.
 *
 * @example
 * ```ts
 * if (await within(file.close(), 300) === LATE) log.error("close did not return");
 * ```
 */
export async function within<T>(p: Promise<T>, ms: number): Promise<T | typeof LATE> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<typeof LATE>((r) => (timer = setTimeout(() => r(LATE), timerDelay(ms))));
  try {
    return await Promise.race([p, late]);
  } finally {
    clearTimeout(timer);
  }
}

/**
 * `p`'s outcome, or a rejection with `late()` once `ms` passed first (`p`
 * goes on): {@link within} for the callers whose deadline is an error.
 *
 * @example
 * ```ts
 * const conn = await withinOrThrow(dial(), 500, () => new Error("no connection within 500 ms"));
 * ```
 */
export async function withinOrThrow<T>(p: Promise<T>, ms: number, late: () => Error): Promise<T> {
  const v = await within(p, ms);
  if (v === LATE) throw late();
  return v;
}
