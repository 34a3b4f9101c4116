/**
 * Framed RPC listeners (wire format: lib/local_rpc/wire.ts): a service's
 * unary calls in length-prefixed frames, answered by the gRPC service's own
 * handlers. Two sockets speak it:
 *
 * - the engines' local RPC socket beside `--uds` ({@link serveLocalRpc}):
 *   QueryPrefetch, Load, Release, Save, Health. An engine asks QueryPrefetch
 *   and sends Load while a request waits for its first token, so their round
 *   trip is on the TTFT. Over gRPC (grpcio's completion-queue thread, HTTP/2,
 *   the GOAWAY relay, grpc-js) one such call took ~3.3 ms from the engine's
 *   side on a 0.02 ms server handler; a frame on a Unix socket read by the
 *   caller's own thread has none of those hops. Session (liveness) and
 *   RegisterContext stay on gRPC.
 * - the peers' RPC socket over TCP ({@link servePeerRpc}, docs/peer.md):
 *   QueryBlocksForTransfer and ReleaseTransferLock, the lock on the owner
 *   that every peer fetch waits for before its first byte (over grpc-js
 *   both ways it cost ~3 ms of transit on a ~2 ms handler).
 *
 * The handlers are the gRPC services' own (`engineServiceImpl`,
 * `peerServiceImpl`) behind the same lenient decoding: the same checks,
 * status codes, metrics and logs, so the transports cannot drift.
 *
 * Calls on one connection may be answered out of order (a Save is slower
 * than a Query); the client matches answers by call id. A frame longer than
 * `maxMessageBytes` + 5, or shorter than 5, is answered RESOURCE_EXHAUSTED /
 * INVALID_ARGUMENT with call id 0 and the connection is closed (the stream
 * cannot be resynced).
 *
 * @module
 */
import type { Buffer } from "node:buffer";
import * as grpc from "@grpc/grpc-js";
import { lenientPeerService, lenientService } from "./decode.ts";
import type { Logger } from "../log.ts";
import { ACCEPT_RETRY_MS, acceptEach } from "./accept.ts";
import {
  encodeFrame,
  FrameError,
  FrameReader,
  LOCAL_RPC_METHODS,
  PEER_RPC_METHODS,
  writeAll,
} from "../local_rpc/wire.ts";

export { LOCAL_RPC_METHODS };

const round3 = (x: number) => Math.round(x * 1e3) / 1e3;

/**
 * Answers a connection may have waiting to be written (queued behind a write the peer
 * does not take): past it, the connection's frames are not read until its answers drain,
 * so a peer that keeps calling and never reads stalls its own writes instead of growing
 * the server's memory without bound, while a peer that pipelines many calls in one write
 * and reads its answers is served in full. An engine has a few calls in flight.
 */
export const MAX_UNREAD_ANSWERS = 4096;
const utf8 = (s: string) => new TextEncoder().encode(s);

/** A service as a framed listener serves it. */
interface FramedService {
  /** The lenient service definition (lib/server/decode.ts): decoding and encoding. */
  def: grpc.ServiceDefinition;
  /** Method ids on the wire → method names of `def`. */
  methods: Readonly<Record<number, string>>;
  impl: grpc.UntypedServiceImplementation;
  /** For logs and errors: "local RPC" | "peer RPC". */
  label: string;
}

/** What every connection of one listener shares. */
interface ConnContext {
  service: FramedService;
  maxMessageBytes: number;
  log: Logger;
  /** The listener's address (a socket path or host:port), for logs. */
  path: string;
  traced: boolean;
  conns: Set<Deno.Conn>;
  closed: boolean;
}

/**
 * A connection's answers, written in the order they are ready, one at a time.
 * `room` is undefined while at most MAX_UNREAD_ANSWERS wait, else a promise that
 * settles once they are back under it (the reader waits for it before reading on).
 * `drained` settles once the writes queued so far ended.
 */
