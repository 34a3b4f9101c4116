/**
 * The TypeScript client of the framed RPC (wire format in
 * lib/local_rpc/wire.ts): the server's local RPC socket (`PATH.rpc` beside
 * `--uds PATH`), or a peer's RPC socket over TCP (lib/peer/link.ts). One
 * connection, calls matched to answers by call id, a deadline on every
 * call. A connection that breaks fails the calls in flight (UNAVAILABLE) and
 * the next call dials again, so a restarted server is found without help.
 *
 * @module
 */
import * as grpc from "@grpc/grpc-js";
import { encodeFrame, FrameReader, LOCAL_RPC_IDS, writeAll } from "../local_rpc/wire.ts";
import { timerDelay } from "../timer_limit.ts";

const { UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, UNIMPLEMENTED, RESOURCE_EXHAUSTED } =
  grpc.status;

/** A call that did not answer OK: the gRPC status code and the server's message. */
export class LocalRpcStatus extends Error {
  constructor(readonly code: number, readonly details: string) {
    super(details);
    this.name = "LocalRpcStatus";
  }
}

/** No socket at the path (a server without `--uds`, or restarting): nothing was sent. */
export class LocalRpcAbsent extends Error {
  constructor(readonly path: string) {
    super(`no local RPC socket at ${path}`);
    this.name = "LocalRpcAbsent";
  }
}

/** After finding no socket, calls go over gRPC this long before it is dialled again. */
export const ABSENT_RETRY_MS = 1_000;

interface Pending {
  resolve: (b: Uint8Array) => void;
  reject: (e: LocalRpcStatus) => void;
  timer: ReturnType<typeof setTimeout>;
}

/** Where a framed RPC client dials: a Unix socket path, or a TCP host and port. */
export type RpcTarget =
  | { transport: "unix"; path: string }
  | { transport: "tcp"; hostname: string; port: number };

/**
 * @example
 * ```ts
 * const rpc = new LocalRpcClient("/run/pegaflow/grpc.sock.rpc", 64 << 20);
 * const body = await rpc.call("health", new Uint8Array(0), 5_000);
 * rpc.close();
 * const peer = new LocalRpcClient({ transport: "tcp", hostname: "10.0.0.7", port: 50057 }, 64 << 20, ids);
 * ```
 */
export class LocalRpcClient {
  #conn: Promise<Deno.Conn> | undefined;
  /** The dialled connection until it ends: a call then needs no dial, timer or race. */
  #open: Deno.Conn | undefined;
  #pending = new Map<number, Pending>();
  #nextId = 0;
  #writing: Promise<void> = Promise.resolve();
  #closed = false;
  readonly #target: RpcTarget;
  readonly #ids: Readonly<Record<string, number>>;
  /** The socket path, or host:port (messages). */
  readonly path: string;

  /**
   * `target`: a Unix socket path (the local RPC socket) or a TCP target;
   * `ids`: method ids by name (default: the local RPC socket's).
   */
  constructor(
    target: string | RpcTarget,
    readonly maxMessageBytes: number,
    ids: Readonly<Record<string, number>> = LOCAL_RPC_IDS,
  ) {
    this.#target = typeof target === "string" ? { transport: "unix", path: target } : target;
    this.path = this.#target.transport === "unix"
      ? this.#target.path
      : `${this.#target.hostname}:${this.#target.port}`;
    this.#ids = ids;
  }

  /** False for {@link ABSENT_RETRY_MS} after a dial found no socket at the path. */
  get usable(): boolean {
    return performance.now() >= this.#absentUntil;
  }
  #absentUntil = 0;

