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
import { ClientGone } from "./errors.ts";
import { describeError } from "./health.ts";
import type { FlowContext, FlowDeps } from "./pd_flow.ts";
import type { UpstreamLink } from "./upstream.ts";

/** How a finished relay ended. */
export type RelayOutcome = "ok" | "client_gone" | "idle_timeout" | "network";

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
 * `decode_unavailable`), so a client does not report a failed engine as a slow one.
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
      const outcome: RelayOutcome = !deps.legacyAbort && ctx.signal.aborted ? "client_gone" : "ok";
      link.dispose();
      pool.release(backend);
      onEnd(outcome);
    },
    () => {
      // Not delivered: the client went away (Deno aborts its signal first) or D broke off.
      // Stop D's generation either way.
      const outcome: RelayOutcome = ctx.signal.aborted ? "client_gone" : "network";
      if (outcome === "network") {
        metrics.upstreamFailures.inc({ role: "decode", reason: "network" });
        deps.log.warn("decode stream cut short", {
          request_id: ctx.requestId,
          reason: `decode backend ${backend.url} failed mid-response; the client's body was cut`,
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
 * ready for it, and handed on the moment it arrives, so nothing is buffered beyond one chunk.
 * With `streamIdleTimeoutMs` (null: none) D's silence is bounded. A D that goes silent or breaks
 * off ends an SSE stream with an OpenAI-style error event naming D and the request, then the
 * end of the stream; a body of another kind is cut.
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
  const { decode: pool, metrics, log } = deps;
  let ended = false;
  let first = true;
  // When the pending read from D began, or -1 while none is pending: a client that reads slowly
  // leaves no read pending, and its slowness must not count as D's silence.
  let readingSince = -1;
  const idleTimer = streamIdleTimeoutMs === null
    ? undefined
    : watchIdle(link, streamIdleTimeoutMs, () => readingSince);
  const end = (outcome: RelayOutcome) => {
    if (ended) return;
    ended = true;
    if (idleTimer !== undefined) clearInterval(idleTimer);
    link.dispose();
    pool.release(backend);
    onEnd(outcome);
  };
  if (res.body === null) {
    end("ok");
    return null;
  }
  const reader = res.body.getReader({ mode: "byob" });
  // One read buffer per stream, handed back by every read; what a read filled is copied out.
  // A default reader would allocate a new 64 KiB buffer for every chunk of a few hundred bytes.
  let buf = new Uint8Array(READ_BUFFER_BYTES);
  const isSse = isEventStream(res.headers);
  return new ReadableStream<Uint8Array>({
    async pull(controller) {
      let r: ReadableStreamReadResult<Uint8Array>;
      if (idleTimer !== undefined) readingSince = performance.now();
      try {
        r = await reader.read(buf);
      } catch (e) {
        const cut = cutShort(deps, link, backend, ctx, streamIdleTimeoutMs, e);
        end(cut.outcome);
        tellClient(controller, cut, isSse, e);
        return;
      }
      if (r.done) {
        end("ok");
        controller.close();
        return;
      }
      readingSince = -1;
      buf = new Uint8Array(r.value.buffer as ArrayBuffer);
      if (first) {
        first = false;
        metrics.decodeTtfbSeconds.observe(
          { backend: backend.url },
          (performance.now() - t0) / 1000,
        );
      }
      controller.enqueue(r.value.slice());
    },
    cancel(reason) {
      // The client went away (or Deno gave up writing to it): stop D's generation too.
      link.abort("client_gone");
      end("client_gone");
      return reader.cancel(reason).catch((e) => {
        log.debug("cancelling decode body failed", {
          request_id: ctx.requestId,
          error: describeError(e),
        });
      });
    },
  });
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

/** Why a read from D threw: the client left, or D went silent or failed. */
interface CutShort {
  outcome: RelayOutcome;
  /** What the client is told (D's failures only). */
  message: string;
}

/** Classifies a read from D that threw; D's own failures are counted and logged. */
function cutShort(
  deps: FlowDeps,
  link: UpstreamLink,
  backend: Backend,
  ctx: FlowContext,
  streamIdleTimeoutMs: number | null,
  e: unknown,
): CutShort {
  if (link.cause === "client_gone") return { outcome: "client_gone", message: "" };
  const idle = link.cause === "idle_timeout";
  const outcome: RelayOutcome = idle ? "idle_timeout" : "network";
  deps.metrics.upstreamFailures.inc({ role: "decode", reason: outcome });
  const message = idle
    ? `decode backend ${backend.url} sent nothing for ${streamIdleTimeoutMs} ms ` +
      `(request ${ctx.requestId})`
    : `decode backend ${backend.url} failed mid-response (request ${ctx.requestId}): ` +
      describeError(e);
  deps.log.warn("decode stream cut short", { request_id: ctx.requestId, reason: message });
  return { outcome, message };
}

/** Ends the client's body after a cut: an SSE error event where it streams, else an error. */
function tellClient(
  controller: ReadableStreamDefaultController<Uint8Array>,
  cut: CutShort,
  isSse: boolean,
  e: unknown,
): void {
  if (cut.outcome === "client_gone") {
    controller.error(new ClientGone("decode"));
  } else if (isSse) {
    // A streaming client understands an error event; a truncated chunked body reads as
    // a network fault with no explanation.
    const idle = cut.outcome === "idle_timeout";
    controller.enqueue(
      idle
        ? sseError(cut.message, "timeout_error", "decode_idle_timeout")
        : sseError(cut.message, "server_error", "decode_failed"),
    );
    controller.close();
  } else {
    controller.error(e);
  }
}