function answerWriter(conn: Deno.Conn): {
  send(bytes: Uint8Array): void;
  room(): Promise<void> | undefined;
  drained(): Promise<void>;
} {
  let writing: Promise<void> = Promise.resolve();
  let broken = false;
  let queued = 0;
  let wake: (() => void) | undefined;
  const send = (bytes: Uint8Array) => {
    if (broken) return;
    queued++;
    writing = writing.then(() => broken ? undefined : writeAll(conn, bytes)).catch(() => {
      broken = true; // the peer went away; its later answers have nowhere to go
    }).finally(() => {
      if (--queued <= MAX_UNREAD_ANSWERS && wake) {
        wake();
        wake = undefined;
      }
    });
  };
  const room = () => queued <= MAX_UNREAD_ANSWERS ? undefined : new Promise<void>((r) => wake = r);
  return { send, room, drained: () => writing };
}

/** Reads one connection's frames and answers each call with the service's own handler. */
async function serveConnection(conn: Deno.Conn, ctx: ConnContext): Promise<void> {
  const { service, log, path, traced } = ctx;
  const { impl, methods, def, label } = service;
  ctx.conns.add(conn);
  const { send, room, drained } = answerWriter(conn);
  const calls = callsRunning();
  const dispatch = (callId: number, method: number, payload: Uint8Array) => {
    const name = methods[method];
    if (name === undefined) {
      send(encodeFrame(
        callId,
        grpc.status.UNIMPLEMENTED,
        utf8(`${label}: unknown method id ${method} (known: ${Object.keys(methods).join(", ")})`),
      ));
      return;
    }
    const handler = impl[name] as grpc.handleUnaryCall<unknown, unknown>;
    const md = def[name];
    // The frame's payload is already its own copy: decode it in place, as a plain
    // Uint8Array: a bytes field is then a typed-array view, about half the cost of a
    // Buffer's subarray (a QueryPrefetch of 639 hashes: 0.09 vs 0.17 ms).
    const request = md.requestDeserialize(payload as Buffer);
    const call = { request } as grpc.ServerUnaryCall<unknown, unknown>;
    // Wall-clock ms of arrival and answer, to line up with an engine's own clock (debug only).
    const tIn = traced ? performance.timeOrigin + performance.now() : 0;
    const done = calls.started();
    handler(call, (err, res) => {
      done();
      if (traced) {
        log.debug(label.toLowerCase(), {
          method: name,
          call: callId,
          in_epoch_ms: round3(tIn),
          out_epoch_ms: round3(performance.timeOrigin + performance.now()),
        });
      }
      if (err) {
        send(encodeFrame(callId, err.code ?? grpc.status.INTERNAL, utf8(err.details ?? "")));
        return;
      }
      send(encodeFrame(callId, 0, md.responseSerialize(res)));
    });
  };
  const frames = new FrameReader(ctx.maxMessageBytes);
  try {
    for (;;) {
      // Answers pile up unread: read no more of this peer's calls until they drain.
      const full = room();
      if (full) await full;
      const n = await conn.read(frames.space());
      if (n === null) break;
      frames.wrote(n);
      for (let f = frames.next(); f; f = frames.next()) dispatch(f.callId, f.tag, f.payload);
    }
  } catch (e) {
    if (e instanceof FrameError) {
      log.warn(`${label} connection dropped: bad frame`, { path, error: e.message });
      send(encodeFrame(
        0,
        e.tooLong ? grpc.status.RESOURCE_EXHAUSTED : grpc.status.INVALID_ARGUMENT,
        utf8(e.message),
      ));
    } else if (!ctx.closed) {
      log.debug(`${label} connection ended`, { path, error: String(e) });
    }
  } finally {
    // A peer that half-closed after its last call still reads: answer what is running.
    // The connection stays in `conns` meanwhile, so the listener's close() still ends it.
    await calls.idle(() => ctx.closed);
    await drained();
    ctx.conns.delete(conn);
    try {
      conn.close();
    } catch (_e) {
      // already closed by close()
    }
  }
}

