/**
 * Request intake: read the body under a size limit and check it is a request the router can split
 * between prefill and decode. Everything here runs before any byte goes upstream, so a refusal
 * costs the backends nothing.
 *
 * @module
 */

import { BodyError, CLOSE_AFTER_REFUSAL, readBodyLimited } from "../http/body.ts";
import { badRequest, errorResponse, RouterError } from "./errors.ts";

/** The two generation routes the router splits. */
export type GenerationRoute = "/v1/completions" | "/v1/chat/completions";

/** A JSON object as parsed from a request body. */
export type JsonObject = Record<string, unknown>;

/** A validated generation request. */
export interface GenerationRequest {
  route: GenerationRoute;
  /** The parsed body; the router never mutates it (P and D get copies). */
  body: JsonObject;
  /** The body bytes exactly as received, forwarded to D when nothing needs adding. */
  raw: Uint8Array<ArrayBuffer>;
  /** Whether the client asked for a stream (`"stream": true`). */
  stream: boolean;
  /**
   * Whether the body may hold a number JavaScript does not keep as written (an integer past
   * 2^53, an exponent past a double's range): a body built from {@link body} would change it, so
   * the bodies sent upstream are built from {@link raw} (lib/router/upstream_bodies.ts).
   */
  inexactNumbers: boolean;
}

/**
 * A run of 16+ digits (an integer past 2^53 has 16 or more) or a 3-digit exponent. It may match
 * inside a string or a long fraction too: that only costs the exact, slower copy.
 */
const INEXACT_NUMBER_RE = /\d{16}|[eE][+-]?\d{3}/;

/** What a client over `--max-body` is told to do. */
const MAX_BODY_HINT = "raise it with --max-body";

/**
 * Reads a request body under `maxBytes` with the shared reader (lib/http/body.ts: the limit holds
 * while reading, by `Content-Length` or chunk by chunk), so an oversized upload is never held in
 * memory. Over the limit is a 413 `body_too_large`, a body that cannot be decoded (a broken chunked
 * encoding) a 400 `malformed_body`, both as {@link RouterError}s.
 *
 * @example
 * ```ts
 * const bytes = await readRequestBody(request, 16 * 1024 * 1024);
 * ```
 */
export async function readRequestBody(
  req: Request,
  maxBytes: number,
): Promise<Uint8Array<ArrayBuffer>> {
  try {
    return await readBodyLimited(req, { maxBytes, hint: MAX_BODY_HINT });
  } catch (e) {
    if (!(e instanceof BodyError)) throw e;
    throw new RouterError(e.status, "invalid_request_error", e.message, null, e.code);
  }
}

/**
 * The answer to an intake refusal; one that left the body unread (or unreadable) also ends the
 * connection, so the rest of the upload is not read and discarded.
 *
 * @example
 * ```ts
 * return refusalResponse(err, requestId);
 * ```
 */
export function refusalResponse(err: RouterError, requestId?: string): Response {
  const res = errorResponse(err, requestId);
  if (err.code === "body_too_large" || err.code === "malformed_body") {
    for (const [k, v] of Object.entries(CLOSE_AFTER_REFUSAL)) res.headers.set(k, v);
  }
  return res;
}

const decoder = new TextDecoder("utf-8", { fatal: true });

/**
 * Parses and checks a generation request body: a JSON object with a non-empty string `model`, one
 * `prompt` (completions; a batch of several is refused) or non-empty `messages` (chat), `n`
 * absent or 1, and well-typed `stream`, `max_tokens`, `max_completion_tokens`. Throws a 400
 * {@link RouterError} naming the field.
 *
 * @example
 * ```ts
 * const req = parseGenerationRequest("/v1/completions", new TextEncoder().encode(
 *   '{"model":"m","prompt":"hi","stream":true}'));
 * req.stream; // true
 * ```
 */
