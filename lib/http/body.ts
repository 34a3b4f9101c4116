/**
 * Reading an HTTP request body under a size limit: the one body reader of
 * every HTTP endpoint the KV server (lib/server/http.ts) and the router
 * (lib/router/) serve.
 *
 * The limit is enforced while reading, never after: a `Content-Length` over
 * the limit is refused before one byte is read, and a body without a length
 * (chunked) is read chunk by chunk and abandoned (the stream cancelled, the
 * connection dropped by the HTTP layer) as soon as it passes the limit. So an
 * upload of any size costs at most the limit plus one chunk of memory;
 * reading it whole first (`req.text()`) once let a 256 MiB body raise the
 * server's peak memory by ~550 MiB.
 *
 * A body the HTTP layer cannot decode (a broken chunked encoding, a
 * connection closed before the declared length arrived) is the client's
 * fault too: it is a {@link BodyError} with status 400, never an internal
 * error.
 *
 * @module
 */
import { withinOrThrow } from "../timer_limit.ts";

/**
 * Header to answer a refused body with: the unread rest of the upload is
 * still on the connection, so the connection ends with the answer (RFC 9110
 * §15.5.14) instead of the HTTP layer reading and discarding the rest.
 */
export const CLOSE_AFTER_REFUSAL: Readonly<Record<string, string>> = { connection: "close" };

/** Why a body was refused: 413 over the limit, 400 not a readable HTTP body, 408 too slow. */
export type BodyErrorCode = "body_too_large" | "malformed_body" | "body_timeout";

/**
 * A refused request body; `status` is the HTTP status to answer with.
 *
 * @example
 * ```ts
 * try {
 *   await readBodyLimited(req, { maxBytes: 65536 });
 * } catch (e) {
 *   if (e instanceof BodyError) return new Response(e.message, { status: e.status });
 *   throw e;
 * }
 * ```
 */
export class BodyError extends Error {
  /** 413 (over the limit), 400 (malformed) or 408 (not received in time). */
  readonly status: 400 | 408 | 413;
  readonly code: BodyErrorCode;
  constructor(status: 400 | 408 | 413, code: BodyErrorCode, message: string) {
    super(message);
    this.name = "BodyError";
    this.status = status;
    this.code = code;
  }
}

/** How much a body may hold, and what to tell a client that sent more. */
export interface BodyLimit {
  /** Largest accepted body in bytes. */
  maxBytes: number;
  /** Appended to the 413 message, e.g. "raise it with --max-body". */
  hint?: string;
  /** Longest wait for the whole body, in ms (default {@link BODY_READ_TIMEOUT_MS}). */
  timeoutMs?: number;
  /** What the body is, in messages (default "request body"; e.g. "prefill answer"). */
  what?: string;
}

/**
 * How long a request body may take to arrive: a client that stalls mid-upload
 * would otherwise hold its connection (and the handler) until shutdown. Far
 * above any real upload of the bodies these endpoints take.
 */
export const BODY_READ_TIMEOUT_MS = 30_000;

/**
 * Reads `req`'s whole body, refusing it with a {@link BodyError} as soon as
 * it is known to exceed `limit.maxBytes` (by `Content-Length` before reading,
 * otherwise while reading), or when it cannot be decoded. A request without a
 * body gives an empty array.
 *
 * @example
 * ```ts
 * const bytes = await readBodyLimited(req, { maxBytes: 16 << 20, hint: "raise it with --max-body" });
 * const json = JSON.parse(new TextDecoder().decode(bytes));
 * ```
 */
export async function readBodyLimited(
  req: Request | Response,
  limit: BodyLimit,
): Promise<Uint8Array<ArrayBuffer>> {
  const ms = limit.timeoutMs ?? BODY_READ_TIMEOUT_MS;
  const what = limit.what ?? "request body";
  const late = () => new BodyError(408, "body_timeout", `${what} not received within ${ms} ms`);
  // Past the deadline the read is left pending: the refusal closes the connection, which ends it.
  return await withinOrThrow(readBody(req, limit), ms, late);
}

async function readBody(
  req: Request | Response,
  limit: BodyLimit,
): Promise<Uint8Array<ArrayBuffer>> {
  const { maxBytes } = limit;
  if (req.body === null) return new Uint8Array(0);
  const header = req.headers.get("content-length");
  const declared = header === null ? NaN : Number(header);
  if (Number.isSafeInteger(declared)) {
    if (declared > maxBytes) {
      await cancelQuietly(req.body);
      throw tooLarge(`${declared} bytes (Content-Length)`, limit);
    }
    // The HTTP layer holds a body to its declared length, so it can be taken
    // whole (Deno's fast path, no JS stream) without risk of going over.
    try {
      return new Uint8Array(await req.arrayBuffer());
    } catch (e) {
      throw malformed(e);
    }
  }
  const reader = req.body.getReader();
  const parts: Uint8Array<ArrayBuffer>[] = [];
  let total = 0;
  for (;;) {
    let r: ReadableStreamReadResult<Uint8Array<ArrayBuffer>>;
    try {
      r = await reader.read();
    } catch (e) {
      throw malformed(e);
    }
    if (r.done) break;
    total += r.value.byteLength;
    if (total > maxBytes) {
      // Dropping the reader makes the HTTP layer stop reading the upload.
      await reader.cancel("body too large").catch(() => {});
      throw tooLarge(`at least ${total} bytes`, limit);
    }
    parts.push(r.value);
  }
  if (parts.length === 1) return parts[0];
  const out = new Uint8Array(total);
  let off = 0;
  for (const p of parts) {
    out.set(p, off);
    off += p.byteLength;
  }
  return out;
}

function tooLarge(got: string, limit: BodyLimit): BodyError {
  return new BodyError(
    413,
    "body_too_large",
    `${limit.what ?? "request body"} is ${got}, larger than the limit of ${limit.maxBytes} bytes` +
      (limit.hint ? ` (${limit.hint})` : ""),
  );
}

function malformed(e: unknown): BodyError {
  const why = e instanceof Error ? e.message : String(e);
  return new BodyError(
    400,
    "malformed_body",
    `request body could not be read (broken chunked encoding, or the connection ended before ` +
      `the declared length): ${why}`,
  );
}

async function cancelQuietly(body: ReadableStream<Uint8Array>): Promise<void> {
  // The body was never read: cancelling only tells the HTTP layer to drop it.
  // A failure here means the connection is already gone, which changes nothing.
  await body.cancel("body too large").catch(() => {});
}
