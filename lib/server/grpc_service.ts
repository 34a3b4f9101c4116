/**
 * The gRPC `pegaflow.Engine` service on grpc-js: decodes requests (static
 * ts-proto code, plugged in as the service definition's serialize and
 * deserialize; bytes that do not decode answer INVALID_ARGUMENT, see
 * decode.ts), calls the {@link KvEngine}, and maps every error to a gRPC
 * status through lib/engine/errors.ts `codeOf` (the one mapping), logging
 * its structured fields. Also serves the liveness sessions (their table is
 * sessions.ts): when a session stream drops, the instance is cleaned up.
 *
 * @module
 */
import * as grpc from "@grpc/grpc-js";
import {
  EngineService,
  type HealthResponse,
  type LoadRequest,
  type LoadResponse,
  type QueryPrefetchRequest,
  type QueryPrefetchResponse,
  type RegisterContextRequest,
  type RegisterContextResponse,
  type ReleaseRequest,
  type SaveRequest,
  type SaveResponse,
  SessionEvent_Kind,
  type UnregisterContextRequest,
  type WaitPrefetchRequest,
  type WaitPrefetchResponse,
} from "../../proto/pegaflow.ts";
import {
  Code,
  CODE_NAMES,
  codeOf,
  EngineError,
  errorLogFields,
  fieldsOf,
  invalid,
  isExpected,
  precondition,
} from "../engine/errors.ts";
import {
  type KvEngine,
  PROTOCOL_VERSION,
  type QueryAnswer,
  type RankLoadOutcome,
} from "../engine/engine.ts";
import type { Logger } from "../log.ts";
import type { ServerMetrics } from "./metrics.ts";
import { LEASE_ID_BYTES, MAX_NAME_CHARS, MAX_PARALLEL } from "../limits.ts";
import { rankIndex, rankOutOfRange } from "../engine/rank.ts";
import { undecodableReason } from "./decode.ts";
import {
  checkName,
  SESSION_TAKEN_HEADER,
  sessionMismatchText,
  unadoptedSessionText,
} from "../engine/registration.ts";
import { type SessionCall, Sessions } from "./sessions.ts";
import { capDetails, capFields } from "./status_text.ts";

type Unary<Req, Res> = grpc.handleUnaryCall<Req, Res>;

function queryResponse(r: QueryAnswer, loads: RankLoadOutcome[]): QueryPrefetchResponse {
  if (r.loading) return { result: { $case: "loading", value: {} } };
  return {
    result: {
      $case: "ready",
      value: {
        numHitBlocks: r.hits,
        leaseId: r.leaseId ?? new Uint8Array(0),
        leaseTtlMs: r.ttlMs,
        loads,
      },
    },
  };
}

/**
 * The ids a request names (instance, TP/PP rank, request id) as log fields,
 * for refusals whose error carries fewer (a registration's checks, an
 * unknown instance, an internal failure). Strings are cut at
 * MAX_NAME_CHARS: a refused request may carry an id of any length.
 */
function requestLogFields(req: unknown): Record<string, string | number> {
  const r = (typeof req === "object" && req !== null ? req : {}) as Record<string, unknown>;
  const out: Record<string, string | number> = {};
  const str = (k: string, v: unknown) => {
    if (typeof v === "string" && v !== "") out[k] = v.slice(0, MAX_NAME_CHARS);
  };
  str("instance", r.instanceId);
  if (typeof r.tpRank === "number") out.tp_rank = r.tpRank;
  if (typeof r.ppRank === "number") out.pp_rank = r.ppRank;
  str("request", r.requestId);
  return out;
}

/** What every call gets once the server began stopping. */
function stopping(method: string): EngineError {
  return new EngineError(Code.UNAVAILABLE, `${method}: server is stopping`);
}

/**
 * Why a Session cannot stand for this rank: its id breaks the name rule, a rank is past
 * MAX_PARALLEL, or the instance is registered and the rank is outside its topology (its
 * end would clean up an instance it is no rank of). An unknown instance is no refusal: a
 * session with no token for a rank not registered yet is taken, standing for no
 * registration (the rank's registration ends it, sessions.ts `registered`).
 */