/**
 * Calls of one connection whose handler has not answered yet. `idle` settles once none
 * runs (each answer is queued by then), or, when `closing()` says the listener closed
 * (the answers have nowhere to go), at once or at the next answer.
 */
function callsRunning(): { started(): () => void; idle(closing: () => boolean): Promise<void> } {
  let running = 0;
  let wake: (() => void) | undefined;
  return {
    started() {
      running++;
      return () => {
        if (--running === 0) wake?.();
      };
    },
    async idle(closing) {
      while (running > 0 && !closing()) await new Promise<void>((r) => wake = r);
    },
  };
}

/** Running framed RPC listener; `close` stops accepting and drops every connection. */
export interface LocalRpcServer {
  /** The socket path, or host:port of a TCP listener. */
  readonly path: string;
  close(): void;
}

/**
 * The engines' local RPC socket: serves `impl` (the Engine service's gRPC
 * implementation) on `listener`.
 *
 * @example
 * ```ts
 * const l = Deno.listen({ transport: "unix", path: "/run/pegaflow/grpc.sock.rpc" });
 * const rpc = serveLocalRpc(l, engineServiceImpl(engine, sessions, metrics, log), 64 << 20, log);
 * // ... at shutdown
 * rpc.close();
 * ```
 */
export function serveLocalRpc(
  listener: Deno.Listener<Deno.UnixConn, Deno.UnixAddr>,
  impl: grpc.UntypedServiceImplementation,
  maxMessageBytes: number,
  log: Logger,
): LocalRpcServer {
  const service = { def: lenientService(), methods: LOCAL_RPC_METHODS, impl, label: "local RPC" };
  return serveFramed(listener, listener.addr.path ?? "", service, maxMessageBytes, log);
}

/**
 * The peers' RPC socket: serves the Peer service's lock and release
 * (`impl`: `peerServiceImpl`) on a TCP `listener`.
 *
 * @example
 * ```ts
 * const rpc = servePeerRpc(Deno.listen({ port: 0 }), peerServiceImpl(locks, ep, lender, log), 64 << 20, log);
 * ```
 */
export function servePeerRpc(
  listener: Deno.TcpListener,
  impl: grpc.UntypedServiceImplementation,
  maxMessageBytes: number,
  log: Logger,
): LocalRpcServer {
  const service = { def: lenientPeerService(), methods: PEER_RPC_METHODS, impl, label: "peer RPC" };
  const { hostname, port } = listener.addr;
  return serveFramed(listener, `${hostname}:${port}`, service, maxMessageBytes, log);
}

function serveFramed(
  listener: Deno.Listener,
  path: string,
  service: FramedService,
  maxMessageBytes: number,
  log: Logger,
): LocalRpcServer {
  const ctx: ConnContext = {
    service,
    maxMessageBytes,
    log,
    path,
    traced: log.enabled("debug"),
    conns: new Set(),
    closed: false,
  };

  acceptEach(listener, () => ctx.closed, {
    serve(conn) {
      if (conn.remoteAddr.transport === "tcp") (conn as Deno.TcpConn).setNoDelay(true);
      serveConnection(conn, ctx);
    },
    retrying(e) {
      log.warn(`${service.label} accept failed; accepting again in ${ACCEPT_RETRY_MS} ms`, {
        path: ctx.path,
        error: String(e),
      });
    },
    gone(e) {
      log.error(`${service.label} listener failed`, { path: ctx.path, error: String(e) });
    },
  });

  return {
    path: ctx.path,
    close() {
      ctx.closed = true;
      try {
        listener.close();
      } catch (_e) {
        // already closed
      }
      for (const c of ctx.conns) {
        try {
          c.close();
        } catch (_e) {
          // already closed
        }
      }
      ctx.conns.clear();
    },
  };
}
