/**
 * The prefill → decode hand-off for one request.
 *
 * 1. P gets a copy of the request with `max_tokens: 1` (and `max_completion_tokens: 1` when the
 *    client set it, `min_tokens` at most 1), `stream: false`, no `stream_options`, and
 *    `kv_transfer_params` asking for `do_remote_decode` — vLLM's disaggregated-serving contract.
 *    P's answer means its KV is saved (the synchronous hand-off; see docs/router.md).
 * 2. D gets the original request (its bytes), plus P's `kv_transfer_params` when P returned any,
 *    under the same `X-Request-Id`. D's response is relayed to the client as it arrives.
 *
 * P is retried once, on another backend when there is one, after a connection failure or a
 * 502/503/504. D is retried once only when its connection failed before D answered anything:
 * refused (the request never reached it; another D is tried), or closed/reset — typically a
 * keep-alive connection D had just closed (another D, else the same one on a new connection).
 * An engine that did receive such a request sees its connection close and aborts it, so no
 * generation is duplicated; once D has answered, nothing is retried. A P or D whose answer is
 * not a usable HTTP response head (headers too large, not HTTP) is retried on another backend
 * only: the same one would answer the same. A P error that is not transient (4xx, 500) is the
 * client's answer as it stands, and D is not called.
 *
 * What P and D are sent (bodies, headers) is lib/router/upstream_bodies.ts's job; relaying D's
 * body once it answered is lib/router/relay.ts's.
 *
 * Both phases run through one helper, `withOneRetry`: a phase's attempt says "done" or "retry"
 * (with whether the same backend may take the retry); the helper owns picking, the one-retry
 * bound, the retry metric and log line, and the error when no retry is left.
 *
 * @module
 */

import type { Backend, BackendPool, Role } from "./backend_pool.ts";
import { ClientGone, RouterError, shuttingDown } from "./errors.ts";
import { describeError } from "./health.ts";
import type { Logger } from "../log.ts";
import type { RouterMetrics } from "./metrics.ts";
import { relayDecodeBody, relayHeaders, type RelayOutcome } from "./relay.ts";
import type { GenerationRequest, JsonObject } from "./validate.ts";
import {
  classifyNetworkError,
  type NetworkFailure,
  TRANSIENT_STATUSES,
  UpstreamLink,
} from "./upstream.ts";
import { BodyError, readBodyLimited } from "../http/body.ts";
import { decodePayload, prefillPayload, upstreamHeaders } from "./upstream_bodies.ts";

/** Largest prefill answer read (a max_tokens=1 completion is a few KiB). */
const MAX_PREFILL_ANSWER_BYTES = 16 * 1024 * 1024;
const decoder = new TextDecoder();

/** What the flow needs from the router. */
export interface FlowDeps {
  prefill: BackendPool;
  decode: BackendPool;
  metrics: RouterMetrics;
  log: Logger;
  client: Deno.HttpClient;
  prefillTimeoutMs: number;
  decodeTimeoutMs: number;
  /**
   * `null`: pipe D's body natively, except SSE streams (relayed chunk by chunk, see relay.ts); a
   * number: relay every body chunk by chunk and enforce this silence.
   */
  streamIdleTimeoutMs: number | null;
  /**
   * Whether this Deno aborts a request's signal after a successful response too (its legacy
   * behaviour, without --unstable-no-legacy-abort); then the signal cannot tell a client that
   * left from one that was served.
   */
  legacyAbort: boolean;
}

/** Per-request context. */
export interface FlowContext {
  requestId: string;
  /** Aborts when the client disconnects. */
  signal: AbortSignal;
  /** The client's `Authorization` header, forwarded to both backends. */
  authorization: string | null;
  /**
   * The server's promise that settles when the response has been delivered (resolves) or was
   * not (rejects). A function because Deno makes the promise on first access, and a rejected
   * promise nobody listens to would be an unhandled rejection.
   */
  completed: () => Promise<void>;
}

/** Result of the prefill phase. */
export type PrefillResult =
  | { kind: "ok"; kvTransferParams: JsonObject | undefined; backend: Backend }
  /** P refused the request (4xx/500): relay its answer, skip D. */
  | { kind: "refused"; status: number; body: string; contentType: string };

type Attempt =
  | { kind: "http"; status: number; text: string; contentType: string }
  | { kind: "timeout" }
  | { kind: "network"; failure: NetworkFailure; message: string }
  | { kind: "oversized"; message: string };

