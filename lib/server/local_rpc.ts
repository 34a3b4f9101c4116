/**
 * Framed RPC listeners (wire format: lib/local_rpc/wire.ts): a service's
 * unary calls in length-prefixed frames, answered by the gRPC service's own
 * handlers. Two sockets speak it:
 *
 * - the engines' local RPC socket beside `--uds` ({@link serveLocalRpc}):
 *   QueryPrefetch, WaitPrefetch, Load, Release, Save, Health. An engine asks QueryPrefetch
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
 * cannot be resynced). One peer's calls are bounded: at most
 * MAX_UNREAD_ANSWERS running or unread, at most FRAMES_PER_TURN started
 * before the other connections get the event loop.
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
 * Calls of one connection that are running or whose answers wait to be written (queued
 * behind a write the peer does not take): at this many, the connection's frames are not
 * read or started until some answer is written, so a peer that keeps calling and never
 * reads stalls its own writes, and a peer whose calls never finish (a Save waiting for its
 * copy) cannot start more, instead of growing the server's memory without bound; a peer
 * that pipelines many calls in one write and reads its answers is served in full. An
 * engine has a few calls in flight.
 */
export const MAX_UNREAD_ANSWERS = 4096;

/**
 * Frames one connection starts in a row before the event loop serves the others: one
 * read can hold thousands of tiny frames (64 KiB of 9-byte calls; megabytes once a large
 * frame grew the buffer), and handling them in one go held up every other engine's calls.
 * The pause is a timer turn (~1-2 ms), not `setImmediate`: Deno polls sockets only
 * every ~60 of those. An engine's few calls in flight never reach it.
 */
export const FRAMES_PER_TURN = 256;

const utf8 = (s: string) => new TextEncoder().encode(s);
const nextTurn = () => new Promise<void>((r) => setTimeout(r, 0));

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
  /** Each open connection → what ends its serving (the listener's close() calls it). */
  conns: Map<Deno.Conn, () => void>;
  closed: boolean;
  /** Connections accepted so far: each one's number in logs. */
  accepted: number;
}

/** One connection's ids in logs: the listener, its number, the peer's address (TCP). */
interface ConnIds {
  path: string;
  conn: number;
  peer?: string;
}

/** The peer's host:port of a TCP connection (undefined on a Unix socket: no address). */
function peerOf(conn: Deno.Conn): string | undefined {
  const a = conn.remoteAddr;
  return a.transport === "tcp" ? `${a.hostname}:${a.port}` : undefined;
}

/**
 * A connection's answers, written in the order they are ready, one at a time, and the
 * count of answers it owes: `owe()` when a call starts, and each `send` pays one once
 * written (or dropped). `until(n)` is undefined while at most `n` are owed, else a promise
 * that settles once they are, or once `stop()` (the listener closed: nothing is owed).
 */
function answerWriter(conn: Deno.Conn): {
  owe(): void;
  send(bytes: Uint8Array): void;
  until(n: number): Promise<void> | undefined;
  stop(): void;
} {
  let writing: Promise<void> = Promise.resolve();
  let broken = false;
  let stopped = false;
  let owed = 0;
  let limit = 0;
  let wake: (() => void) | undefined;
  const settle = () => {
    const w = wake;
    wake = undefined;
    w?.();
  };
  const paid = () => {
    if (--owed <= limit && wake) settle();
  };
  const send = (bytes: Uint8Array) => {
    if (broken) return paid();
    writing = writing.then(() => broken ? undefined : writeAll(conn, bytes)).catch(() => {
      broken = true; // the peer went away; its later answers have nowhere to go
    }).finally(paid);
  };
  const until = (n: number) => {
    if (owed <= n || stopped) return undefined;
    limit = n;
    return new Promise<void>((r) => wake = r);
  };
  const stop = () => {
    stopped = broken = true;
    settle();
  };
  return { owe: () => void owed++, send, until, stop };
}

/**
 * Starts one call: its handler runs with a callback that queues its answer once. A
 * handler that throws, or an answer that cannot be encoded, answers INTERNAL naming the
 * method and call id (grpc-js does the same); a second answer is dropped.
 */