function sessionRefusal(
  engine: KvEngine,
  instanceId: string,
  tpRank: number,
  ppRank: number,
): string | undefined {
  try {
    checkName("instance_id", instanceId, "Session");
  } catch (e) {
    return capDetails((e as Error).message);
  }
  const outOfRange = rankOutOfRange(tpRank, ppRank);
  if (outOfRange) return capDetails(`Session: instance "${instanceId}": ${outOfRange}`);
  const t = engine.topologyOf(instanceId);
  if (t && !(tpRank < t.tpSize && ppRank < t.ppSize)) {
    return capDetails(
      `Session: instance "${instanceId}": tp_rank ${tpRank} pp_rank ${ppRank} is outside its topology (tp_size ${t.tpSize}, pp_size ${t.ppSize})`,
    );
  }
  return undefined;
}

/**
 * The same registration of a held rank again (ALREADY_EXISTS: the holder asking, e.g. one
 * whose first answer was lost) is told the rank's registration token, so that it can open
 * the rank's session. Any other error passes unchanged.
 */
function withToken(err: unknown, token: string | undefined): unknown {
  if (token === undefined || codeOf(err) !== Code.ALREADY_EXISTS) return err;
  const message = `${(err as Error).message} (registration token ${token})`;
  return new EngineError(Code.ALREADY_EXISTS, message, fieldsOf(err));
}

function statusError(err: unknown): Partial<grpc.StatusObject> {
  const message = err instanceof Error ? err.message : String(err);
  return { code: codeOf(err) as number, details: capDetails(message) };
}

/**
 * Builds the service implementation.
 *
 * long function: a table of one short handler per RPC (decode → engine call → response)
 * sharing the `unary` wrapper's timing, status mapping and logging; each
 * handler is a few lines and reads best next to the others.
 *
 * @example
 * ```ts
 * server.addService(lenientService(), engineServiceImpl(engine, sessions, metrics, log));
 * ```
 */
