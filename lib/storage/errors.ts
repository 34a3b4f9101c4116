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

/** Context attached to a storage error; every field optional. */
export interface StorageErrorFields {
  namespace?: string;
  instance?: string;
  rank?: number;
  layer?: number;
  /** Block content hash (hex) or key. */
  block?: string;
  lease?: string;
  expected?: string | number;
  got?: string | number;
}

/** Base class: `code` for the status, `fields` for the log line and the reply. */
export class StorageError extends Error {
  constructor(
    readonly code: StorageErrorCode,
    message: string,
    readonly fields: StorageErrorFields = {},
  ) {
    super(message);
    this.name = "StorageError";
  }
}

/** Bad input from an engine (a rank out of range, an empty hash, a layer past the layout). */
export class InvalidArgumentError extends StorageError {
  constructor(message: string, fields: StorageErrorFields = {}) {
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
  | "rank-out-of-range";

/**
 * A lease that cannot be used: unknown or expired, bound to another instance,
 * already consumed by this rank. The server answers FAILED_PRECONDITION and
 * the engine queries again (it recomputes on failure).
 */
export class LeaseError extends StorageError {
  constructor(
    readonly reason: LeaseErrorReason,
    message: string,
    fields: StorageErrorFields,
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
    fields: StorageErrorFields = {},
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
  constructor(message: string, fields: StorageErrorFields = {}) {
    super("FAILED_PRECONDITION", message, fields);
    this.name = "StaleHandleError";
  }
}