export function parseGenerationRequest(
  route: GenerationRoute,
  raw: Uint8Array<ArrayBuffer>,
): GenerationRequest {
  const { body, text } = parseObject(raw);
  if (body.model === undefined || body.model === null) {
    throw badRequest("'model' is required", "model", "missing_model");
  }
  if (typeof body.model !== "string" || body.model.length === 0) {
    throw badRequest(
      `'model' must be a non-empty string, got ${jsonKind(body.model)}`,
      "model",
      "invalid_model",
    );
  }

  if (route === "/v1/completions") checkPrompt(body.prompt);
  else checkMessages(body.messages);

  if (body.n !== undefined && body.n !== null) {
    if (!Number.isInteger(body.n) || (body.n as number) < 1) {
      throw badRequest(
        `'n' must be a positive integer, got ${JSON.stringify(body.n)}`,
        "n",
        "invalid_n",
      );
    }
    if ((body.n as number) > 1) {
      throw badRequest(
        `n > 1 is not supported by the P/D router (got n=${body.n}); send n separate requests`,
        "n",
        "unsupported_n",
      );
    }
  }
  if (body.stream !== undefined && body.stream !== null && typeof body.stream !== "boolean") {
    throw badRequest(
      `'stream' must be a boolean, got ${jsonKind(body.stream)}`,
      "stream",
      "invalid_stream",
    );
  }
  for (const field of ["max_tokens", "max_completion_tokens"]) {
    const v = body[field];
    if (v !== undefined && v !== null && (!Number.isInteger(v) || (v as number) < 1)) {
      throw badRequest(
        `'${field}' must be a positive integer, got ${JSON.stringify(v)}`,
        field,
        `invalid_${field}`,
      );
    }
  }
  return {
    route,
    body,
    raw,
    stream: body.stream === true,
    inexactNumbers: INEXACT_NUMBER_RE.test(text),
  };
}

/** The body as a JSON object, and its text; a 400 `invalid_json` when it is not one. */
function parseObject(raw: Uint8Array<ArrayBuffer>): { body: JsonObject; text: string } {
  if (raw.byteLength === 0) {
    throw badRequest("request body is empty; expected a JSON object", null, "invalid_json");
  }
  let parsed: unknown;
  let text: string;
  try {
    text = decoder.decode(raw);
    parsed = JSON.parse(text);
  } catch (e) {
    throw badRequest(
      `request body is not valid JSON: ${e instanceof Error ? e.message : String(e)}`,
      null,
      "invalid_json",
    );
  }
  if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) {
    throw badRequest(
      `request body must be a JSON object, got ${jsonKind(parsed)}`,
      null,
      "invalid_json",
    );
  }
  return { body: parsed as JsonObject, text };
}

/**
 * `prompt` must be one prompt: vLLM's prefill answers a batch with ONE top-level
 * `kv_transfer_params` (its first prompt's), so D would read the first prompt's KV for every prompt
 * of the batch. A batch of one (`["a"]`, `[[1, 2]]`) and a token-id list (`[1, 2]`) are one prompt.
 */
function checkPrompt(prompt: unknown): void {
  if (prompt === undefined || prompt === null) {
    throw badRequest("'prompt' is required for /v1/completions", "prompt", "missing_prompt");
  }
  const count = promptCount(prompt);
  if (count === null) {
    throw badRequest(
      "'prompt' must be a string, a non-empty array of strings, token ids, or token-id arrays",
      "prompt",
      "invalid_prompt",
    );
  }
  if (count > 1) {
    throw badRequest(
      `'prompt' is a batch of ${count} prompts; the P/D router sends one prompt per request ` +
        "(a prefill engine answers a batch with the KV transfer parameters of its first prompt " +
        `only): send ${count} requests`,
      "prompt",
      "unsupported_prompt_batch",
    );
  }
}

/**
 * How many prompts `prompt` holds in one of OpenAI's shapes (a string; an array of strings, of
 * token ids — one prompt —, or of token-id arrays), or null for any other value.
 */
function promptCount(prompt: unknown): number | null {
  if (typeof prompt === "string") return 1;
  if (!Array.isArray(prompt) || prompt.length === 0) return null;
  if (prompt.every((t) => Number.isInteger(t))) return 1;
  const batch = prompt.every((p) => typeof p === "string") ||
    prompt.every((p) => Array.isArray(p) && p.every((t) => Number.isInteger(t)));
  return batch ? prompt.length : null;
}

function checkMessages(messages: unknown): void {
  if (messages === undefined || messages === null) {
    throw badRequest(
      "'messages' is required for /v1/chat/completions",
      "messages",
      "missing_messages",
    );
  }
  if (!Array.isArray(messages) || messages.length === 0) {
    throw badRequest(
      `'messages' must be a non-empty array, got ${jsonKind(messages)}`,
      "messages",
      "invalid_messages",
    );
  }
  messages.forEach((m, i) => {
    if (typeof m !== "object" || m === null || Array.isArray(m) || typeof m.role !== "string") {
      throw badRequest(
        `'messages[${i}]' must be an object with a string 'role'`,
        `messages[${i}]`,
        "invalid_messages",
      );
    }
  });
}

function jsonKind(v: unknown): string {
  if (v === null) return "null";
  if (Array.isArray(v)) return v.length === 0 ? "an empty array" : "an array";
  if (typeof v === "string") return v.length === 0 ? "an empty string" : "a string";
  return `a ${typeof v}`;
}
