/**
 * Engine errors carry a gRPC status code chosen where the error is raised, so
 * the service layer maps them without guessing from message text.
 *
 * @module
 */

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
export class EngineError extends Error {
  readonly code: CodeValue;
  constructor(code: CodeValue, message: string) {
    super(message);
    this.name = "EngineError";
    this.code = code;
  }
}

/** Shorthand for INVALID_ARGUMENT. */
export function invalid(message: string): EngineError {
  return new EngineError(Code.INVALID_ARGUMENT, message);
}

/** Shorthand for FAILED_PRECONDITION. */
export function precondition(message: string): EngineError {
  return new EngineError(Code.FAILED_PRECONDITION, message);
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
