/**
 * OpenAI-style errors for the P/D router.
 *
 * Every refusal the router produces — bad input, no backend, an upstream timeout — leaves as
 * `{ "error": { "message", "type", "param", "code" } }` with the matching HTTP status, because that
 * is the shape OpenAI clients (and the `openai` npm package) already parse into typed exceptions.
 * Errors that come from a backend are passed through untouched instead: the backend speaks the same
 * dialect and knows more about what went wrong.
 *
 * @module
 */

import type { Role } from "./backend_pool.ts";

/** The `type` values the router uses; they follow OpenAI's vocabulary. */
export type RouterErrorType = "invalid_request_error" | "server_error" | "timeout_error";

/** Body of an OpenAI-style error response. */
export interface OpenAIErrorBody {
  error: {
    message: string;
    type: RouterErrorType;
    param: string | null;
    code: string | null;
  };
}

/**
 * An error the router answers itself, carrying the HTTP status and the OpenAI error fields.
 *
 * @example
 * ```ts
 * throw new RouterError(400, "invalid_request_error", "n > 1 is not supported (got n=3)", "n", "unsupported_n");
 * ```
 */
export class RouterError extends Error {
  /** HTTP status to answer with. */
  readonly status: number;
  /** OpenAI error type. */
  readonly type: RouterErrorType;
  /** The request field at fault, if any (e.g. `"messages"`). */
  readonly param: string | null;
  /** A stable machine-readable code (e.g. `"body_too_large"`). */
  readonly code: string | null;

  constructor(
    status: number,
    type: RouterErrorType,
    message: string,
    param: string | null = null,
    code: string | null = null,
  ) {
    super(message);
    this.name = "RouterError";
    this.status = status;
    this.type = type;
    this.param = param;
    this.code = code;
  }

  /** The JSON body OpenAI clients expect. */
  toBody(): OpenAIErrorBody {
    return {
      error: { message: this.message, type: this.type, param: this.param, code: this.code },
    };
  }
}

/**
 * A 400 `invalid_request_error`: the client sent something the router will not forward.
 *
 * @example
 * ```ts
 * throw badRequest("'model' is required", "model", "missing_model");
 * ```
 */
export function badRequest(message: string, param: string | null, code: string): RouterError {
  return new RouterError(400, "invalid_request_error", message, param, code);
}

/**
 * Renders a {@link RouterError} as an HTTP response, echoing the request id when known.
 *
 * @example
 * ```ts
 * const res = errorResponse(badRequest("bad", null, "bad"), "req-1");
 * console.log(res.status); // 400
 * ```
 */
export function errorResponse(err: RouterError, requestId?: string): Response {
  const headers = new Headers({ "content-type": "application/json" });
  if (requestId !== undefined) headers.set("x-request-id", requestId);
  return new Response(JSON.stringify(err.toBody()), { status: err.status, headers });
}

/**
 * What a client whose request the router's shutdown cut is told (its grace period for open
 * requests ended): in a 503 `router_shutting_down` before D answered, in an SSE error event after.
 */
export function shutdownMessage(phase: Role, backendUrl: string, requestId: string): string {
  return `the router is shutting down and cut the request during ${phase} on ${backendUrl} ` +
    `(request ${requestId}): its grace period for open requests ended; send it again`;
}

/** The 503 for a request the router's shutdown cut before D answered. */
export function shuttingDown(phase: Role, backendUrl: string, requestId: string): RouterError {
  return new RouterError(
    503,
    "server_error",
    shutdownMessage(phase, backendUrl, requestId),
    null,
    "router_shutting_down",
  );
}

/** Thrown when the client went away; the caller answers nothing more. */
export class ClientGone extends Error {
  constructor(phase: Role) {
    super(`client disconnected during ${phase}`);
    this.name = "ClientGone";
  }
}