/** One attempt's verdict, for {@link withOneRetry}. */
type Tried<T> =
  | { kind: "done"; value: T }
  | {
    kind: "retry";
    /** Metric label (`http_503`, `connect`, `network`). */
    reason: string;
    /** What went wrong, for the log line and the final error. */
    detail: string;
    /** Whether the same backend may take the retry when no other one is left. */
    sameBackend: boolean;
    /** The error the client gets when the retry is not possible or also failed. */
    giveUp: (attempts: number) => RouterError;
  };

/** Attempts per request and phase: the first one and one retry. */
const MAX_ATTEMPTS = 2;

/**
 * The retry rule both phases share: run `attempt` on a backend picked from `pool`; when it asks
 * for a retry, and it was the first attempt, run it once more on a backend not tried yet — or on
 * the same one, when the attempt allows it and the backend is still in service — counting the
 * retry and logging it. Otherwise the attempt's own error is thrown.
 */
async function withOneRetry<T>(
  role: Role,
  pool: BackendPool,
  deps: FlowDeps,
  ctx: FlowContext,
  attempt: (backend: Backend) => Promise<Tried<T>>,
): Promise<T> {
  const tried = new Set<Backend>();
  const firstPick = pool.pick();
  if (firstPick === undefined) throw noBackend(role, pool, ctx.requestId);
  let backend: Backend = firstPick;
  for (let n = 1;; n++) {
    tried.add(backend);
    const out = await attempt(backend);
    if (out.kind === "done") return out.value;
    const next: Backend | undefined = n < MAX_ATTEMPTS
      ? pool.pick(tried) ?? (out.sameBackend && backend.healthy ? backend : undefined)
      : undefined;
    if (next === undefined) throw out.giveUp(n);
    deps.metrics.retries.inc({ role, reason: out.reason });
    deps.log.warn(`retrying ${role}`, {
      request_id: ctx.requestId,
      failed: backend.url,
      next: next.url,
      reason: out.detail,
    });
    backend = next;
  }
}

/**
 * Runs the prefill phase with its one retry. Throws {@link RouterError} when no P can serve and
 * {@link ClientGone} when the client left.
 */
export async function runPrefill(
  deps: FlowDeps,
  req: GenerationRequest,
  ctx: FlowContext,
): Promise<PrefillResult> {
  const { prefill: pool, metrics } = deps;
  const body = prefillPayload(req);
  return await withOneRetry<PrefillResult>("prefill", pool, deps, ctx, async (backend) => {
    const out = await prefillAttempt(deps, backend, req.route, body, ctx);
    if (out.kind === "http" && out.status >= 200 && out.status < 300) {
      let kvTransferParams: JsonObject | undefined;
      try {
        kvTransferParams = readKvParams(out.text, backend, ctx.requestId);
      } catch (e) {
        metrics.upstreamFailures.inc({ role: "prefill", reason: "bad_response" });
        throw e;
      }
      return { kind: "done", value: { kind: "ok", kvTransferParams, backend } };
    }
    if (out.kind === "http" && !TRANSIENT_STATUSES.has(out.status)) {
      metrics.upstreamFailures.inc({ role: "prefill", reason: `http_${out.status}` });
      logErrorAnswer(deps, "prefill", backend, out.status, ctx, snippet(out.text));
      const refused: PrefillResult = {
        kind: "refused",
        status: out.status,
        body: out.text,
        contentType: out.contentType,
      };
      return { kind: "done", value: refused };
    }
    if (out.kind === "oversized") {
      metrics.upstreamFailures.inc({ role: "prefill", reason: "oversized" });
      throw new RouterError(
        502,
        "server_error",
        `prefill backend ${backend.url}: ${out.message} (request ${ctx.requestId})`,
        null,
        "prefill_bad_response",
      );
    }
    if (out.kind === "timeout") {
      metrics.upstreamFailures.inc({ role: "prefill", reason: "timeout" });
      throw new RouterError(
        504,
        "timeout_error",
        `prefill backend ${backend.url} did not answer within ${deps.prefillTimeoutMs} ms ` +
          `(request ${ctx.requestId})`,
        null,
        "prefill_timeout",
      );
    }
    const reason = out.kind === "http" ? `http_${out.status}` : out.failure;
    const detail = out.kind === "http" ? `HTTP ${out.status}: ${snippet(out.text)}` : out.message;
    metrics.upstreamFailures.inc({ role: "prefill", reason });
    if (out.kind === "network" && out.failure === "connect") {
      pool.markDown(backend, `connection failed: ${out.message}`);
    }
    return {
      kind: "retry",
      reason,
      detail,
      // A connection failure marked the backend down, so `healthy` rules it out here. An
      // answer that cannot be parsed would come again from the same P: another P only.
      sameBackend: reason !== "bad_response",
      giveUp: (attempts) =>
        new RouterError(
          out.kind === "http" ? out.status : 502,
          "server_error",
          `prefill failed on ${backend.url} after ${attempts} attempt(s) (request ` +
            `${ctx.requestId}): ${detail}`,
          null,
          "prefill_unavailable",
        ),
    };
  });
}

