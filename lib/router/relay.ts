/**
 * Relaying D's response to the client: which headers pass, and the body either piped natively
 * (no JavaScript per chunk) or pulled chunk by chunk, with the time to first byte, the end of the
 * relay and a client that leaves accounted for exactly once.
 *
 * Which one ({@link relayDecodeBody}): an SSE stream, or any body under a stream idle deadline,
 * is pulled chunk by chunk, because only a relay that reads D's body itself sees D break off
 * while the client's stream is still open, and can end it with an error event the client
 * understands; the native pipe learns of the break only after Deno has cut the client's
 * connection (a truncated chunked body, no explanation). Other bodies (one JSON answer) are
 * piped natively: a cut JSON body cannot be mended, only cut, and the pipe does that too.
 *
 * The retry rules stop where this module starts: once D has answered, nothing is retried
 * (lib/router/pd_flow.ts).
 *
 * @module
 */

import type { Backend } from "./backend_pool.ts";
import { ClientGone, shutdownMessage } from "./errors.ts";
import { describeError } from "./health.ts";
import type { FlowContext, FlowDeps } from "./pd_flow.ts";
import type { UpstreamLink } from "./upstream.ts";
import { SseFrames } from "./sse_frames.ts";

/**
 * How a finished relay ended: `shutdown` when the router's shutdown cut it (the client was still
 * there), `incomplete` when an SSE answer ended without `data: [DONE]`.
 */
export type RelayOutcome =
  | "ok"
  | "client_gone"
  | "idle_timeout"
  | "network"
  | "shutdown"
  | "incomplete";

const encoder = new TextEncoder();
/** Size of the buffer D's body is read into (Deno's own read size for a response body). */
const READ_BUFFER_BYTES = 64 * 1024;

/** Headers that describe one hop's connection, or that the relay changes, and are not copied. */
const HOP_HEADERS = new Set([
  "connection",
  "keep-alive",
  "transfer-encoding",
  "content-length",
  "upgrade",
  "te",
  "trailer",
  "proxy-connection",
  "date",
  "server",
]);

export function relayHeaders(upstream: Headers, requestId: string): Headers {
  const h = new Headers();
  for (const [k, v] of upstream) if (!HOP_HEADERS.has(k)) h.set(k, v);
  h.set("x-request-id", requestId);
  return h;
}

/**
 * An SSE event carrying an OpenAI-style error, sent when a stream must be cut short: a
 * `timeout_error` when D went silent, a `server_error` when D broke off (as the router's own
 * `decode_unavailable`) or ended without `[DONE]`, or the router's shutdown cut it, so a client
 * does not report a failed engine as a slow one.
 */
function sseError(
  message: string,
  type: "timeout_error" | "server_error",
  code: string,
): Uint8Array {
  const body = { error: { message, type, param: null, code } };
  return encoder.encode(`data: ${JSON.stringify(body)}\n\n`);
}

/**
 * Relays D's body: SSE streams, and every body when `deps.streamIdleTimeoutMs` is set, through
 * {@link relayBody} (D breaking off ends an SSE stream with an error event); other bodies
 * through {@link pipeBody}. `onEnd` is called exactly once, when the relay is over.
 */
export function relayDecodeBody(
  deps: FlowDeps,
  res: Response,
  backend: Backend,
  link: UpstreamLink,
  t0: number,
  ctx: FlowContext,
  onEnd: (outcome: RelayOutcome) => void,
): ReadableStream<Uint8Array> | null {
  if (deps.streamIdleTimeoutMs === null && !isEventStream(res.headers)) {
    return pipeBody(deps, res, backend, link, t0, ctx, onEnd);
  }
  return relayBody(deps, res, backend, link, t0, ctx, deps.streamIdleTimeoutMs, onEnd);
}

function isEventStream(headers: Headers): boolean {
  return (headers.get("content-type") ?? "").includes("text/event-stream");
}

/**
 * Hands D's body to the server as it is: Deno then moves the bytes from D's socket to the
 * client's in native code, chunk by chunk as they arrive, with no JavaScript per chunk. The time
 * to first byte is taken at D's response headers; the end is learnt from the server's delivery
 * promise. A client that leaves makes that promise reject, and the upstream request is aborted.
 * A D that breaks off is only counted: the client's body is cut, with nothing added to it.
 */
