/**
 * The block index's one error type: bad input to an index call (namespace,
 * hash, node id, address). Unavailability of Redis is never thrown — an index
 * call then answers a miss (see lib/index/availability.ts) — so an
 * {@link IndexInputError} always means the caller sent something wrong.
 *
 * @module
 */

/** What was wrong, with the field and value to act on. */
export interface IndexInputFields {
  namespace?: string;
  /** Index of the offending hash in the caller's list. */
  index?: number;
  expected?: string | number;
  got?: string | number;
}

/**
 * A rejected index argument (gRPC `INVALID_ARGUMENT` if it ever reaches a reply).
 *
 * @example
 * ```ts
 * try { await index.advertise("", hashes); } catch (e) {
 *   if (e instanceof IndexInputError) console.log(e.fields); // { got: "" }
 * }
 * ```
 */
export class IndexInputError extends Error {
  readonly code = "INVALID_ARGUMENT";
  constructor(message: string, readonly fields: IndexInputFields = {}) {
    super(message);
    this.name = "IndexInputError";
  }
}
