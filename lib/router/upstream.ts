/**
 * Signal plumbing and failure classification for requests to backends.
 *
 * Every upstream request runs under a signal that fires when the client goes away, when its own
 * deadline passes, or when the router gives up on it for another reason (stream idle). Keeping
 * the reason beside the signal lets the caller tell "the client left" (stop quietly) from "the
 * backend was too slow" (answer 504) from "the backend is unreachable" (retry elsewhere).
 *
 * @module
 */

/** Why an upstream request was aborted by the router. */
export type AbortCause = "client_gone" | "timeout" | "idle_timeout" | "shutdown";

/**
 * The reason a request's work signal aborts with when the router's shutdown cut it (its grace
 * period ended) rather than its client leaving: a link under such a signal aborts with the cause
 * `shutdown`, so the client, still there, is told why.
 */
export class ShutdownCut extends DOMException {
  constructor() {
    super("the router is shutting down", "AbortError");
  }
}

/**
 * An AbortController tied to a parent signal (the client's, or the router's shutdown: see
 * {@link ShutdownCut}) plus an optional deadline.
 *
 * @example
 * ```ts
 * const link = new UpstreamLink(request.signal, 30_000);
 * try { await fetch(url, { signal: link.signal }); } finally { link.dispose(); }
 * if (link.cause === "timeout") { ... }
 * ```
 */
export class UpstreamLink {
  readonly #ac = new AbortController();
  readonly #parent: AbortSignal;
  #timer: ReturnType<typeof setTimeout> | undefined;
  #cause: AbortCause | null = null;
  readonly #onParent = () =>
    this.abort(this.#parent.reason instanceof ShutdownCut ? "shutdown" : "client_gone");

  constructor(parent: AbortSignal, deadlineMs?: number) {
    this.#parent = parent;
    if (parent.aborted) this.#onParent();
    else parent.addEventListener("abort", this.#onParent, { once: true });
    if (deadlineMs !== undefined) {
      this.#timer = setTimeout(() => this.abort("timeout"), deadlineMs);
    }
  }

  /** The signal to hand to `fetch`. */
  get signal(): AbortSignal {
    return this.#ac.signal;
  }

  /** Why it was aborted, or `null` while it was not. */
  get cause(): AbortCause | null {
    return this.#cause;
  }

  /** Aborts the upstream request; the first cause wins. */
  abort(cause: AbortCause): void {
    if (this.#cause !== null) return;
    this.#cause = cause;
    this.#ac.abort(new DOMException(`upstream request aborted: ${cause}`, "AbortError"));
  }

  /** Stops the deadline (e.g. once D's headers arrived) but keeps the link to the client. */
  clearDeadline(): void {
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    this.#timer = undefined;
  }

  /** Releases the timer and the listener on the parent signal. */
  dispose(): void {
    this.clearDeadline();
    this.#parent.removeEventListener("abort", this.#onParent);
  }
}

/** How a fetch that threw (not aborted by us) failed. */
export type NetworkFailure = "connect" | "network" | "bad_response";

/**
 * What hyper says when a backend's answer is not a usable HTTP response head (too large, not
 * HTTP, a bad header, status or length). The backend got the request and answered; it would
 * answer the same again, so such a failure is never retried on the same backend.
 */
const BAD_RESPONSE_RE =
  /message head is too large|invalid [\w -]+ parsed|unexpected transfer-encoding/i;

/**
 * Classifies a fetch exception: `connect` when the TCP connection was never made (the request
 * certainly did not reach the backend, so any request may be retried), `bad_response` when the
 * backend answered with a response head that cannot be parsed (e.g. headers over hyper's limit),
 * `network` otherwise (reset, closed mid-response).
 *
 * @example
 * ```ts
 * const e = await fetch(url).then(() => null, (e) => e);
 * if (classifyNetworkError(e) === "connect") pool.markDown(backend, String(e));
 * ```
 */
export function classifyNetworkError(e: unknown): NetworkFailure {
  const text = e instanceof Error
    ? `${e.message} ${e.cause instanceof Error ? e.cause.message : ""}`
    : String(e);
  if (/\(Connect\)|Connection refused|tcp connect error|dns error/i.test(text)) return "connect";
  return BAD_RESPONSE_RE.test(text) ? "bad_response" : "network";
}

/** HTTP statuses from a backend that mean "try again, maybe elsewhere". */
export const TRANSIENT_STATUSES: ReadonlySet<number> = new Set([502, 503, 504]);
