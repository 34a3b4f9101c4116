/**
 * The framed RPC's wire format, spoken on two sockets: the engines' local
 * RPC socket beside `--uds` (the Engine service's hot calls) and the peers'
 * RPC socket over TCP (the Peer service's lock and release, docs/peer.md).
 * The server side is lib/server/local_rpc.ts, the TypeScript client
 * lib/client/local_rpc.ts; python/pegaflow/local_rpc.py is the Python
 * client's copy of these facts (the engine methods):
 *
 *   request:  u32 len | u32 call_id | u8 method | protobuf request
 *   response: u32 len | u32 call_id | u8 status | protobuf response (status 0)
 *                                                | UTF-8 details (a gRPC code)
 *
 * little-endian; `len` counts the bytes after itself (5 + payload).
 *
 * @module
 */
import type { EngineService, PeerService } from "../../proto/pegaflow.ts";

/**
 * Suffix of the local RPC socket beside `--uds PATH`: `PATH.rpc` (the server
 * claims it, lib/server/uds.ts; clients derive it from a `unix:PATH` address).
 */
export const LOCAL_RPC_SUFFIX = ".rpc";

/** u32 len + u32 call id + u8 method / status. */
export const HEADER_BYTES = 9;

/** Method ids on the wire. */
export const LOCAL_RPC_METHODS = {
  1: "queryPrefetch",
  2: "load",
  3: "release",
  4: "save",
  5: "health",
  6: "waitPrefetch",
} as const satisfies Record<number, keyof typeof EngineService>;

/**
 * Method ids on the peers' RPC socket. ConnectTransfer stays on gRPC: it is
 * called once per owner, and its answer names this socket.
 */
export const PEER_RPC_METHODS = {
  1: "queryBlocksForTransfer",
  2: "releaseTransferLock",
} as const satisfies Record<number, keyof typeof PeerService>;

/** Method ids by method name, for a client of a socket that serves `methods`. */
export function methodIds(methods: Readonly<Record<number, string>>): Record<string, number> {
  return Object.fromEntries(Object.entries(methods).map(([id, name]) => [name, Number(id)]));
}

/** A method's id on the local RPC socket, by the Engine service's method name. */
export const LOCAL_RPC_IDS: Readonly<Record<string, number>> = methodIds(LOCAL_RPC_METHODS);

/** One frame's bytes: header, then payload. */
export function encodeFrame(
  callId: number,
  methodOrStatus: number,
  payload: Uint8Array,
): Uint8Array {
  const out = new Uint8Array(HEADER_BYTES + payload.length);
  const dv = new DataView(out.buffer);
  dv.setUint32(0, 5 + payload.length, true);
  dv.setUint32(4, callId, true);
  out[8] = methodOrStatus;
  out.set(payload, HEADER_BYTES);
  return out;
}

/** A decoded frame: the call id, the method (request) or status (response), the payload. */
export interface Frame {
  callId: number;
  tag: number;
  payload: Uint8Array;
}

/** Why the byte stream cannot go on (the connection must be closed). */
export class FrameError extends Error {
  constructor(readonly tooLong: boolean, message: string) {
    super(message);
    this.name = "FrameError";
  }
}

/** A reader's buffer to start with, and the most it keeps once every frame in it was taken. */
const INITIAL_BUFFER_BYTES = 64 * 1024;
const KEEP_BUFFER_BYTES = 1024 * 1024;

/**
 * Cuts a byte stream into frames: `push` what arrived, then take frames with
 * `next` until it answers null. Payloads are copies (the buffer is reused).
 *
 * @example
 * ```ts
 * const r = new FrameReader(64 << 20);
 * r.push(bytes);
 * for (let f = r.next(); f; f = r.next()) handle(f);
 * ```
 */
export class FrameReader {
  #buf = new Uint8Array(INITIAL_BUFFER_BYTES);
  #start = 0;
  #end = 0;

  constructor(readonly maxPayloadBytes: number) {}

  /** Room for at least `n` more bytes at the end; returns the writable view. */
  space(n = INITIAL_BUFFER_BYTES): Uint8Array {
    if (this.#buf.length - this.#end < n) {
      const live = this.#end - this.#start;
      const grown = live + n > this.#buf.length
        ? new Uint8Array(Math.max(this.#buf.length * 2, live + n))
        : this.#buf;
      grown.set(this.#buf.subarray(this.#start, this.#end), 0);
      this.#buf = grown;
      this.#start = 0;
      this.#end = live;
    }
    return this.#buf.subarray(this.#end);
  }

  /** Bytes the reader holds for its buffer (what a connection keeps between frames). */
  get bufferBytes(): number {
    return this.#buf.length;
  }

  /** `n` bytes were written into the last `space()` view. */
  wrote(n: number): void {
    this.#end += n;
  }

  /** Appends a chunk (copying it). */
  push(chunk: Uint8Array): void {
    this.space(chunk.length).set(chunk);
    this.#end += chunk.length;
  }

  /** The next whole frame, or null; throws {@link FrameError} for a length out of range. */
  next(): Frame | null {
    const have = this.#end - this.#start;
    if (have < 4) return null;
    const dv = new DataView(this.#buf.buffer, this.#buf.byteOffset + this.#start);
    const len = dv.getUint32(0, true);
    if (len < 5) {
      throw new FrameError(false, `RPC frame length ${len} is below the 5-byte header`);
    }
    if (len > this.maxPayloadBytes + 5) {
      throw new FrameError(
        true,
        `RPC frame of ${len} bytes exceeds the ${this.maxPayloadBytes}-byte message limit (--max-message-size)`,
      );
    }
    if (have < 4 + len) return null;
    const f = {
      callId: dv.getUint32(4, true),
      tag: this.#buf[this.#start + 8],
      payload: this.#buf.slice(this.#start + HEADER_BYTES, this.#start + 4 + len),
    };
    this.#start += 4 + len;
    if (this.#start === this.#end) {
      this.#start = this.#end = 0;
      // One huge frame must not keep its buffer for the connection's life.
      if (this.#buf.length > KEEP_BUFFER_BYTES) this.#buf = new Uint8Array(INITIAL_BUFFER_BYTES);
    }
    return f;
  }
}

/** Writes all of `bytes` to `conn`. */
export async function writeAll(conn: Deno.Conn, bytes: Uint8Array): Promise<void> {
  let off = 0;
  while (off < bytes.length) off += await conn.write(bytes.subarray(off));
}
