/**
 * What P and D are sent: the request headers, P's copy of the body (one token, no stream, a
 * remote decode asked for) and D's body (the client's bytes, plus P's `kv_transfer_params`).
 *
 * Both bodies keep every value as the client wrote it. A body parsed into JavaScript and
 * serialized again loses what a double cannot hold: a 64-bit `seed` such as 12345678901234567891
 * would reach the engine as 12345678901234567000 (another seed, silently), and `1e400` as `null`.
 * So D's body is the client's bytes with P's `kv_transfer_params` spliced in before the closing
 * brace, and P's copy, when the body may hold such a number, is built from a parse that keeps
 * each number's source text (`JSON.rawJSON`).
 *
 * @module
 */

import type { GenerationRequest, JsonObject } from "./validate.ts";

/**
 * The `kv_transfer_params` sent to P: ask it to keep the KV for a remote decode. The null fields
 * are the ones P fills in its answer (vLLM's NIXL and PegaFlow connectors read this shape).
 */
export const PREFILL_KV_TRANSFER_PARAMS: Readonly<JsonObject> = Object.freeze({
  do_remote_decode: true,
  do_remote_prefill: false,
  remote_engine_id: null,
  remote_block_ids: null,
  remote_host: null,
  remote_port: null,
});

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/**
 * Builds the body sent to P. `min_tokens` above 1 becomes 1: P generates one token, and vLLM
 * refuses a `min_tokens` above `max_tokens` (D still gets the client's value).
 *
 * @example
 * ```ts
 * prefillBody({ model: "m", prompt: "hi", max_tokens: 50, stream: true });
 * // { model: "m", prompt: "hi", max_tokens: 1, stream: false, kv_transfer_params: {...} }
 * ```
 */
export function prefillBody(body: JsonObject): JsonObject {
  const p: JsonObject = { ...body, max_tokens: 1, stream: false };
  if ("max_completion_tokens" in p) p.max_completion_tokens = 1;
  if (numberOf(p.min_tokens) > 1) p.min_tokens = 1;
  // vLLM rejects stream_options on a non-streaming request.
  delete p.stream_options;
  p.kv_transfer_params = { ...PREFILL_KV_TRANSFER_PARAMS };
  return p;
}

/** P's body as sent: {@link prefillBody} of the client's body, every client value as written. */
export function prefillPayload(req: GenerationRequest): string {
  return JSON.stringify(prefillBody(req.inexactNumbers ? parseExact(req.raw) : req.body));
}

/**
 * D's body as sent: the client's bytes, plus `kv` (P's `kv_transfer_params`) when there is one.
 * Spliced in before the closing brace; a body that has the key already is rebuilt instead (from
 * an exact parse when it may hold numbers a double would change), so the key appears once.
 */
export function decodePayload(
  req: GenerationRequest,
  kv: JsonObject | undefined,
): Uint8Array<ArrayBuffer> {
  if (kv === undefined) return req.raw;
  if ("kv_transfer_params" in req.body) {
    const body = req.inexactNumbers ? parseExact(req.raw) : req.body;
    return encoder.encode(JSON.stringify({ ...body, kv_transfer_params: kv }));
  }
  const close = closingBrace(req.raw);
  const member = encoder.encode(
    `${Object.keys(req.body).length > 0 ? "," : ""}"kv_transfer_params":${JSON.stringify(kv)}`,
  );
  const out = new Uint8Array(req.raw.length + member.length);
  out.set(req.raw.subarray(0, close));
  out.set(member, close);
  out.set(req.raw.subarray(close), close + member.length);
  return out;
}

/**
 * Headers of a request to P or D. `accept-encoding: identity` because fetch would otherwise offer
 * gzip and br, decode what a compressing engine (or a proxy before it) sends, and leave its
 * `content-encoding` on the response: relayed, that header would make clients decode plain bytes.
 * Uncompressed, D's bytes pass to the client as they are.
 */
export function upstreamHeaders(requestId: string, authorization: string | null): Headers {
  const h = new Headers({
    "content-type": "application/json",
    "accept-encoding": "identity",
    "x-request-id": requestId,
  });
  if (authorization !== null) h.set("authorization", authorization);
  return h;
}

/** What `JSON.rawJSON` makes: a value JSON.stringify writes as its source text. */
interface RawJson {
  readonly rawJSON: string;
}
const rawJson = (JSON as unknown as { rawJSON(text: string): RawJson }).rawJSON;
const isRawJson = (JSON as unknown as { isRawJSON(v: unknown): v is RawJson }).isRawJSON;

/** A validated body parsed again, each number that JavaScript would change kept as written. */
function parseExact(raw: Uint8Array): JsonObject {
  return JSON.parse(
    decoder.decode(raw),
    (_key: string, value: unknown, context?: { source?: string }) =>
      typeof value === "number" && context?.source !== undefined &&
        String(value) !== context.source
        ? rawJson(context.source)
        : value,
  ) as JsonObject;
}

/** A number, or one kept as written by {@link parseExact}; NaN for anything else. */
function numberOf(v: unknown): number {
  if (typeof v === "number") return v;
  return isRawJson(v) ? Number(v.rawJSON) : NaN;
}

/** Where the closing `}` of a JSON object's bytes is: its last `}` (only whitespace follows). */
function closingBrace(raw: Uint8Array): number {
  let i = raw.length - 1;
  while (i > 0 && raw[i] !== 0x7d) i--;
  return i;
}
