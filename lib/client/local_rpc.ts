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
import { encodeFrame, FrameReader, LOCAL_RPC_IDS } from "../local_rpc/wire.ts";
import { timerDelay, withinOrThrow } from "../timer_limit.ts";

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
  reject: (e: Error) => void;
  timer: ReturnType<typeof setTimeout>;
  /** The connection its frame is written on; undefined while queued behind other writes. */
  conn?: Deno.Conn;
  /** Some of its frame reached that connection: the server may run it, so it is never resent. */
  sent: boolean;
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
  /** Connections that ended (or broke on a write): no frame is written on them any more. */
  readonly #dead = new WeakSet<Deno.Conn>();
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
    const late = () =>
      new LocalRpcStatus(DEADLINE_EXCEEDED, `no connection to ${this.path} within ${ms} ms`);
    return withinOrThrow(this.#dial(), ms, late);
  }

  /** No call writes on `conn` any more; the next call dials again (no gap where it is reused). */
  #retire(conn: Deno.Conn): void {
    this.#dead.add(conn);
    if (this.#open === conn) {
      // #open is set only from the dial that #conn holds: the two are reset together.
      this.#open = undefined;
      this.#conn = undefined;
    }
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
    this.#retire(conn);
    try {
      conn.close();
    } catch {
      // closed by close()
    }
    // Only calls written here are lost with it: one still queued, or whose write
    // has not put a byte out yet, goes to the next connection (see #send).
    const msg = `RPC connection to ${this.path} ended: ${why}`;
    for (const [id, p] of this.#pending) {
      if (p.conn !== conn || !p.sent) continue;
      this.#pending.delete(id);
      clearTimeout(p.timer);
      p.reject(new LocalRpcStatus(UNAVAILABLE, msg));
    }
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
    const conn = await this.#connect(deadlineMs);
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
      this.#pending.set(callId, { resolve, reject, timer, sent: false });
    });
    const frame = encodeFrame(callId, id, payload);
    this.#writing = this.#writing.then(() => this.#send(callId, frame, conn, deadline));
    return await answer;
  }

  /** The open connection, or a dial within `ms`; dial failures as LocalRpcStatus / LocalRpcAbsent. */
  async #connect(ms: number): Promise<Deno.Conn> {
    try {
      // A TCP connect to a host that drops SYNs waits for minutes: the deadline covers it.
      return this.#open ?? await this.#dialWithin(ms);
    } catch (e) {
      if (e instanceof LocalRpcStatus) throw e;
      if (e instanceof Deno.errors.NotFound && this.#target.transport === "unix") {
        // A server without the socket (or restarting): the caller uses gRPC for a while.
        this.#absentUntil = performance.now() + ABSENT_RETRY_MS;
        throw new LocalRpcAbsent(this.path);
      }
      throw new LocalRpcStatus(UNAVAILABLE, `RPC socket ${this.path}: ${(e as Error).message}`);
    }
  }

  /**
   * Writes call `callId`'s frame (its turn in the write queue; never throws).
   * A connection that ended, or whose first write fails, has taken none of
   * the frame: the call goes once to a fresh connection instead of failing
   * UNAVAILABLE. Once a byte went out the call is never resent (it may run).
   */
  async #send(callId: number, frame: Uint8Array, conn: Deno.Conn, deadline: number) {
    const fail = (e: Error) => {
      const p = this.#pending.get(callId);
      if (!p) return;
      this.#pending.delete(callId);
      clearTimeout(p.timer);
      p.reject(e);
    };
    for (let attempt = 0;; attempt++) {
      // Queued behind a write the server does not take, a call may reach its deadline
      // before its turn: it was failed with DEADLINE_EXCEEDED, so it must not run later.
      // After close() it was failed CANCELLED, and no connection is dialled for it.
      const p = this.#pending.get(callId);
      if (!p || this.#closed) return;
      try {
        if (this.#dead.has(conn)) conn = await this.#connect(deadline - performance.now());
      } catch (e) {
        return fail(e as Error); // nothing was sent: LocalRpcAbsent lets the caller use gRPC
      }
      if (!this.#pending.has(callId) || this.#closed) return;
      p.conn = conn;
      let off = 0;
      try {
        while (off < frame.length) {
          off += await conn.write(frame.subarray(off));
          p.sent = true;
        }
      } catch (e) {
        this.#retire(conn);
        if (off === 0 && attempt === 0) continue;
        return fail(
          new LocalRpcStatus(
            UNAVAILABLE,
            `RPC connection to ${this.path} broke writing call ${callId}: ${(e as Error).message}`,
          ),
        );
      }
      // Written on a connection whose read loop has already ended: no answer can come.
      if (this.#dead.has(conn)) {
        fail(new LocalRpcStatus(UNAVAILABLE, `RPC connection to ${this.path} ended`));
      }
      return;
    }
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