export function engineServiceImpl(
  engine: KvEngine,
  sessions: Sessions,
  metrics: ServerMetrics,
  log: Logger,
): grpc.UntypedServiceImplementation {
  /** Wraps a unary handler: timing, status mapping, metrics, error logs. */
  function unary<Req, Res>(method: string, fn: (req: Req) => Res | Promise<Res>): Unary<Req, Res> {
    return (call, callback) => {
      const t0 = performance.now();
      let p: Promise<Res>;
      try {
        if (sessions.stopping) throw stopping(method);
        const bad = undecodableReason(call.request);
        if (bad !== undefined) throw invalid(`${method}: ${bad}`);
        p = Promise.resolve(fn(call.request));
      } catch (e) {
        p = Promise.reject(e);
      }
      p.then(
        (res) => {
          const t1 = performance.now();
          metrics.rpc(method, "OK", (t1 - t0) / 1000);
          callback(null, res);
          log.debug("rpc done", {
            method,
            handler_ms: Math.round((t1 - t0) * 1e3) / 1e3,
            respond_ms: Math.round((performance.now() - t1) * 1e3) / 1e3,
          });
        },
        (e) => {
          const st = statusError(e);
          metrics.rpc(
            method,
            CODE_NAMES[st.code!] ?? String(st.code),
            (performance.now() - t0) / 1000,
          );
          if (!isExpected(e)) {
            log.error("rpc failed unexpectedly", {
              method,
              error: String((e as Error)?.stack ?? e),
              ...capFields({ ...requestLogFields(call.request), ...errorLogFields(e) }),
            });
          } else {
            // The same registration of a rank again answers ALREADY_EXISTS by design (a client
            // whose stream broke, and the Python client's check once its session is open): not
            // news. Another engine's registration of a held rank is FAILED_PRECONDITION, logged.
            const routine = method === "RegisterContext" && st.code === grpc.status.ALREADY_EXISTS;
            log[routine ? "debug" : "info"]("rpc refused", {
              method,
              code: CODE_NAMES[st.code!],
              error: st.details,
              ...capFields({ ...requestLogFields(call.request), ...errorLogFields(e) }),
            });
          }
          callback(st, null);
        },
      );
    };
  }

  const cleanup = async (instance: string, reason: string) => {
    if (!engine.has(instance)) return 0;
    metrics.cleanup(reason);
    return await engine.unregister(instance, reason);
  };

  /** A registered rank's grace period passed with no session presenting its token. */
  const neverOpened = (instance: string, tpRank: number, ppRank: number) => {
    log.warn("registered rank never opened its session; cleaning up the instance", {
      instance,
      tp_rank: tpRank,
      pp_rank: ppRank,
      grace_ms: sessions.graceMs,
    });
    cleanup(instance, "session_never_opened").catch((e) =>
      log.error("session cleanup failed", { instance, error: String(e) })
    );
  };

  /** Streams this service ended with a status itself: their "error" event is no client's end. */
  const endedHere = new WeakSet<SessionCall>();

  /** Refuses a Session: counted, logged with the ids it names, ended with the status. */
  const refuse = (call: SessionCall, code: grpc.status, details: string) => {
    const name = CODE_NAMES[code];
    metrics.rpc("Session", name, 0);
    log.info("rpc refused", {
      method: "Session",
      code: name,
      error: details,
      ...capFields(requestLogFields(call.request)),
    });
    // grpc-js ends a server stream with the status of an emitted error.
    call.emit("error", { code, details });
  };

  engine.onInstanceGone((id, reason) =>
    sessions.end(id, SessionEvent_Kind.CLEANED_UP, `instance "${id}" cleaned up (${reason})`)
  );

  return {
    registerContext: unary(
      "RegisterContext",
      (req: RegisterContextRequest): RegisterContextResponse => {
        const { instanceId, tpRank, ppRank } = req;
        const rank = rankIndex(tpRank, ppRank, MAX_PARALLEL);
        let r;
        try {
          r = engine.register(req);
        } catch (e) {
          throw withToken(e, sessions.tokenOf(instanceId, rank));
        }
        const { token: registrationToken, unadopted } = sessions.registered(
          instanceId,
          rank,
          () => neverOpened(instanceId, tpRank, ppRank),
        );
        if (unadopted) {
          // Opened with no token before this registration: it stands for none (sessions.ts).
          endedHere.add(unadopted);
          const who = `Session: instance "${instanceId}" tp_rank ${tpRank} pp_rank ${ppRank}`;
          refuse(unadopted, grpc.status.FAILED_PRECONDITION, capDetails(unadoptedSessionText(who)));
        }
        return {
          numLayers: r.numLayers,
          topologySealed: r.topologySealed,
          ranksRegistered: r.ranksRegistered,
          registrationToken,
        };
      },
    ),
    save: unary("Save", async (req: SaveRequest): Promise<SaveResponse> => {
      checkName("instance_id", req.instanceId, "Save");
      const r = await engine.save(req);
      return {
        blocksSaved: r.blocksSaved,
        blocksSkipped: r.blocksSkipped,
        bytesCopied: r.bytesCopied,
        blocksRefused: r.blocksRefused,
        blocksNotAdmitted: r.blocksNotAdmitted,
        blocksDiscarded: r.blocksDiscarded,
      };
    }),
    queryPrefetch: unary(
      "QueryPrefetch",
      (req: QueryPrefetchRequest): QueryPrefetchResponse => {
        const { instanceId, blockHashes, requestId, loadInto, engineId } = req;
        checkName("instance_id", instanceId, `QueryPrefetch (request "${requestId}")`);
        if (loadInto === undefined) {
          return queryResponse(engine.query(instanceId, blockHashes, requestId, engineId), []);
        }
        const r = engine.queryLoad(instanceId, blockHashes, requestId, loadInto, engineId);
        return queryResponse(r, r.loads);
      },
    ),
    waitPrefetch: unary(
      "WaitPrefetch",
      async (req: WaitPrefetchRequest): Promise<WaitPrefetchResponse> => {
        const { instanceId, requestId, waitMs, engineId } = req;
        checkName("instance_id", instanceId, `WaitPrefetch (request "${requestId}")`);
        return { settled: await engine.waitPrefetch(instanceId, requestId, waitMs, engineId) };
      },
    ),
    load: unary("Load", async (req: LoadRequest): Promise<LoadResponse> => {
      // The engine checks the lease id after attaching the load state, so a
      // polling engine sees that refusal too.
      const r = await engine.load(req);
      return { numBlocks: r.numBlocks, numLayers: r.numLayers, bytes: r.bytes };
    }),
    release: unary("Release", (req: ReleaseRequest) => {
      if (req.leaseId.length !== LEASE_ID_BYTES) {
        throw invalid(`lease id is ${req.leaseId.length} bytes, expected ${LEASE_ID_BYTES}`);
      }
      engine.release(req.leaseId);
      return {};
    }),
    unregisterContext: unary(
      "UnregisterContext",
      async (req: UnregisterContextRequest) => {
        checkName("instance_id", req.instanceId, "UnregisterContext");
        if (!engine.has(req.instanceId)) {
          throw precondition(`UnregisterContext: instance "${req.instanceId}" is not registered`);
        }
        return { leasesReleased: await cleanup(req.instanceId, "unregister") };
      },
    ),
    health: unary("Health", (): HealthResponse => ({
      status: "ok",
      version: PROTOCOL_VERSION,
      backend: engine.backend,
    })),
    session: (call: SessionCall) => {
      const bad = undecodableReason(call.request);
      if (bad !== undefined) return refuse(call, grpc.status.INVALID_ARGUMENT, `Session: ${bad}`);
      const { instanceId, tpRank, ppRank } = call.request;
      // endAll already ran: a session taken now would get no event until the sockets close.
      if (sessions.stopping) {
        return refuse(call, grpc.status.UNAVAILABLE, stopping("Session").message);
      }
      const refusal = sessionRefusal(engine, instanceId, tpRank, ppRank);
      if (refusal !== undefined) return refuse(call, grpc.status.INVALID_ARGUMENT, refusal);
      const rank = rankIndex(tpRank, ppRank, MAX_PARALLEL);
      const mismatch = sessions.check(instanceId, rank, call.request.registrationToken ?? "");
      if (mismatch !== undefined) {
        const who = `Session: instance "${instanceId}" tp_rank ${tpRank} pp_rank ${ppRank}`;
        return refuse(
          call,
          grpc.status.FAILED_PRECONDITION,
          capDetails(sessionMismatchText(who, mismatch)),
        );
      }
      const old = sessions.add(instanceId, rank, call);
      if (old) {
        log.info("session superseded", { instance: instanceId, tp_rank: tpRank, pp_rank: ppRank });
        old.write({
          kind: SessionEvent_Kind.SUPERSEDED,
          message: "a newer session for this rank took over",
        });
        old.end();
      }
      // The headers say "taken" at once (grpc-js sends them with the first event otherwise): a
      // client tells a session that stood for its registration from one that never got here.
      const taken = new grpc.Metadata();
      taken.set(SESSION_TAKEN_HEADER, "1");
      call.sendMetadata(taken);
      log.info("session opened", { instance: instanceId, tp_rank: tpRank, pp_rank: ppRank });
      let gone = false;
      const onGone = (why: string) => {
        if (gone || endedHere.has(call)) return;
        gone = true;
        metrics.streamEnded("Session", "CANCELLED");
        // Only the current session of a registered rank cleans up; a superseded one just goes
        // away, and a token-less one (a rank not registered) stood for none of the instance's ranks.
        const stood = sessions.remove(instanceId, rank, call);
        if (stood === undefined) return;
        if (stood === "unregistered") {
          log.info("session of an unregistered rank ended", {
            instance: instanceId,
            tp_rank: tpRank,
            pp_rank: ppRank,
            why,
          });
          return;
        }
        log.warn("session dropped; cleaning up the instance", {
          instance: instanceId,
          tp_rank: tpRank,
          pp_rank: ppRank,
          why,
        });
        cleanup(instanceId, "session_lost").catch((e) =>
          log.error("session cleanup failed", { instance: instanceId, error: String(e) })
        );
      };
      call.on("cancelled", () => onGone("cancelled"));
      call.on("error", (e) => onGone(`error: ${(e as Error).message}`));
    },
  };
}

export { EngineService };
