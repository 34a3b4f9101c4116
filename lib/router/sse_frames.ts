/**
 * Event framing of D's SSE stream for the chunk-by-chunk relay (lib/router/relay.ts): only whole
 * events go to the client, and the relay learns whether the stream's last event was OpenAI's
 * `data: [DONE]`.
 *
 * Why whole events: when D breaks off or goes silent, the relay ends the client's stream with an
 * error event. Had half of D's last event already gone out, the error event would be glued to it
 * (`data: {"choi` + `data: {"error":...}`): one event that is not JSON, which an OpenAI client
 * reports as a parse error, losing the message that names D and the request. So the bytes after
 * the last blank line of what D sent are held until the rest of their event arrives (an engine
 * writes an event per chunk, so this costs nothing in the usual case), and dropped at a cut: a
 * client would discard an event that never ended too.
 *
 * Event ends recognised: a blank line after LF, CRLF or CR line ends (`\n\n`, `\r\n\r\n`,
 * `\n\r\n`, `\r\r`). Bytes of a stream framed otherwise are held until such an end or the end of
 * the stream, never lost.
 *
 * @module
 */

const LF = 0x0a;
const CR = 0x0d;
const DONE = new TextEncoder().encode("[DONE]");
const DATA = new TextEncoder().encode("data:");

/**
 * Splits D's SSE bytes into whole events.
 *
 * @example
 * ```ts
 * const frames = new SseFrames();
 * frames.push(enc.encode('data: {"a":')); // null: held
 * frames.push(enc.encode('1}\n\ndata: [DONE]\n\n')); // both events
 * frames.endedWithDone; // true
 * ```
 */
export class SseFrames {
  #held: Uint8Array | null = null;
  #done = false;

  /**
   * Takes a chunk read from D (the caller's to give away); returns the bytes of the events it
   * completes, or null when it completes none (then it is held).
   */
  push(chunk: Uint8Array): Uint8Array | null {
    let data = chunk;
    if (this.#held !== null) {
      data = new Uint8Array(this.#held.length + chunk.length);
      data.set(this.#held);
      data.set(chunk, this.#held.length);
    }
    const end = lastEventEnd(data);
    this.#held = end === data.length ? null : data.slice(end);
    if (end === 0) return null;
    const whole = data.subarray(0, end);
    this.#done = endsWithDone(whole);
    return whole;
  }

  /** At D's clean end: what is still held, when it is a `[DONE]` without its blank line. */
  finish(): Uint8Array | null {
    const rest = this.#held;
    this.#held = null;
    if (rest === null || !endsWithDone(rest)) return null;
    this.#done = true;
    return rest;
  }

  /** Bytes held back: an event D has not finished (dropped when the stream is cut). */
  get heldBytes(): number {
    return this.#held?.length ?? 0;
  }

  /** Whether the last whole event was `data: [DONE]`. */
  get endedWithDone(): boolean {
    return this.#done;
  }
}

/** The offset just past the last event end (blank line) in `b`; 0 when there is none. */
function lastEventEnd(b: Uint8Array): number {
  for (let i = b.length - 1; i >= 1; i--) {
    const c = b[i];
    const p = b[i - 1];
    if (c === LF && p === LF) return i + 1;
    if (c === LF && p === CR && i >= 2 && (b[i - 2] === LF || b[i - 2] === CR)) return i + 1;
    if (c === CR && p === CR) return i + 1;
  }
  return 0;
}

/** Whether the last line of `b` (line ends and spaces skipped) is `data: [DONE]`. */
function endsWithDone(b: Uint8Array): boolean {
  let i = b.length;
  while (i > 0 && (b[i - 1] === LF || b[i - 1] === CR || b[i - 1] === 0x20)) i--;
  let s = i - DONE.length;
  if (s < 0 || !matches(b, s, DONE)) return false;
  while (s > 0 && b[s - 1] === 0x20) s--;
  s -= DATA.length;
  return s >= 0 && matches(b, s, DATA) && (s === 0 || b[s - 1] === LF || b[s - 1] === CR);
}

function matches(b: Uint8Array, at: number, what: Uint8Array): boolean {
  for (let j = 0; j < what.length; j++) if (b[at + j] !== what[j]) return false;
  return true;
}