function callStarter(
  ctx: ConnContext,
  ids: ConnIds,
  out: { owe(): void; send(bytes: Uint8Array): void },
): (callId: number, method: number, payload: Uint8Array) => void {
  const { log, traced } = ctx;
  const { impl, methods, def, label } = ctx.service;
  const { owe, send } = out;
  const failed = (what: string, name: string, callId: number, e: unknown, answer = true) => {
    const error = (e as Error)?.message ?? String(e);
    log.error(`${label} ${what}`, { ...ids, method: name, call: callId, error });
    if (!answer) return;
    send(encodeFrame(
      callId,
      grpc.status.INTERNAL,
      utf8(`${label}: ${name} (call ${callId}): ${what}: ${error}`),
    ));
  };
  return (callId, method, payload) => {
    owe();
    const name = methods[method];
    const handler = impl[name] as grpc.handleUnaryCall<unknown, unknown> | undefined;
    if (name === undefined || handler === undefined) {
      send(encodeFrame(
        callId,
        grpc.status.UNIMPLEMENTED,
        utf8(`${label}: unknown method id ${method} (known: ${Object.keys(methods).join(", ")})`),
      ));
      return;
    }
    const md = def[name];
    // The frame's payload is already its own copy: decode it in place, as a plain
    // Uint8Array: a bytes field is then a typed-array view, about half the cost of a
    // Buffer's subarray (a QueryPrefetch of 639 hashes: 0.09 vs 0.17 ms).
    const request = md.requestDeserialize(payload as Buffer);
    const call = { request } as grpc.ServerUnaryCall<unknown, unknown>;
    // Wall-clock ms of arrival and answer, to line up with an engine's own clock (debug only).
    const tIn = traced ? performance.timeOrigin + performance.now() : 0;
    let answered = false;
    const answer = (err: Partial<grpc.StatusObject> | null, res?: unknown) => {
      if (answered) return;
      answered = true;
      if (traced) {
        log.debug(label.toLowerCase(), {
          ...ids,
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
      let body: Uint8Array;
      try {
        body = md.responseSerialize(res);
      } catch (e) {
        return failed("response cannot be encoded", name, callId, e);
      }
      send(encodeFrame(callId, 0, body));
    };
    try {
      handler(call, answer);
    } catch (e) {
      if (answered) return failed("handler threw after answering", name, callId, e, false);
      answered = true; // an answer it still sends later is dropped
      failed("handler threw", name, callId, e);
    }
  };
}

/** Reads one connection's frames and answers each call with the service's own handler. */
async function serveConnection(conn: Deno.Conn, ctx: ConnContext): Promise<void> {
  const { log } = ctx;
  const { label } = ctx.service;
  const ids: ConnIds = { path: ctx.path, conn: ++ctx.accepted, peer: peerOf(conn) };
  const out = answerWriter(conn);
  ctx.conns.set(conn, out.stop);
  const start = callStarter(ctx, ids, out);
  const frames = new FrameReader(ctx.maxMessageBytes);
  let turn = 0;
  try {
    while (!ctx.closed) {
      // Calls running or answers unread at the bound: start no more of this peer's calls.
      const full = out.until(MAX_UNREAD_ANSWERS - 1);
      if (full) await full;
      const f = frames.next();
      if (f === null) {
        turn = 0;
        const n = await conn.read(frames.space());
        if (n === null) break;
        frames.wrote(n);
        continue;
      }
      start(f.callId, f.tag, f.payload);
      if (++turn === FRAMES_PER_TURN) {
        turn = 0;
        await nextTurn(); // the other connections' calls, then the rest of this read
      }
    }
  } catch (e) {
    if (e instanceof FrameError) {
      log.warn(`${label} connection dropped: bad frame`, { ...ids, error: e.message });
      out.owe();
      out.send(encodeFrame(
        0,
        e.tooLong ? grpc.status.RESOURCE_EXHAUSTED : grpc.status.INVALID_ARGUMENT,
        utf8(e.message),
      ));
    } else if (!ctx.closed) {
      log.debug(`${label} connection ended`, { ...ids, error: String(e) });
    }
  } finally {
    // A peer that half-closed after its last call still reads: answer what is running,
    // then close. The connection stays in `conns` meanwhile, so the listener's close()
    // still ends it (and this wait).
    for (let w = out.until(0); w; w = out.until(0)) await w;
    ctx.conns.delete(conn);
    try {
      conn.close();
    } catch (_e) {
      // already closed by close()
    }
  }
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
    conns: new Map(),
    closed: false,
    accepted: 0,
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
      for (const [c, stop] of ctx.conns) {
        stop();
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
