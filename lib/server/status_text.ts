/**
 * Fitting what a refusal echoes back to the size a status and a log line can
 * carry: an engine's ids may be any length, and a refusal names them. The
 * status message (gRPC's `grpc-message` trailer, and the local RPC socket's
 * answer) is cut to {@link MAX_DETAILS_BYTES} keeping both ends; a log line's
 * string fields to {@link MAX_LOG_FIELD_CHARS}.
 *
 * @module
 */

/**
 * Most bytes a status message takes in the `grpc-message` trailer, percent-encoded. A
 * refusal echoes the ids it was sent, and an id may be any length: a 1 MiB instance id
 * made grpc-js drop the answer (the client saw CANCELLED "Call cancelled", never the
 * status), and grpcio refuses trailers over 8 KiB. Same cap on the local RPC socket.
 */
export const MAX_DETAILS_BYTES = 4096;
/** Longest string field of a refusal's log line (a long id is cut, never logged whole). */
export const MAX_LOG_FIELD_CHARS = 1024;

/** ASCII that `encodeURI` (grpc-js's encoding of `grpc-message`) leaves as is. */
const URI_KEPT = /[A-Za-z0-9;,/?:@&=+$\-_.!~*'()#]/;

/** What char `i` of `s` takes in a `grpc-message` trailer: 1, else 3 per UTF-8 byte. */
function encodedBytes(s: string, i: number): number {
  const c = s.charCodeAt(i);
  if (c < 0x80) return URI_KEPT.test(s[i]) ? 1 : 3;
  return c < 0x800 ? 6 : 9; // a surrogate counts 9: a pair (4 UTF-8 bytes, 12) is over-counted
}

/**
 * `s` when it fits {@link MAX_DETAILS_BYTES} encoded, else its head and tail with the
 * middle cut (the ids lead a message, the reason usually ends it). Scans at most about
 * the budget, however long `s` is.
 *
 * @example
 * ```ts
 * capDetails(`instance "${"i".repeat(1 << 20)}" is not registered`); // ~4 KiB, both ends kept
 * ```
 */
export function capDetails(s: string, budget = MAX_DETAILS_BYTES): string {
  let used = 0;
  for (let i = 0; i < s.length; i++) {
    used += encodedBytes(s, i);
    if (used > budget) return cutMiddle(s, budget);
  }
  return s;
}

/** Bytes kept for the "... [N characters cut] ..." marker. */
const CUT_MARKER_BYTES = 64;

/** `s` (over `budget` encoded) as its head (3/4 of the room) and tail (1/4), the middle cut. */
function cutMiddle(s: string, budget: number): string {
  const room = budget - CUT_MARKER_BYTES;
  let head = 0;
  for (let used = 0; head < s.length && used + encodedBytes(s, head) <= room * 3 / 4; head++) {
    used += encodedBytes(s, head);
  }
  let tail = s.length;
  for (let used = 0; tail > head && used + encodedBytes(s, tail - 1) <= room / 4; tail--) {
    used += encodedBytes(s, tail - 1);
  }
  // Never split a surrogate pair: grpc-js's encodeURI throws on a lone surrogate.
  if (head > 0 && isHighSurrogate(s.charCodeAt(head - 1))) head--;
  if (tail < s.length && isLowSurrogate(s.charCodeAt(tail))) tail++;
  return `${s.slice(0, head)} ... [${tail - head} characters cut] ... ${s.slice(tail)}`;
}

const isHighSurrogate = (c: number) => c >= 0xd800 && c <= 0xdbff;
const isLowSurrogate = (c: number) => c >= 0xdc00 && c <= 0xdfff;

/** Log fields with every string cut at MAX_LOG_FIELD_CHARS. */
export function capFields(f: Record<string, string | number>): Record<string, string | number> {
  for (const [k, v] of Object.entries(f)) {
    if (typeof v === "string" && v.length > MAX_LOG_FIELD_CHARS) {
      f[k] = `${v.slice(0, MAX_LOG_FIELD_CHARS)}... (${v.length} characters)`;
    }
  }
  return f;
}