async function prefillAttempt(
  deps: FlowDeps,
  backend: Backend,
  route: string,
  body: string,
  ctx: FlowContext,
): Promise<Attempt> {
  const { prefill: pool, metrics } = deps;
  pool.acquire(backend);
  const link = new UpstreamLink(ctx.signal, deps.prefillTimeoutMs);
  const t0 = performance.now();
  try {
    const res = await fetch(backend.url + route, {
      method: "POST",
      headers: upstreamHeaders(ctx.requestId, ctx.authorization),
      body,
      signal: link.signal,
      client: deps.client,
    });
    let raw: Uint8Array;
    try {
      // A prefill answers max_tokens=1: anything near the limit is a broken backend, and
      // read whole it would hold the router's memory.
      raw = await readBodyLimited(res, {
        maxBytes: MAX_PREFILL_ANSWER_BYTES,
        timeoutMs: deps.prefillTimeoutMs,
        what: "prefill answer",
      });
    } catch (e) {
      if (e instanceof BodyError && e.status === 413) {
        return { kind: "oversized", message: e.message };
      }
      // Not the client's body: P's answer broke off (a BodyError names a request body).
      if (e instanceof BodyError && e.status === 400 && link.cause === null) {
        return { kind: "network", failure: "network", message: cutAnswer(e) };
      }
      throw e;
    }
    const text = decoder.decode(raw);
    metrics.prefillSeconds.observe({ backend: backend.url }, (performance.now() - t0) / 1000);
    return {
      kind: "http",
      status: res.status,
      text,
      contentType: res.headers.get("content-type") ?? "application/json",
    };
  } catch (e) {
    if (link.cause === "client_gone") throw new ClientGone("prefill");
    if (link.cause === "shutdown") throw shuttingDown("prefill", backend.url, ctx.requestId);
    if (link.cause === "timeout") return { kind: "timeout" };
    const failure = classifyNetworkError(e);
    return { kind: "network", failure, message: failureMessage(failure, e) };
  } finally {
    link.dispose();
    pool.release(backend);
  }
}

/** What a P answer whose body broke off mid-way is called (not the client's request body). */
function cutAnswer(e: BodyError): string {
  const cause = e.message.slice(e.message.lastIndexOf("): ") + 3);
  return `the prefill answer's body was cut short (the connection ended before its ` +
    `Content-Length, or its chunked encoding broke): ${cause}`;
}

function readKvParams(text: string, backend: Backend, requestId: string): JsonObject | undefined {
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch (e) {
    throw new RouterError(
      502,
      "server_error",
      `prefill backend ${backend.url} returned a body that is not JSON (request ${requestId}; ` +
        `${describeError(e)}): ${snippet(text)}`,
      null,
      "prefill_bad_response",
    );
  }
  const kv = (json as JsonObject | null)?.kv_transfer_params;
  // Same rule as vLLM's reference proxy: only a non-empty object is passed on.
  if (typeof kv === "object" && kv !== null && !Array.isArray(kv) && Object.keys(kv).length > 0) {
    return kv as JsonObject;
  }
  return undefined;
}

/**
 * Runs the decode phase and returns the response to send to the client, whose body relays D's
 * body as it arrives. `onEnd` is called exactly once when the relay is over (or failed before it
 * began, via the thrown error — then it is not called).
 */