  #dial(): Promise<Deno.Conn> {
    if (!this.#conn) {
      const t = this.#target;
      const conn: Promise<Deno.Conn> = t.transport === "unix"
        ? Deno.connect(t)
        : Deno.connect(t).then((c) => (c.setNoDelay(true), c));
      this.#conn = conn;
      conn.then((c) => {
        if (this.#conn === conn) this.#open = c;
        return this.#readLoop(c);
      }, () => {
        if (this.#conn === conn) this.#conn = undefined;
      });
    }
    return this.#conn;
  }

  /** The connection, or DEADLINE_EXCEEDED after `ms` (the dial goes on; a later call may use it). */
  #dialWithin(ms: number): Promise<Deno.Conn> {
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<never>((_, reject) => {
      timer = setTimeout(
        () =>
          reject(
            new LocalRpcStatus(DEADLINE_EXCEEDED, `no connection to ${this.path} within ${ms} ms`),
          ),
        timerDelay(ms),
      );
    });
    return Promise.race([this.#dial(), late]).finally(() => clearTimeout(timer));
  }

  async #readLoop(conn: Deno.Conn): Promise<void> {
    const frames = new FrameReader(this.maxMessageBytes);
    let why = "the server closed the connection";
    try {
      for (;;) {
        const n = await conn.read(frames.space());
        if (n === null) break;
        frames.wrote(n);
        for (let f = frames.next(); f; f = frames.next()) {
          if (f.callId === 0) {
            why = new TextDecoder().decode(f.payload); // the server refused our framing
            continue;
          }
          const p = this.#pending.get(f.callId);
          if (!p) continue; // its deadline passed
          this.#pending.delete(f.callId);
          clearTimeout(p.timer);
          if (f.tag === 0) p.resolve(f.payload);
          else p.reject(new LocalRpcStatus(f.tag, new TextDecoder().decode(f.payload)));
        }
      }
    } catch (e) {
      why = (e as Error).message;
    }
    if (this.#open === conn) this.#open = undefined;
    try {
      conn.close();
    } catch {
      // closed by close()
    }
    if (this.#conn && (await this.#conn.catch(() => undefined)) === conn) this.#conn = undefined;
    this.#failAll(UNAVAILABLE, `RPC connection to ${this.path} ended: ${why}`);
  }

  #failAll(code: number, msg: string): void {
    const all = [...this.#pending.values()];
    this.#pending.clear();
    for (const p of all) {
      clearTimeout(p.timer);
      p.reject(new LocalRpcStatus(code, msg));
    }
  }

  /** One call of `method` (a service method name); resolves with the response bytes. */
  async call(method: string, payload: Uint8Array, deadlineMs: number): Promise<Uint8Array> {
    if (this.#closed) throw new LocalRpcStatus(CANCELLED, "client is closed");
    const id = this.#ids[method];
    if (id === undefined) {
      throw new LocalRpcStatus(UNIMPLEMENTED, `RPC socket ${this.path} has no method ${method}`);
    }
    if (payload.length > this.maxMessageBytes) {
      // As gRPC's max_send_message_length: refused here. Sent, it would make a server
      // with this limit drop the connection and every other call in flight on it.
      throw new LocalRpcStatus(
        RESOURCE_EXHAUSTED,
        `${method} request of ${payload.length} bytes exceeds the ${this.maxMessageBytes}-byte message limit`,
      );
    }
    const deadline = performance.now() + deadlineMs;
    let conn: Deno.Conn;
    try {
      // A TCP connect to a host that drops SYNs waits for minutes: the deadline covers it.
      conn = this.#open ?? await this.#dialWithin(deadlineMs);
    } catch (e) {
      if (e instanceof LocalRpcStatus) throw e;
      if (e instanceof Deno.errors.NotFound && this.#target.transport === "unix") {
        // A server without the socket (or restarting): the caller uses gRPC for a while.
        this.#absentUntil = performance.now() + ABSENT_RETRY_MS;
        throw new LocalRpcAbsent(this.path);
      }
      throw new LocalRpcStatus(
        UNAVAILABLE,
        `RPC socket ${this.path}: ${(e as Error).message}`,
      );
    }
    // close() ran while we dialled: it already failed every pending call and
    // closes this connection; the call is cancelled like them, not "broken".
    if (this.#closed) throw new LocalRpcStatus(CANCELLED, "client is closed");
    this.#nextId = (this.#nextId % 0xffff_fffe) + 1;
    const callId = this.#nextId;
    const answer = new Promise<Uint8Array>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.#pending.delete(callId);
        reject(new LocalRpcStatus(DEADLINE_EXCEEDED, `no answer within ${deadlineMs} ms`));
      }, timerDelay(deadline - performance.now()));
      this.#pending.set(callId, { resolve, reject, timer });
    });
    const frame = encodeFrame(callId, id, payload);
    // Queued behind a write the server does not take, a call may reach its deadline
    // before its turn: it was failed with DEADLINE_EXCEEDED, so it must not run later.
    const write = () => this.#pending.has(callId) ? writeAll(conn, frame) : undefined;
    this.#writing = this.#writing.then(write).catch(() => {
      const p = this.#pending.get(callId);
      if (!p) return;
      this.#pending.delete(callId);
      clearTimeout(p.timer);
      p.reject(new LocalRpcStatus(UNAVAILABLE, `RPC connection to ${this.path} broke`));
    });
    return await answer;
  }

  close(): void {
    this.#closed = true;
    this.#failAll(CANCELLED, "client is closed");
    this.#conn?.then((c) => {
      try {
        c.close();
      } catch {
        // already closed
      }
    }, () => {});
    this.#conn = undefined;
    this.#open = undefined;
  }
}