function pipeBody(
  deps: FlowDeps,
  res: Response,
  backend: Backend,
  link: UpstreamLink,
  t0: number,
  ctx: FlowContext,
  onEnd: (outcome: RelayOutcome) => void,
): ReadableStream<Uint8Array> | null {
  const { decode: pool, metrics } = deps;
  metrics.decodeTtfbSeconds.observe({ backend: backend.url }, (performance.now() - t0) / 1000);
  ctx.completed().then(
    () => {
      // Deno resolves `completed` also when the client left mid-body; its signal tells them
      // apart, unless the legacy signal aborts on success too (then count it as served).
      const outcome: RelayOutcome = !deps.legacyAbort && link.cause === "client_gone"
        ? "client_gone"
        : "ok";
      link.dispose();
      pool.release(backend);
      onEnd(outcome);
    },
    () => {
      // Not delivered: the client went away (Deno aborts its signal first), the router's
      // shutdown cut it, or D broke off. Stop D's generation either way.
      const outcome: RelayOutcome = link.cause === "client_gone" || link.cause === "shutdown"
        ? link.cause
        : "network";
      if (outcome !== "client_gone") {
        if (outcome === "network") {
          metrics.upstreamFailures.inc({ role: "decode", reason: "network" });
        }
        deps.log.warn("decode stream cut short", {
          request_id: ctx.requestId,
          reason: outcome === "shutdown"
            ? `${shutdownMessage("decode", backend.url, ctx.requestId)}; the client's body was cut`
            : `decode backend ${backend.url} failed mid-response; the client's body was cut`,
        });
      }
      link.abort("client_gone");
      link.dispose();
      pool.release(backend);
      onEnd(outcome);
    },
  );
  return res.body;
}

/**
 * Wraps D's body in a pull-based stream: a chunk is read from D only when the client side is
 * ready for it, and handed on the moment it arrives, so nothing is buffered beyond one chunk
 * (of an SSE stream, whole events only: lib/router/sse_frames.ts). With `streamIdleTimeoutMs`
 * (null: none) D's silence is bounded. A D that goes silent or breaks off, or the router's
 * shutdown, ends an SSE stream with an OpenAI-style error event naming D and the request, then
 * the end of the stream; so does an SSE answer that ends without `data: [DONE]`. A body of
 * another kind is cut.
 */
function relayBody(
  deps: FlowDeps,
  res: Response,
  backend: Backend,
  link: UpstreamLink,
  t0: number,
  ctx: FlowContext,
  streamIdleTimeoutMs: number | null,
  onEnd: (outcome: RelayOutcome) => void,
): ReadableStream<Uint8Array> | null {
  const { decode: pool, log } = deps;
  let ended = false;
  const reads = res.body === null ? null : new DecodeReads(deps, res.body, backend, t0);
  const idleTimer = streamIdleTimeoutMs === null || reads === null
    ? undefined
    : watchIdle(link, streamIdleTimeoutMs, () => reads.readingSince);
  const end = (outcome: RelayOutcome) => {
    if (ended) return;
    ended = true;
    if (idleTimer !== undefined) clearInterval(idleTimer);
    link.dispose();
    pool.release(backend);
    onEnd(outcome);
  };
  if (reads === null) {
    end("ok");
    return null;
  }
  const frames = isEventStream(res.headers) ? new SseFrames() : null;
  return new ReadableStream<Uint8Array>({
    async pull(controller) {
      // Until there is something whole to hand on (an SSE event may take several reads).
      for (;;) {
        let chunk: Uint8Array | null;
        try {
          chunk = await reads.next();
        } catch (e) {
          const cut = cutShort(deps, link, backend, ctx, streamIdleTimeoutMs, frames, e);
          end(cut.outcome);
          tellClient(controller, cut, frames !== null, e);
          return;
        }
        if (chunk === null) {
          end(finishStream(deps, controller, frames, res, backend, ctx));
          return;
        }
        const out = frames === null ? chunk : frames.push(chunk);
        if (out !== null) return controller.enqueue(out);
      }
    },
    cancel(reason) {
      // The client went away (or Deno gave up writing to it): stop D's generation too.
      link.abort("client_gone");
      end("client_gone");
      return reads.cancel(reason).catch((e) => {
        log.debug("cancelling decode body failed", {
          request_id: ctx.requestId,
          error: describeError(e),
        });
      });
    },
  });
}

/**
 * Reads D's body into one buffer per stream, handed back by every read; what a read filled is
 * copied out. A default reader would allocate a new 64 KiB buffer for every chunk of a few
 * hundred bytes. The first chunk is D's time to first byte.
 */
class DecodeReads {
  /** When the pending read from D began, or -1 while none is pending: a client that reads
   * slowly leaves no read pending, and its slowness must not count as D's silence. */
  readingSince = -1;
  #buf = new Uint8Array(READ_BUFFER_BYTES);
  #first = true;
  readonly #reader: ReadableStreamBYOBReader;

  constructor(
    readonly deps: FlowDeps,
    body: ReadableStream<Uint8Array>,
    readonly backend: Backend,
    readonly t0: number,
  ) {
    this.#reader = body.getReader({ mode: "byob" });
  }

  /** D's next chunk (a copy), or null at its end; throws what the read threw. */
  async next(): Promise<Uint8Array | null> {
    this.readingSince = performance.now();
    const r = await this.#reader.read(this.#buf);
    if (r.done) return null;
    this.readingSince = -1;
    this.#buf = new Uint8Array(r.value.buffer as ArrayBuffer);
    if (this.#first) {
      this.#first = false;
      this.deps.metrics.decodeTtfbSeconds.observe(
        { backend: this.backend.url },
        (performance.now() - this.t0) / 1000,
      );
    }
    return r.value.slice();
  }

