/**
 * The local RPC socket: the engines' hot calls (QueryPrefetch, Load,
 * Release, Save, Health) over a Unix-domain socket in length-prefixed
 * frames, beside gRPC, for engines on the same host.
 *
 * Why: an engine asks QueryPrefetch and sends Load while a request waits for
 * its first token, so their round trip is on the TTFT. Over gRPC (grpcio's
 * completion-queue thread, HTTP/2, the GOAWAY relay, grpc-js) one such call
 * took 1–3.5 ms from the engine's side on a 0.35 ms server handler; a frame
 * on a Unix socket read by the caller's own thread has none of those hops.
 * The handlers are the gRPC service's own (`engineServiceImpl`): the same
 * decoding, checks, status codes, metrics and logs, so the two transports
 * cannot drift. Session (liveness) and RegisterContext stay on gRPC.
 *
 * Wire format (little-endian), one owner on each side: this file and
 * `python/pegaflow/local_rpc.py`.
 *   request:  u32 len | u32 call_id | u8 method | protobuf request
 *   response: u32 len | u32 call_id | u8 status | protobuf response (status 0)
 *                                                | UTF-8 details (a gRPC code)
 * `len` counts the bytes after itself (5 + payload). Calls on one connection
 * may be answered out of order (a Save is slower than a Query); the client
 * matches answers by call_id. A frame longer than `maxMessageBytes` + 5, or
 * shorter than 5, is answered RESOURCE_EXHAUSTED / INVALID_ARGUMENT with
 * call id 0 and the connection is closed (the stream cannot be resynced).
 *
 * @module
 */
import type * as grpc from "@grpc/grpc-js";
import { Buffer } from "node:buffer";
import { EngineService } from "../../proto/pegaflow.ts";
import { decodeRequest } from "./decode.ts";
import type { Logger } from "../log.ts";

/** Method ids on the wire (a fact shared with python/pegaflow/local_rpc.py). */
export const LOCAL_RPC_METHODS = {
  1: "queryPrefetch",
  2: "load",
  3: "release",
  4: "save",
  5: "health",
} as const satisfies Record<number, keyof typeof EngineService>;

const HEADER_BYTES = 9; // u32 len + u32 call id + u8 method/status
const READ_CHUNK = 64 * 1024;
const STATUS_INVALID_ARGUMENT = 3;
const STATUS_RESOURCE_EXHAUSTED = 8;
const STATUS_UNIMPLEMENTED = 12;
const STATUS_INTERNAL = 13;

/** One frame's bytes: header then payload. */
function frame(callId: number, status: number, payload: Uint8Array): Uint8Array {
  const out = new Uint8Array(HEADER_BYTES + payload.length);
  const dv = new DataView(out.buffer);
  dv.setUint32(0, 5 + payload.length, true);
  dv.setUint32(4, callId, true);
  out[8] = status;
  out.set(payload, HEADER_BYTES);
  return out;
}

const round3 = (x: number) => Math.round(x * 1e3) / 1e3;

async function writeAll(conn: Deno.Conn, bytes: Uint8Array): Promise<void> {
  let off = 0;
  while (off < bytes.length) off += await conn.write(bytes.subarray(off));
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
  const conns = new Set<Deno.Conn>();
  let closed = false;
  const traced = log.enabled("debug");
  const path = listener.addr.path ?? "";

  const serveConn = async (conn: Deno.UnixConn) => {
    conns.add(conn);
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
        send(frame(
          callId,
          STATUS_UNIMPLEMENTED,
          new TextEncoder().encode(
            `local RPC: unknown method id ${method} (known: ${
              Object.keys(LOCAL_RPC_METHODS).join(", ")
            })`,
          ),
        ));
        return;
      }
      const handler = impl[name] as grpc.handleUnaryCall<unknown, unknown>;
      const call = { request: decodeRequest(name, payload) } as grpc.ServerUnaryCall<
        unknown,
        unknown
      >;
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
          const details = new TextEncoder().encode(err.details ?? "");
          send(frame(callId, err.code ?? STATUS_INTERNAL, details));
          return;
        }
        const def = EngineService[name] as unknown as grpc.MethodDefinition<unknown, unknown>;
        send(frame(callId, 0, def.responseSerialize(res)));
      });
    };
    let buf = new Uint8Array(READ_CHUNK);
    let have = 0;
    try {
      for (;;) {
        if (buf.length - have < READ_CHUNK) {
          const grown = new Uint8Array(Math.max(buf.length * 2, have + READ_CHUNK));
          grown.set(buf.subarray(0, have));
          buf = grown;
        }
        const n = await conn.read(buf.subarray(have));
        if (n === null) break;
        have += n;
        let off = 0;
        while (have - off >= 4) {
          const dv = new DataView(buf.buffer, buf.byteOffset + off);
          const len = dv.getUint32(0, true);
          if (len < 5 || len > maxMessageBytes + 5) {
            const why = len < 5
              ? `local RPC: frame length ${len} is below the 5-byte header`
              : `local RPC: frame of ${len} bytes exceeds the ${maxMessageBytes}-byte message limit (--max-message-size)`;
            log.warn("local RPC connection dropped: bad frame", { path, error: why });
            send(frame(
              0,
              len < 5 ? STATUS_INVALID_ARGUMENT : STATUS_RESOURCE_EXHAUSTED,
              new TextEncoder().encode(why),
            ));
            await writing;
            return;
          }
          if (have - off < 4 + len) break;
          const callId = dv.getUint32(4, true);
          const method = buf[off + 8];
          // The handler keeps the decoded message, never these bytes: copy only what it decodes.
          dispatch(callId, method, Buffer.from(buf.subarray(off + HEADER_BYTES, off + 4 + len)));
          off += 4 + len;
        }
        if (off > 0) {
          buf.copyWithin(0, off, have);
          have -= off;
        }
      }
    } catch (e) {
      if (!closed) log.debug("local RPC connection ended", { path, error: String(e) });
    } finally {
      conns.delete(conn);
      await writing;
      try {
        conn.close();
      } catch (_e) {
        // already closed by close()
      }
    }
  };

  (async () => {
    try {
      for await (const conn of listener) serveConn(conn);
    } catch (e) {
      if (!closed) log.error("local RPC listener failed", { path, error: String(e) });
    }
  })();

  return {
    path,
    close() {
      closed = true;
      try {
        listener.close();
      } catch (_e) {
        // already closed
      }
      for (const c of conns) {
        try {
          c.close();
        } catch (_e) {
          // already closed
        }
      }
      conns.clear();
    },
  };
}
