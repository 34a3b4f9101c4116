/**
 * The TypeScript client of the PegaFlow KV server: promise-returning calls
 * over the generated grpc-js client, with gRPC errors turned into
 * {@link PegaflowError} (status code + message), and a liveness session.
 * Used by the simulated engine, the tests, the benchmarks and embedders.
 *
 * @module
 */
import * as grpc from "@grpc/grpc-js";
import {
  EngineClient,
  type HealthResponse,
  type LoadInto,
  type LoadRequest,
  type LoadResponse,
  type QueryPrefetchRequest,
  type RankLoadOutcome,
  type RegisterContextRequest,
  type RegisterContextResponse,
  type SaveRequest,
  type SaveResponse,
  type SessionEvent,
  SessionEvent_Kind,
  type UnregisterContextResponse,
} from "../../proto/pegaflow.ts";
import { PROTOCOL_VERSION } from "../engine/engine.ts";
import { EngineService } from "../../proto/pegaflow.ts";
import { LOCAL_RPC_SUFFIX } from "../local_rpc/wire.ts";
import { LocalRpcAbsent, LocalRpcClient, LocalRpcStatus } from "./local_rpc.ts";

export { PROTOCOL_VERSION };

/**
 * How an ALREADY_EXISTS answer to RegisterContext (the same registration again) names the
 * rank's registration token (lib/server/grpc_service.ts `withToken`).
 */
const REGISTRATION_TOKEN_IN_DETAILS = /\(registration token ([0-9a-f]+)\)/;

/** Default deadline of every unary call (a Save returns after its copy: it is the longest). */
export const DEFAULT_DEADLINE_MS = 30_000;

/** 64 MiB, the server's default message limit. */
export const CLIENT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

/**
 * A failed call: the method, the gRPC status code, its name and the server's
 * message (which names the ids involved), as python/pegaflow/errors.py's.
 */
export class PegaflowError extends Error {
  readonly code: number;
  readonly codeName: string;
  readonly details: string;
  /** The RPC that failed, e.g. "Save". */
  readonly method: string;
  constructor(method: string, code: number, details: string) {
    const codeName = grpc.status[code] ?? String(code);
    super(`${method}: ${codeName}: ${details}`);
    this.name = "PegaflowError";
    this.code = code;
    this.codeName = codeName;
    this.details = details;
    this.method = method;
  }
}

/** What a query answered. */
export type QueryResult =
  | { kind: "loading" }
  | {
    kind: "ready";
    hits: number;
    leaseId: Uint8Array;
    ttlMs: number;
    /** With `loadInto` and a hit: each rank's load, in the order named (empty `error`: submitted). */
    loads: RankLoadOutcome[];
  };

/** An open liveness session; `closed` resolves with the server's last event (or null when the stream broke). */
export interface Session {
  readonly events: SessionEvent[];
  readonly closed: Promise<SessionEvent | null>;
  /**
   * The status the stream broke with (UNAVAILABLE: the server is stopping or
   * went away; INVALID_ARGUMENT: the session was refused for its ids;
   * FAILED_PRECONDITION: refused for its registration token, missing, another
   * registration's or stale; CANCELLED after {@link close}); undefined while
   * open and after the server ended it with an event.
   */
  readonly error: PegaflowError | undefined;
  /** Ends the session from the client side (the server then cleans the instance up). */
  close(): void;
}

type Cb<T> = (err: grpc.ServiceError | null, res: T) => void;

/**
 * A connection to one KV server: `host:port`, or `unix:/path` for the
 * server's `--uds` socket (an engine on the same host skips the TCP stack;
 * grpc-js's `unix:///path` form works too).
 *
 * @example
 * ```ts
 * const c = new PegaflowClient("127.0.0.1:50055");
 * console.log((await c.health()).version);
 * c.close();
 * const local = new PegaflowClient("unix:/run/pegaflow/grpc.sock");
 * local.close();
 * ```
 */
export class PegaflowClient {
  readonly address: string;
  readonly #raw: EngineClient;
  /** The server's local RPC socket beside a `unix:` address (see lib/server/local_rpc.ts). */
  readonly #local: LocalRpcClient | undefined;
  readonly #deadlineMs: number;
  /**
   * The registration token this client was answered for each rank (`instance/tp/pp`): what
   * {@link openSession} presents, so the session stands for this client's registration.
   */
  readonly #tokens = new Map<string, string>();
  /**
   * Sessions opened with no token, per rank, waiting for the registration that adopts them:
   * the first one this client is answered for the rank after the session opened.
   */
  #closed = false;