  cancel(reason: unknown): Promise<void> {
    return this.#reader.cancel(reason);
  }
}

/**
 * Aborts `link` when a pending read from D (`readingSince()`, -1 while none)
 * has waited past the deadline. One coarse timer per stream instead of one
 * per chunk: the check is cheap and the deadline only needs to be enforced
 * within a quarter of its length.
 */
function watchIdle(
  link: UpstreamLink,
  timeoutMs: number,
  readingSince: () => number,
): ReturnType<typeof setInterval> {
  const idleCheckMs = Math.max(Math.floor(timeoutMs / 4), 5);
  return setInterval(() => {
    const since = readingSince();
    if (since >= 0 && performance.now() - since > timeoutMs) link.abort("idle_timeout");
  }, idleCheckMs);
}

/**
 * D's body ended cleanly: closes the client's. An SSE answer of D's (2xx) whose last event was
 * not `data: [DONE]` ends with a `decode_incomplete` error event first: an OpenAI client would
 * otherwise take a stream cut short by D (or a proxy before it) for a whole answer.
 */
function finishStream(
  deps: FlowDeps,
  controller: ReadableStreamDefaultController<Uint8Array>,
  frames: SseFrames | null,
  res: Response,
  backend: Backend,
  ctx: FlowContext,
): RelayOutcome {
  const rest = frames?.finish() ?? null;
  if (rest !== null) controller.enqueue(rest);
  if (frames === null || frames.endedWithDone || !res.ok) {
    controller.close();
    return "ok";
  }
  const message = `decode backend ${backend.url} ended its stream without [DONE] ` +
    `(request ${ctx.requestId}): the answer may be incomplete`;
  deps.metrics.upstreamFailures.inc({ role: "decode", reason: "incomplete" });
  deps.log.warn("decode stream ended without [DONE]", {
    request_id: ctx.requestId,
    backend: backend.url,
  });
  controller.enqueue(sseError(message, "server_error", "decode_incomplete"));
  controller.close();
  return "incomplete";
}

/** Why a read from D threw: the client left, the router's shutdown cut it, or D went silent or
 * failed. */
interface CutShort {
  outcome: RelayOutcome;
  /** What the client is told (when it is still there). */
  message: string;
}

/**
 * Classifies a read from D that threw; D's own failures are counted, they and a shutdown's cut
 * logged (with the bytes of an unfinished SSE event dropped).
 */
function cutShort(
  deps: FlowDeps,
  link: UpstreamLink,
  backend: Backend,
  ctx: FlowContext,
  streamIdleTimeoutMs: number | null,
  frames: SseFrames | null,
  e: unknown,
): CutShort {
  if (link.cause === "client_gone") return { outcome: "client_gone", message: "" };
  const outcome: RelayOutcome = link.cause === "idle_timeout" || link.cause === "shutdown"
    ? link.cause
    : "network";
  if (outcome !== "shutdown") {
    deps.metrics.upstreamFailures.inc({ role: "decode", reason: outcome });
  }
  const message = outcome === "shutdown"
    ? shutdownMessage("decode", backend.url, ctx.requestId)
    : outcome === "idle_timeout"
    ? `decode backend ${backend.url} sent nothing for ${streamIdleTimeoutMs} ms ` +
      `(request ${ctx.requestId})`
    : `decode backend ${backend.url} failed mid-response (request ${ctx.requestId}): ` +
      describeError(e);
  deps.log.warn("decode stream cut short", {
    request_id: ctx.requestId,
    reason: message,
    unfinished_event_bytes: frames?.heldBytes,
  });
  return { outcome, message };
}

/** The code and type of the error event that ends a stream cut for `outcome`. */
const CUT_EVENTS: Partial<
  Record<RelayOutcome, { type: "timeout_error" | "server_error"; code: string }>
> = {
  idle_timeout: { type: "timeout_error", code: "decode_idle_timeout" },
  network: { type: "server_error", code: "decode_failed" },
  shutdown: { type: "server_error", code: "router_shutting_down" },
};

/** Ends the client's body after a cut: an SSE error event where it streams, else an error. */
function tellClient(
  controller: ReadableStreamDefaultController<Uint8Array>,
  cut: CutShort,
  isSse: boolean,
  e: unknown,
): void {
  const event = CUT_EVENTS[cut.outcome];
  if (cut.outcome === "client_gone") {
    controller.error(new ClientGone("decode"));
  } else if (isSse && event !== undefined) {
    // A streaming client understands an error event; a truncated chunked body reads as
    // a network fault with no explanation.
    controller.enqueue(sseError(cut.message, event.type, event.code));
    controller.close();
  } else {
    controller.error(e);
  }
}
