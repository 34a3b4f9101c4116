/**
 * Typed storage errors. Each carries a `code` (a gRPC status name the server
 * maps to a number) and the ids needed to act on it: namespace, instance,
 * rank, layer, block hash, expected vs got.
 *
 * @module
 */

/** gRPC status names used by storage errors. */
export type StorageErrorCode =
  | "INVALID_ARGUMENT"
  | "FAILED_PRECONDITION"
  | "RESOURCE_EXHAUSTED"
  | "NOT_FOUND";

/**
 * The ids an error names, every field optional: what an operator or an
 * engine needs to act on it. One shape for the whole family (storage and
 * engine errors), logged as fields next to the message.
 */
export interface ErrorFields {
  namespace?: string;
  instance?: string;
  /** Global rank (pp_rank * tp_size + tp_rank), or the store's TP rank. */
  rank?: number;
  tpRank?: number;
  ppRank?: number;
  /** Layer id, or the layer's name where the id is not assigned yet. */
  layer?: number | string;
  /** The engine's block id (an index into its KV cache). */
  blockId?: number;
  /** Block content hash (hex) or key. */
  block?: string;
  requestId?: string;
  lease?: string;
  expected?: string | number;
  got?: string | number;
}

/** The storage errors' former name for {@link ErrorFields}; kept for callers that import it. */
export type StorageErrorFields = ErrorFields;

/**
 * The base of PegaFlow's error family: a message for people and
 * {@link ErrorFields} for logs and tools. Subclasses say which gRPC status
 * they map to (lib/engine/errors.ts `codeOf` is the one mapping).
 */
export class KvError extends Error {
  constructor(message: string, readonly fields: ErrorFields = {}) {
    super(message);
    this.name = "KvError";
  }
}

/** Base class: `code` for the status, `fields` for the log line and the reply. */
export class StorageError extends KvError {
  constructor(
    readonly code: StorageErrorCode,
    message: string,
    fields: ErrorFields = {},
  ) {
    super(message, fields);
    this.name = "StorageError";
  }
}

/** Bad input from an engine (a rank out of range, an empty hash, a layer past the layout). */
export class InvalidArgumentError extends StorageError {
  constructor(message: string, fields: ErrorFields = {}) {
    super("INVALID_ARGUMENT", message, fields);
    this.name = "InvalidArgumentError";
  }
}

/**
 * Two different layouts claim one namespace (two models hash alike, or an
 * engine changed its geometry): refused loudly rather than mixing bytes.
 */
export class LayoutMismatchError extends StorageError {
  constructor(namespace: string, what: string, expected: string | number, got: string | number) {
    super(
      "FAILED_PRECONDITION",
      `namespace ${namespace}: ${what} differs from the layout already stored ` +
        `(expected ${expected}, got ${got}); two layouts cannot share one namespace`,
      { namespace, expected, got },
    );
    this.name = "LayoutMismatchError";
  }
}

/** Why a lease was refused. */
export type LeaseErrorReason =
  | "unknown-or-expired"
  | "wrong-instance"
  | "rank-already-consumed"
  | "rank-out-of-range"
  | "block-discarded";

/**
 * A lease that cannot be used: unknown or expired, bound to another instance,
 * already consumed by this rank, or holding a block discarded since it was
 * granted (its bytes were computed over a failed load). The server answers FAILED_PRECONDITION and
 * the engine queries again (it recomputes on failure).
 */
export class LeaseError extends StorageError {
  constructor(
    readonly reason: LeaseErrorReason,
    message: string,
    fields: ErrorFields,
  ) {
    super("FAILED_PRECONDITION", message, fields);
    this.name = "LeaseError";
  }
}

/**
 * The pinned pool cannot hold a save even after evicting everything that may
 * be evicted (the rest is under leases, loads or in-flight copies). The save
 * is dropped; the engine recomputes later.
 */
export class PoolExhaustedError extends StorageError {
  constructor(
    readonly neededBytes: number,
    readonly freeBytes: number,
    readonly evictableBytes: number,
    fields: ErrorFields = {},
  ) {
    super(
      "RESOURCE_EXHAUSTED",
      `pinned pool exhausted: save needs ${neededBytes} bytes, ${freeBytes} free and ` +
        `${evictableBytes} evictable (the rest is pinned by leases, loads or copies); the save is dropped`,
      { ...fields, expected: neededBytes, got: freeBytes + evictableBytes },
    );
    this.name = "PoolExhaustedError";
  }
}

/** A save plan or load ticket was completed twice, or belongs to another store. */
export class StaleHandleError extends StorageError {
  constructor(message: string, fields: ErrorFields = {}) {
    super("FAILED_PRECONDITION", message, fields);
    this.name = "StaleHandleError";
  }
}
