/**
 * The liveness sessions and the registrations they belong to: which stream
 * stands for each registered rank, the token its registration was issued,
 * and the grace timer of a rank registered without a session. The gRPC
 * service (grpc_service.ts) opens, checks and ends sessions through it.
 *
 * @module
 */
import type * as grpc from "@grpc/grpc-js";
import type { SessionEvent, SessionEvent_Kind, SessionRequest } from "../../proto/pegaflow.ts";
import {
  newRegistrationToken,
  type SessionMismatch,
  sessionMismatch,
} from "../engine/registration.ts";

/** A Session stream, as grpc-js hands it to the handler. */
export type SessionCall = grpc.ServerWritableStream<SessionRequest, SessionEvent>;

/**
 * How long a registered rank may go without a session before it is cleaned up as if its
 * session ended (`--session-grace-ms`). The clients open the session right after
 * RegisterContext (one round trip); 30 s covers a retried call on a loaded host, and an
 * engine that died in between frees its rank for its restart within that time.
 */
export const DEFAULT_SESSION_GRACE_MS = 30_000;

/** One rank's liveness: the registration it belongs to, its stream, its grace timer. */
interface RankSession {
  /** Issued by RegisterContext; undefined while the rank is not registered (an early session). */
  token?: string;
  /**
   * The rank's stream. With `token` set it presented that token (`check` admits no other, and
   * `registered` detaches a stream opened before the registration); without, it stands for none.
   */
  call?: SessionCall;
  grace?: ReturnType<typeof setTimeout>;
}

/**
 * The sessions and the registrations they belong to: instance → rank → token, stream and
 * grace timer. A registration's token is issued here (RegisterContext), and a session
 * stands for a registered rank only with it, so another engine under the same instance
 * id cannot supersede the holder's session (whose end would clean the holder up).
 */
export class Sessions {
  readonly #byInstance = new Map<string, Map<number, RankSession>>();
  #stopping = false;
  /** How long a registered rank may go without a session ({@link DEFAULT_SESSION_GRACE_MS}). */
  readonly graceMs: number;

  constructor(opts: { graceMs?: number } = {}) {
    this.graceMs = opts.graceMs ?? DEFAULT_SESSION_GRACE_MS;
  }

  /** True once {@link endAll} ran: the server is stopping; no session or RPC is taken. */
  get stopping(): boolean {
    return this.#stopping;
  }

  /** Open session streams. */
  get count(): number {
    let n = 0;
    for (const m of this.#byInstance.values()) for (const r of m.values()) if (r.call) n++;
    return n;
  }

  #rank(instance: string, rank: number): RankSession {
    let m = this.#byInstance.get(instance);
    if (!m) this.#byInstance.set(instance, m = new Map());
    let r = m.get(rank);
    if (!r) m.set(rank, r = {});
    return r;
  }

  /** The token of the rank's registration; undefined when it is not registered here. */
  tokenOf(instance: string, rank: number): string | undefined {
    return this.#byInstance.get(instance)?.get(rank)?.token;
  }

  /** Why a session presenting `token` ("" for none) cannot stand for the rank (registration.ts). */
  check(instance: string, rank: number, token: string): SessionMismatch | undefined {
    return sessionMismatch(this.tokenOf(instance, rank), token);
  }

  /**
   * RegisterContext took the rank: issues its token and starts its grace timer: `onGrace` runs
   * when no session presenting the token opened within {@link graceMs} (the caller cleans the
   * instance up). A stream the rank had (one opened with no token before the registration)
   * presented no token of it and is never adopted: it is detached and returned as
   * `unadopted`, for the caller to end (its end then concerns no registration). Adopting it
   * let whichever process opened a session first hold the registration, and its end clean
   * the registered engine up.
   */
  registered(
    instance: string,
    rank: number,
    onGrace: () => void,
  ): { token: string; unadopted?: SessionCall } {
    const r = this.#rank(instance, rank);
    const token = newRegistrationToken();
    const unadopted = r.call;
    r.token = token;
    r.call = undefined;
    clearTimeout(r.grace);
    r.grace = setTimeout(() => {
      r.grace = undefined;
      if (this.#byInstance.get(instance)?.get(rank) === r && !r.call) onGrace();
    }, this.graceMs);
    return { token, unadopted };
  }

  /** Makes `call` the rank's stream (check it first); returns the one it supersedes, if any. */
  add(instance: string, rank: number, call: SessionCall): SessionCall | undefined {
    const r = this.#rank(instance, rank);
    const old = r.call;
    r.call = call;
    clearTimeout(r.grace);
    r.grace = undefined;
    return old;
  }

  /**
   * Removes `call` if it is still the current stream of (instance, rank): "registered" when
   * it stood for the rank's registration (it presented its token; its end cleans the instance
   * up), "unregistered" when it stands for none (a session opened with no token for a rank
   * that has not registered, or for a rank outside the topology the instance then registered
   * with: its end concerns no registered rank); undefined when it was not current
   * (superseded, detached by a registration, or its instance ended).
   */
  remove(
    instance: string,
    rank: number,
    call: SessionCall,
  ): "registered" | "unregistered" | undefined {
    const m = this.#byInstance.get(instance);
    const r = m?.get(rank);
    if (!m || !r || r.call !== call) return undefined;
    r.call = undefined;
    // A registered rank keeps its token until its instance is gone (the cleanup that follows).
    if (r.token === undefined) m.delete(rank);
    if (m.size === 0) this.#byInstance.delete(instance);
    return r.token === undefined ? "unregistered" : "registered";
  }

  /** Ends every stream of the instance with `kind` and forgets its registrations. */
  end(instance: string, kind: SessionEvent_Kind, message: string): void {
    const m = this.#byInstance.get(instance);
    if (!m) return;
    this.#byInstance.delete(instance);
    for (const r of m.values()) {
      clearTimeout(r.grace);
      r.call?.write({ kind, message });
      r.call?.end();
    }
  }

  /** Ends every stream with `kind` (the server is stopping); from now on {@link stopping}. */
  endAll(kind: SessionEvent_Kind, message: string): void {
    this.#stopping = true;
    for (const id of [...this.#byInstance.keys()]) this.end(id, kind, message);
  }
}