  /**
   * `localRpc` (default true): with a `unix:PATH` address, Save, QueryPrefetch,
   * Load, Release and Health go over the local RPC socket `PATH.rpc` when the
   * server has one, gRPC otherwise. `deadlineMs` (default
   * {@link DEFAULT_DEADLINE_MS}): every unary call fails with
   * DEADLINE_EXCEEDED past it, so a wedged server never hangs a caller.
   */
  constructor(
    address: string,
    opts: { maxMessageBytes?: number; localRpc?: boolean; deadlineMs?: number } = {},
  ) {
    this.address = address;
    this.#deadlineMs = opts.deadlineMs ?? DEFAULT_DEADLINE_MS;
    if (!(this.#deadlineMs > 0)) {
      // 0, a negative or NaN deadline fails every call before it is sent.
      throw new RangeError(
        `PegaflowClient ${address}: deadlineMs ${opts.deadlineMs} is not a positive number of ms`,
      );
    }
    const max = opts.maxMessageBytes ?? CLIENT_MAX_MESSAGE_BYTES;
    const unixPath = address.startsWith("unix:")
      ? address.slice("unix:".length).replace(/^\/\/(?=\/)/, "")
      : undefined;
    this.#local = unixPath !== undefined && opts.localRpc !== false
      ? new LocalRpcClient(unixPath + LOCAL_RPC_SUFFIX, max)
      : undefined;
    this.#raw = new EngineClient(address, grpc.credentials.createInsecure(), {
      "grpc.max_receive_message_length": max,
      "grpc.max_send_message_length": max,
      "grpc.keepalive_time_ms": 30_000,
      "grpc.keepalive_timeout_ms": 20_000,
    });
  }

  /** `extraMs`: added to the client's deadline (a call that holds its answer, WaitPrefetch). */
  #call<Req, Res>(
    method: string,
    fn: (req: Req, md: grpc.Metadata, opts: grpc.CallOptions, cb: Cb<Res>) => unknown,
    req: Req,
    extraMs = 0,
  ): Promise<Res> {
    if (this.#closed) {
      // grpc-js would throw a bare "Channel has been shut down" with no status.
      return Promise.reject(
        new PegaflowError(method, grpc.status.CANCELLED, `client of ${this.address} is closed`),
      );
    }
    const local = this.#local;
    const name = method[0].toLowerCase() + method.slice(1) as keyof typeof EngineService;
    if (local?.usable && HOT.has(name)) {
      return this.#callLocal(local, method, name, fn, req, extraMs);
    }
    return this.#callGrpc(method, fn, req, extraMs);
  }

  #callGrpc<Req, Res>(
    method: string,
    fn: (req: Req, md: grpc.Metadata, opts: grpc.CallOptions, cb: Cb<Res>) => unknown,
    req: Req,
    extraMs: number,
  ): Promise<Res> {
    return new Promise((resolve, reject) => {
      const opts = { deadline: Date.now() + this.#deadlineMs + extraMs };
      fn.call(
        this.#raw,
        req,
        new grpc.Metadata(),
        opts,
        (err: grpc.ServiceError | null, res: Res) => {
          if (err) reject(new PegaflowError(method, err.code, err.details ?? err.message));
          else resolve(res);
        },
      );
    });
  }

  async #callLocal<Req, Res>(
    local: LocalRpcClient,
    method: string,
    name: keyof typeof EngineService,
    fn: (req: Req, md: grpc.Metadata, opts: grpc.CallOptions, cb: Cb<Res>) => unknown,
    req: Req,
    extraMs: number,
  ): Promise<Res> {
    const def = EngineService[name] as unknown as {
      requestSerialize(r: Req): Uint8Array;
      responseDeserialize(b: Uint8Array): Res;
    };
    let body: Uint8Array;
    try {
      body = await local.call(name, def.requestSerialize(req), this.#deadlineMs + extraMs);
    } catch (e) {
      if (e instanceof LocalRpcAbsent) return this.#callGrpc(method, fn, req, extraMs);
      if (e instanceof LocalRpcStatus) throw new PegaflowError(method, e.code, e.details);
      throw e;
    }
    try {
      return def.responseDeserialize(body);
    } catch (e) {
      // What grpc-js answers for an answer it cannot parse.
      throw new PegaflowError(
        method,
        grpc.status.INTERNAL,
        `unparsable answer (${body.length} bytes) from ${local.path}: ${(e as Error).message}`,
      );
    }
  }

  health(): Promise<HealthResponse> {
    return this.#call("Health", this.#raw.health as never, {});
  }

  /**
   * Registers one rank. `clientVersion` defaults to the protocol version this
   * SDK speaks. List `layerNames` in the order the model runs them: it is the
   * order of `layers_ready` in a load state, and every rank and instance of
   * the namespace must use the same one. `engineId`: the engine incarnation,
   * the same on every rank of one engine (e.g. `crypto.randomUUID()` once per
   * engine start); a rank of another engine id is refused while the instance
   * exists. Default "" (not checked).
   */
  registerContext(
    req: Omit<RegisterContextRequest, "clientVersion" | "kvSharedAcrossTp" | "engineId"> & {
      clientVersion?: string;
      kvSharedAcrossTp?: boolean;
      engineId?: string;
    },
  ): Promise<RegisterContextResponse> {
    const rank = rankKey(req.instanceId, req.tpRank, req.ppRank);
    return this.#call<RegisterContextRequest, RegisterContextResponse>(
      "RegisterContext",
      this.#raw.registerContext as never,
      {
        ...req,
        clientVersion: req.clientVersion ?? PROTOCOL_VERSION,
        kvSharedAcrossTp: req.kvSharedAcrossTp ?? false,
        engineId: req.engineId ?? "",
      },
    ).then((r) => {
      if (r.registrationToken !== "") this.#keepToken(rank, r.registrationToken);
      return r;
    }, (e: unknown) => {
      // The same registration again: the server still holds it and names its token.
      const token = e instanceof PegaflowError && e.code === grpc.status.ALREADY_EXISTS &&
        REGISTRATION_TOKEN_IN_DETAILS.exec(e.details)?.[1];
      if (token) this.#keepToken(rank, token);
      throw e;
    });
  }

  /** Keeps the rank's token: its sessions present it. */
  #keepToken(rank: string, token: string): void {
    this.#tokens.set(rank, token);
  }

  /**
   * Saves blocks: per-layer `layers`, or `blockIds`/`blockHashes` for every
   * layer of the rank. The answer counts blocks saved, skipped (held already),
   * refused (room, or a recent discard) and not admitted (TinyLFU): only saved
   * ones are cached. `engineId` (as in {@link registerContext}; default "", not
   * checked): the server refuses a Save of another engine than the instance's.
   * `discardHashes`: blocks this rank computed over a load that failed on it,
   * dropped at the server whoever saved them (`blocksDiscarded`).
   */
  save(
    req:
      & Omit<
        SaveRequest,
        "layers" | "blockIds" | "blockHashes" | "requestId" | "engineId" | "discardHashes"
      >
      & Partial<SaveRequest>,
  ): Promise<SaveResponse> {
    return this.#call("Save", this.#raw.save as never, {
      layers: [],
      blockIds: [],
      blockHashes: [],
      requestId: "",
      discardHashes: [],
      ...req,
      engineId: req.engineId ?? "",
    });
  }

  /**
   * Longest cached prefix of `blockHashes`. With `loadInto` (one target per
   * hash, every rank once with its load state), a hit's load of every rank
   * starts before the answer ("query and load", proto QueryPrefetchRequest).
   * `engineId` (default "", not checked): the server refuses a query of another
   * engine than the instance's, taking no lease and starting no load.
   */
  async queryPrefetch(
    req: Omit<QueryPrefetchRequest, "loadInto" | "engineId"> & {
      loadInto?: LoadInto;
      engineId?: string;
    },
  ): Promise<QueryResult> {
    const r = await this.#call<
      QueryPrefetchRequest,
      import("../../proto/pegaflow.ts").QueryPrefetchResponse
    >(
      "QueryPrefetch",
      this.#raw.queryPrefetch as never,
      { loadInto: undefined, ...req, engineId: req.engineId ?? "" },
    );
    if (r.result?.$case === "ready") {
      return {
        kind: "ready",
        hits: r.result.value.numHitBlocks,
        leaseId: r.result.value.leaseId,
        ttlMs: r.result.value.leaseTtlMs,
        loads: r.result.value.loads,
      };
    }
    return { kind: "loading" };
  }

  /**
   * After a `loading` answer: resolves true once the lower tier's fetch of
   * `requestId` ended (query again: RAM answers) or none runs, false after
   * `waitMs` (1..60000) while it still runs. Takes no lease; the call's
   * deadline is the client's plus `waitMs`.
   */
  async waitPrefetch(
    req: { instanceId: string; requestId: string; waitMs: number; engineId?: string },
  ): Promise<boolean> {
    const r = await this.#call<
      import("../../proto/pegaflow.ts").WaitPrefetchRequest,
      import("../../proto/pegaflow.ts").WaitPrefetchResponse
    >(
      "WaitPrefetch",
      this.#raw.waitPrefetch as never,
      { ...req, engineId: req.engineId ?? "" },
      req.waitMs,
    );
    return r.settled;
  }

  /**
   * Loads a lease into `blockIds` and returns at submit (progress goes to the
   * load state `loadStateShm`). `blockIds` may name a prefix of the lease
   * (fewer targets: the rest is given back; none: this rank's share is
   * consumed and the load state reads done at once); more targets than the
   * lease holds is INVALID_ARGUMENT, and like every refusal leaves the lease
   * usable for a corrected retry.
   */
  /**
   * `whole`: the engine reads the load only once all of it landed (async mode; see the proto).
   * `engineId` (default "", not checked): the server refuses a Load of another engine than
   * the instance's before the lease is touched.
   */
  load(
    req: Omit<LoadRequest, "requestId" | "whole" | "engineId"> & {
      requestId?: string;
      whole?: boolean;
      engineId?: string;
    },
  ): Promise<LoadResponse> {
    return this.#call("Load", this.#raw.load as never, {
      requestId: "",
      whole: false,
      ...req,
      engineId: req.engineId ?? "",
    });
  }

  async release(leaseId: Uint8Array): Promise<void> {
    await this.#call("Release", this.#raw.release as never, { leaseId });
  }

  unregisterContext(instanceId: string): Promise<UnregisterContextResponse> {
    // Its registrations end: their tokens stand for nothing any more.
    for (const k of [...this.#tokens.keys()]) {
      if (k.startsWith(`${instanceId}/`)) this.#tokens.delete(k);
    }
    return this.#call("UnregisterContext", this.#raw.unregisterContext as never, { instanceId });
  }

  /**
   * Opens the liveness stream for one rank. It presents the registration token this client
   * was answered for the rank (or `opts.registrationToken`): a registered rank takes a
   * session only with its registration's token, so open it after {@link registerContext}.
   * With no token (the rank not registered by this client yet) the session stands for no
   * registration: it is refused for a rank a registration holds, and a registration of its
   * rank made after it ends it (FAILED_PRECONDITION); its end forgets no token.
   */
  openSession(
    instanceId: string,
    tpRank = 0,
    ppRank = 0,
    opts: { registrationToken?: string } = {},
  ): Session {
    if (this.#closed) {
      // grpc-js would throw a bare "Channel has been shut down" with no status.
      throw new PegaflowError(
        "Session",
        grpc.status.CANCELLED,
        `client of ${this.address} is closed (instance ${instanceId} tp ${tpRank} pp ${ppRank})`,
      );
    }
    const rank = rankKey(instanceId, tpRank, ppRank);
    const registrationToken = opts.registrationToken ?? this.#tokens.get(rank);
    const call = this.#raw.session({ instanceId, tpRank, ppRank, registrationToken });
    const events: SessionEvent[] = [];
    let error: PegaflowError | undefined;
    // The server sends its headers when it takes the session (grpc_service.ts): a session that
    // never got them (no connection, the server away) stood for no registration.
    let reached = false;
    const closed = new Promise<SessionEvent | null>((resolve) => {
      call.on("metadata", () => reached = true);
      call.on("data", (e: SessionEvent) => events.push(e));
      call.on("end", () => resolve(events.at(-1) ?? null));
      call.on("error", (e: grpc.ServiceError) => {
        error = new PegaflowError("Session", e.code, e.details ?? e.message);
        resolve(events.at(-1) ?? null);
      });
    });
    closed.then((last) => {
      // A session opened with no token stood for no registration: its end ends none.
      if (registrationToken === undefined || last?.kind === SessionEvent_Kind.SUPERSEDED) return;
      // The end of the session that stood for the rank ends its registration (the server
      // cleans the instance up): its token, and only its, is stale. A refusal (only the
      // server answers these) of a presented token says it is stale too; a session that never
      // reached the server ended nothing.
      const refused = error?.code === grpc.status.FAILED_PRECONDITION ||
        error?.code === grpc.status.INVALID_ARGUMENT;
      if ((reached || refused) && this.#tokens.get(rank) === registrationToken) {
        this.#tokens.delete(rank);
      }
    });
    return {
      events,
      closed,
      get error() {
        return error;
      },
      close: () => call.cancel(),
    };
  }

  close(): void {
    this.#closed = true;
    this.#local?.close();
    this.#raw.close();
  }
}

/** The key of a rank in {@link PegaflowClient}'s token map. */
function rankKey(instanceId: string, tpRank: number, ppRank: number): string {
  return `${instanceId}/${tpRank}/${ppRank}`;
}

/** The calls the local RPC socket carries. */
const HOT = new Set<string>(["save", "queryPrefetch", "waitPrefetch", "load", "release", "health"]);
