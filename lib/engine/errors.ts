/**
 * Engine errors and the one mapping of every error to a gRPC status.
 *
 * The family: {@link KvError} (lib/storage/errors.ts) carries a message and
 * {@link ErrorFields} (instance, rank, layer, block id, request id, expected
 * vs got); {@link EngineError} adds the gRPC status code chosen where it is
 * raised, StorageError a status name. {@link codeOf} maps any thrown value
 * to a status and {@link fieldsOf} gives its fields for the log line: the
 * service layer uses only these two.
 *
 * @module
 */
import { type ErrorFields, KvError } from "../storage/errors.ts";

export type { ErrorFields } from "../storage/errors.ts";

/** gRPC status codes used by the engine (values from the gRPC spec). */
export const Code = {
  OK: 0,
  CANCELLED: 1,
  INVALID_ARGUMENT: 3,
  NOT_FOUND: 5,
  ALREADY_EXISTS: 6,
  RESOURCE_EXHAUSTED: 8,
  FAILED_PRECONDITION: 9,
  INTERNAL: 13,
  UNAVAILABLE: 14,
} as const;
/** A gRPC status code value. */
export type CodeValue = typeof Code[keyof typeof Code];

/** Names of the codes above, for metrics labels. */
export const CODE_NAMES: Record<number, string> = Object.fromEntries(
  Object.entries(Code).map(([k, v]) => [v, k]),
);

/**
 * An error with a gRPC status code and a message naming the ids involved.
 *
 * @example
 * ```ts
 * throw new EngineError(Code.INVALID_ARGUMENT,
 *   `instance "a" rank 0 layer "l3": block id 900 >= num_blocks 512`);
 * ```
 */
export class EngineError extends KvError {
  readonly code: CodeValue;
  constructor(code: CodeValue, message: string, fields: ErrorFields = {}) {
    super(message, fields);
    this.name = "EngineError";
    this.code = code;
  }
}

/** Shorthand for INVALID_ARGUMENT. */
export function invalid(message: string, fields: ErrorFields = {}): EngineError {
  return new EngineError(Code.INVALID_ARGUMENT, message, fields);
}

/** Shorthand for FAILED_PRECONDITION. */
export function precondition(message: string, fields: ErrorFields = {}): EngineError {
  return new EngineError(Code.FAILED_PRECONDITION, message, fields);
}

/** The structured fields of any thrown value (empty for errors outside the family). */
export function fieldsOf(err: unknown): ErrorFields {
  return err instanceof KvError ? err.fields : {};
}

/**
 * Re-raises a lower layer's error as an EngineError with `who` prefixed to
 * the message and `fields` added to its own (same status).
 */
export function withContext(err: unknown, who: string, fields: ErrorFields): unknown {
  if (!(err instanceof KvError) || err instanceof EngineError) return err;
  return new EngineError(codeOf(err), `${who}: ${err.message}`, { ...err.fields, ...fields });
}

/**
 * The gRPC code of any thrown value: EngineError keeps its own; an error
 * carrying a gRPC status NAME in `code` (lib/storage's StorageError) maps by
 * name; anything else is INTERNAL.
 */
export function codeOf(err: unknown): CodeValue {
  if (err instanceof EngineError) return err.code;
  const name = (err as { code?: unknown } | null)?.code;
  if (typeof name === "string" && name in Code) return Code[name as keyof typeof Code];
  return Code.INTERNAL;
}

/** True for errors whose message is meant for the client (not a server bug). */
export function isExpected(err: unknown): boolean {
  return codeOf(err) !== Code.INTERNAL;
}

/** An error's fields as log-line fields (the server's snake_case names). */
export function errorLogFields(err: unknown): Record<string, string | number> {
  const f = fieldsOf(err);
  const out: Record<string, string | number> = {};
  const put = (k: string, v: string | number | undefined) => {
    if (v !== undefined) out[k] = v;
  };
  put("namespace", f.namespace);
  put("instance", f.instance);
  put("rank", f.rank);
  put("tp_rank", f.tpRank);
  put("pp_rank", f.ppRank);
  put("layer", f.layer);
  put("block_id", f.blockId);
  put("block", f.block);
  put("request", f.requestId);
  put("lease", f.lease);
  put("expected", f.expected);
  put("got", f.got);
  return out;
}
