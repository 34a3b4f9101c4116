/**
 * Errors raised by bounded queues and stages. Each carries a `code` that the
 * server maps to a gRPC status, and the queue name so a log line says which
 * bound was hit.
 *
 * @module
 */

/** gRPC status names used by pipeline errors (the server maps them to numbers). */
export type PipelineErrorCode = "RESOURCE_EXHAUSTED" | "UNAVAILABLE";

/**
 * A queue with the `"refuse"` policy (or a `"wait"` queue whose waiter list is
 * full) turned an item away. The caller answers RESOURCE_EXHAUSTED and the
 * engine retries or recomputes later.
 *
 * @example
 * ```ts
 * const r = queue.offer(job);
 * if (r.status === "refused") throw r.error; // QueueFullError, code RESOURCE_EXHAUSTED
 * ```
 */
export class QueueFullError extends Error {
  /** gRPC status the server answers with. */
  readonly code: PipelineErrorCode = "RESOURCE_EXHAUSTED";
  constructor(
    /** Name of the queue that was full. */
    readonly queue: string,
    /** Its fixed depth. */
    readonly depth: number,
    /** Waiters already parked (only for `"wait"` queues). */
    readonly waiters = 0,
  ) {
    super(
      waiters > 0
        ? `queue "${queue}" is full (depth ${depth}, ${waiters} waiters parked): try again later`
        : `queue "${queue}" is full (depth ${depth}): try again later`,
    );
    this.name = "QueueFullError";
  }
}

/** The queue was closed (shutdown or drain); no new items are accepted. */
export class QueueClosedError extends Error {
  /** gRPC status the server answers with. */
  readonly code: PipelineErrorCode = "UNAVAILABLE";
  constructor(
    /** Name of the closed queue. */
    readonly queue: string,
  ) {
    super(`queue "${queue}" is closed (shutting down or draining)`);
    this.name = "QueueClosedError";
  }
}
