/**
 * The local RPC socket: the engines' hot calls (QueryPrefetch, Load,
 * Release, Save, Health) over a Unix-domain socket in length-prefixed
 * frames (lib/local_rpc/wire.ts), beside gRPC, for engines on the same host.
 *
 * Why: an engine asks QueryPrefetch and sends Load while a request waits for
 * its first token, so their round trip is on the TTFT. Over gRPC (grpcio's
 * completion-queue thread, HTTP/2, the GOAWAY relay, grpc-js) one such call
 * took ~3.3 ms from the engine's side on a 0.02 ms server handler; a frame
 * on a Unix socket read by the caller's own thread has none of those hops.
 * The handlers are the gRPC service's own (`engineServiceImpl`): the same
 * decoding, checks, status codes, metrics and logs, so the two transports
 * cannot drift. Session (liveness) and RegisterContext stay on gRPC.
 *
 * Calls on one connection may be answered out of order (a Save is slower
 * than a Query); the client matches answers by call id. A frame longer than
 * `maxMessageBytes` + 5, or shorter than 5, is answered RESOURCE_EXHAUSTED /
 * INVALID_ARGUMENT with call id 0 and the connection is closed (the stream
 * cannot be resynced).
 *
 * @module
 */
import * as grpc from "@grpc/grpc-js";
import { EngineService } from "../../proto/pegaflow.ts";
import { decodeRequest } from "./decode.ts";
import type { Logger } from "../log.ts";
import {
  encodeFrame,
  FrameError,
  FrameReader,
  LOCAL_RPC_METHODS,
  writeAll,
} from "../local_rpc/wire.ts";

export { LOCAL_RPC_METHODS };

const round3 = (x: number) => Math.round(x * 1e3) / 1e3;
const utf8 = (s: string) => new TextEncoder().encode(s);

/** What every connection of one listener shares. */
interface ConnContext {
  impl: grpc.UntypedServiceImplementation;
  maxMessageBytes: number;
  log: Logger;
  path: string;
  traced: boolean;
  conns: Set<Deno.Conn>;
  closed: boolean;
}

/** Reads one connection's frames and answers each call with the service's own handler. */
async function serveConnection(conn: Deno.UnixConn, ctx: ConnContext): Promise<void> {
  const { impl, log, path, traced } = ctx;
  ctx.conns.add(conn);
  // Answers are written in the order they are ready, one at a time.
  let writing: Promise<void> = Promise.resolve();
  let broken = false;
  const send = (bytes: Uint8Array) => {
    writing = writing.then(() => broken ? undefined : writeAll(conn, bytes)).catch(() => {
      broken = true; // the peer went away; its later answers have nowhere to go
    });
  };
  const dispatch = (callId: number, method: number, payload: Uint8Array) => {
    const name = (LOCAL_RPC_METHODS as Record<number, keyof typeof EngineService>)[method];
    if (name === undefined) {
      send(encodeFrame(
        callId,
        grpc.status.UNIMPLEMENTED,
        utf8(
          `local RPC: unknown method id ${method} (known: ${
            Object.keys(LOCAL_RPC_METHODS).join(", ")
          })`,
        ),
      ));
      return;
    }
    const handler = impl[name] as grpc.handleUnaryCall<unknown, unknown>;
    // The frame's payload is already its own copy: decode it in place, as a plain
    // Uint8Array: a bytes field is then a typed-array view, about half the cost of a
    // Buffer's subarray (a QueryPrefetch of 639 hashes: 0.09 vs 0.17 ms).
    const request = decodeRequest(name, payload);
    const call = { request } as grpc.ServerUnaryCall<unknown, unknown>;
    // Wall-clock ms of arrival and answer, to line up with an engine's own clock (debug only).
    const tIn = traced ? performance.timeOrigin + performance.now() : 0;
    handler(call, (err, res) => {
      if (traced) {
        log.debug("local rpc", {
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
      const def = EngineService[name] as unknown as grpc.MethodDefinition<unknown, unknown>;
      send(encodeFrame(callId, 0, def.responseSerialize(res)));
    });
  };
  const frames = new FrameReader(ctx.maxMessageBytes);
  try {
    for (;;) {
      const n = await conn.read(frames.space());
      if (n === null) break;
      frames.wrote(n);
      for (let f = frames.next(); f; f = frames.next()) dispatch(f.callId, f.tag, f.payload);
    }
  } catch (e) {
    if (e instanceof FrameError) {
      log.warn("local RPC connection dropped: bad frame", { path, error: e.message });
      send(encodeFrame(
        0,
        e.tooLong ? grpc.status.RESOURCE_EXHAUSTED : grpc.status.INVALID_ARGUMENT,
        utf8(e.message),
      ));
    } else if (!ctx.closed) {
      log.debug("local RPC connection ended", { path, error: String(e) });
    }
  } finally {
    ctx.conns.delete(conn);
    await writing;
    try {
      conn.close();
    } catch (_e) {
      // already closed by close()
    }
  }
}

/** Running local RPC listener; `close` stops accepting and drops every connection. */
export interface LocalRpcServer {
  readonly path: string;
  close(): void;
}

/**
 * Serves `impl` (the gRPC service implementation) on `listener`.
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
  const ctx: ConnContext = {
    impl,
    maxMessageBytes,
    log,
    path: listener.addr.path ?? "",
    traced: log.enabled("debug"),
    conns: new Set(),
    closed: false,
  };

  (async () => {
    try {
      for await (const conn of listener) serveConnection(conn, ctx);
    } catch (e) {
      if (!ctx.closed) log.error("local RPC listener failed", { path: ctx.path, error: String(e) });
    }
  })();

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