export async function runDecode(
  deps: FlowDeps,
  req: GenerationRequest,
  kvTransferParams: JsonObject | undefined,
  ctx: FlowContext,
  onEnd: (status: number, outcome: RelayOutcome) => void,
): Promise<Response> {
  const { decode: pool, metrics } = deps;
  const body = decodePayload(req, kvTransferParams);
  return await withOneRetry<Response>("decode", pool, deps, ctx, async (backend) => {
    pool.acquire(backend);
    const link = new UpstreamLink(ctx.signal, deps.decodeTimeoutMs);
    const t0 = performance.now();
    let res: Response;
    try {
      res = await fetch(backend.url + req.route, {
        method: "POST",
        headers: upstreamHeaders(ctx.requestId, ctx.authorization),
        body,
        signal: link.signal,
        client: deps.client,
      });
    } catch (e) {
      link.dispose();
      pool.release(backend);
      if (link.cause === "client_gone") throw new ClientGone("decode");
      if (link.cause === "shutdown") throw shuttingDown("decode", backend.url, ctx.requestId);
      if (link.cause === "timeout") {
        metrics.upstreamFailures.inc({ role: "decode", reason: "timeout" });
        throw new RouterError(
          504,
          "timeout_error",
          `decode backend ${backend.url} sent no response headers within ${deps.decodeTimeoutMs} ` +
            `ms (request ${ctx.requestId})`,
          null,
          "decode_timeout",
        );
      }
      const failure = classifyNetworkError(e);
      metrics.upstreamFailures.inc({ role: "decode", reason: failure });
      const message = failureMessage(failure, e);
      if (failure === "connect") pool.markDown(backend, `connection failed: ${message}`);
      return {
        kind: "retry",
        reason: failure,
        detail: message,
        // Refused: the request never reached D, another D takes it. Closed/reset: D had
        // likely just closed a keep-alive connection; the same D on a new one will do. An
        // answer that cannot be parsed would come again from the same D: another D only.
        sameBackend: failure === "network",
        giveUp: () =>
          new RouterError(
            502,
            "server_error",
            `decode failed on ${backend.url} (request ${ctx.requestId}): ${message}`,
            null,
            "decode_unavailable",
          ),
      };
    }
    link.clearDeadline();
    if (res.status >= 400) logErrorAnswer(deps, "decode", backend, res.status, ctx);
    const headers = relayHeaders(res.headers, ctx.requestId);
    const done = (outcome: RelayOutcome) => onEnd(res.status, outcome);
    const stream = relayDecodeBody(deps, res, backend, link, t0, ctx, done);
    return { kind: "done", value: new Response(stream, { status: res.status, headers }) };
  });
}

/**
 * Logs an engine's error answer that goes to the client as it stands (P's refusal, D's answer):
 * its body is the engine's own and names neither the phase nor the engine, so this line, under
 * the request id the client got, is what says which one. A 5xx is a warning; a 4xx (the engine
 * judged the request) is routine, at debug like the router's own refusals.
 */
function logErrorAnswer(
  deps: FlowDeps,
  role: Role,
  backend: Backend,
  status: number,
  ctx: FlowContext,
  body?: string,
): void {
  deps.log[status >= 500 ? "warn" : "debug"]("backend answered with an error", {
    request_id: ctx.requestId,
    role,
    backend: backend.url,
    status,
    body,
  });
}

/**
 * Refuses up front when either pool has no backend in service, so a request that cannot finish
 * does not cost a prefill first.
 */
export function checkCapacity(deps: FlowDeps, requestId: string): void {
  if (deps.prefill.healthyCount() === 0) throw noBackend("prefill", deps.prefill, requestId);
  if (deps.decode.healthyCount() === 0) throw noBackend("decode", deps.decode, requestId);
}

function noBackend(role: Role, pool: BackendPool, requestId: string): RouterError {
  const reasons = pool.backends.map((b) => `${b.url} (${b.lastError ?? "out of service"})`);
  return new RouterError(
    503,
    "server_error",
    `no healthy ${role} backend is available (request ${requestId}): ${reasons.join("; ")}`,
    null,
    `no_${role}_backend`,
  );
}

/** What a failed fetch says to the client and the log; an unparsable answer is named as one. */
function failureMessage(failure: NetworkFailure, e: unknown): string {
  const text = describeError(e);
  return failure === "bad_response" ? `answered with an unusable HTTP response: ${text}` : text;
}

const SNIPPET_CHARS = 300;

function snippet(text: string): string {
  return text.length > SNIPPET_CHARS ? text.slice(0, SNIPPET_CHARS) + "…" : text;
}
