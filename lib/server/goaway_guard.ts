/**
 * GOAWAY guard: the KV server's public gRPC listener. A small TCP relay in
 * front of the grpc-js server that forwards every byte both ways, except the
 * HTTP/2 GOAWAY frames a client sends.
 *
 * Why: on Deno 2.9.4–2.9.6 (node:http2 is nghttp2 inside Deno), a server
 * session that receives a client's GOAWAY after roughly 100 or more streams
 * on that connection aborts the whole process inside nghttp2
 * (`find_stream_on_goaway_func: Assertion 'stream->closed_next == NULL'`,
 * exit 134, or a segfault, exit 139): denoland/deno#36788. Every gRPC client
 * sends GOAWAY when its channel is closed cleanly (grpc-js on Deno and Node,
 * vLLM's Python client), so one engine restart would kill the server and the
 * cache of every other engine with it. A connection that simply ends (FIN or
 * reset, as when a client process exits) does not trigger it. The guard turns
 * a graceful client close into exactly that: the GOAWAY frame is dropped, and
 * when the client then closes its socket the relay closes the server-side
 * socket. Nothing is lost by dropping it: GOAWAY only tells the server that
 * the client opens no new streams, and the client's open streams still
 * complete because every other frame is forwarded unchanged.
 *
 * The relay uses Deno's own sockets (no node:http2, no nghttp2), so the
 * frame never reaches the code that crashes. The grpc-js server listens on
 * an ephemeral loopback port that only the relay connects to. The server's
 * Unix-domain socket (`--uds`) gets a guard of its own: the crash does not
 * depend on the transport (unguarded over a Unix socket, 6 of 10 runs of
 * tests/server/fixtures/goaway_repro.ts crashed the server).
 *
 * @module
 */

import { acceptEach } from "./accept.ts";

/** The client connection preface (RFC 9113 §3.4) that precedes the first frame. */
const PREFACE = new TextEncoder().encode("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
/** Every HTTP/2 frame starts with a 9-byte header: length(24) type(8) flags(8) stream(32). */
const FRAME_HEADER_BYTES = 9;
/** Frame type of GOAWAY (RFC 9113 §6.8). */
export const FRAME_TYPE_GOAWAY = 0x7;
/** Relay read buffer: large enough that a Save/Load message moves in few reads. */
const RELAY_CHUNK_BYTES = 256 * 1024;

/**
 * Incremental filter over the client→server byte stream of one HTTP/2
 * connection: passes the preface and every frame through, and drops whole
 * GOAWAY frames however the stream is split into chunks. Payloads of other
 * frames are never buffered (only a frame header split across chunks is).
 * A stream that does not start with the HTTP/2 preface is passed through
 * untouched (the server rejects it itself).
 *
 * @example
 * ```ts
 * const f = new GoawayFilter();
 * for (const part of f.push(chunk)) await write(part);
 * console.log(f.goawaysDropped);
 * ```
 */
export class GoawayFilter {
  /** Bytes of the preface still expected. */
  #prefaceLeft = PREFACE.length;
  /** False once the stream turned out not to be HTTP/2 with prior knowledge. */
  #parsing = true;
  /** A frame header that arrived split across chunks. */
  #header = new Uint8Array(FRAME_HEADER_BYTES);
  #headerHave = 0;
  /** Payload bytes of the current frame still to pass (or drop). */
  #payloadLeft = 0;
  #dropping = false;
  /** GOAWAY frames dropped so far. */
  goawaysDropped = 0;

  /**
   * Feeds one chunk read from the client; returns the parts to forward, in
   * order. The parts may be views into `chunk` (forward them before reusing it)
   * or a copy of a frame header that spanned chunks.
   */
  push(chunk: Uint8Array): Uint8Array[] {
    if (!this.#parsing) return [chunk];
    const out: Uint8Array[] = [];
    let i = 0;
    if (this.#prefaceLeft > 0) {
      const off = PREFACE.length - this.#prefaceLeft;
      const n = Math.min(this.#prefaceLeft, chunk.length);
      for (let k = 0; k < n; k++) {
        if (chunk[k] !== PREFACE[off + k]) {
          // Not HTTP/2 prior knowledge: relay as is and stop looking at frames.
          this.#parsing = false;
          return [chunk];
        }
      }
      this.#prefaceLeft -= n;
      i = n;
      if (n > 0) out.push(chunk.subarray(0, n));
    }
    // `start` marks the first byte not yet forwarded; contiguous pass-through
    // bytes are forwarded as one view.
    let start = i;
    while (i < chunk.length) {
      if (this.#payloadLeft > 0) {
        const n = Math.min(this.#payloadLeft, chunk.length - i);
        if (this.#dropping) {
          if (i > start) out.push(chunk.subarray(start, i));
          start = i + n;
        }
        i += n;
        this.#payloadLeft -= n;
        if (this.#payloadLeft === 0) this.#dropping = false;
        continue;
      }
      // Collect a frame header.
      const need = FRAME_HEADER_BYTES - this.#headerHave;
      const n = Math.min(need, chunk.length - i);
      this.#header.set(chunk.subarray(i, i + n), this.#headerHave);
      const headerStartedEarlier = this.#headerHave > 0;
      this.#headerHave += n;
      if (this.#headerHave < FRAME_HEADER_BYTES) {
        // The rest of the header comes with the next chunk: hold these bytes back.
        if (i > start) out.push(chunk.subarray(start, i));
        i += n;
        start = i;
        continue;
      }
      const h = this.#header;
      const length = (h[0] << 16) | (h[1] << 8) | h[2];
      const drop = h[3] === FRAME_TYPE_GOAWAY;
      this.#headerHave = 0;
      if (headerStartedEarlier) {
        // Part of this header was held back from an earlier chunk.
        if (i > start) out.push(chunk.subarray(start, i));
        if (!drop) out.push(h.slice());
        i += n;
        start = i;
      } else if (drop) {
        if (i > start) out.push(chunk.subarray(start, i));
        i += n;
        start = i;
      } else {
        i += n;
      }
      if (drop) this.goawaysDropped++;
      this.#payloadLeft = length;
      this.#dropping = drop && length > 0;
    }
    if (start < chunk.length) out.push(chunk.subarray(start));
    return out;
  }
}

/**
 * Where the guard listens: a TCP address (port 0: any free port), or a
 * Unix-domain socket path (`--uds`; the caller owns the file, lib/server/uds.ts).
 */
export type GuardListen = { hostname: string; port: number } | { path: string };

/**
 * Where the guard relays to: the grpc-js server's loopback port, or a Unix
 * socket it listens on (a private one, so the relay of `--uds` clients stays
 * off the TCP stack on both of its legs).
 */
export type GuardUpstream = { upstreamHostname: string; upstreamPort: number } | {
  upstreamPath: string;
};

/** Where the guard listens and where it relays to. */
export type GoawayGuardOptions = GuardListen & GuardUpstream & {
  /** Called once per dropped GOAWAY (for logs and metrics). */
  onGoawayDropped?: () => void;
  /** Called when relaying a connection failed for a reason other than a peer hanging up. */
  onError?: (err: Error) => void;
};

/** A listening guard. */
export interface GoawayGuard {
  /** The bound public TCP port (resolved when 0 was asked); 0 for a Unix socket. */
  port: number;
  /** Connections being relayed now. */
  readonly connections: number;
  /** Stops accepting and closes every relayed connection. */
  close(): Promise<void>;
}

/** Errors that only mean a peer went away or the socket was already closed. */
function isHangup(e: unknown): boolean {
  return e instanceof Deno.errors.ConnectionReset ||
    e instanceof Deno.errors.BrokenPipe ||
    e instanceof Deno.errors.BadResource ||
    e instanceof Deno.errors.NotConnected ||
    e instanceof Deno.errors.Interrupted ||
    e instanceof Deno.errors.ConnectionAborted;
}

function closeQuietly(c: Deno.Conn): void {
  try {
    c.close();
  } catch (e) {
    // Closing twice (the other direction got there first) is expected.
    if (!(e instanceof Deno.errors.BadResource)) throw e;
  }
}

async function writeAll(c: Deno.Conn, b: Uint8Array): Promise<void> {
  let off = 0;
  while (off < b.length) off += await c.write(b.subarray(off));
}

async function relay(
  src: Deno.Conn,
  dst: Deno.Conn,
  filter: GoawayFilter | undefined,
  onDropped: (() => void) | undefined,
): Promise<void> {
  const buf = new Uint8Array(RELAY_CHUNK_BYTES);
  for (;;) {
    const n = await src.read(buf);
    if (n === null) return;
    const chunk = buf.subarray(0, n);
    if (!filter) {
      await writeAll(dst, chunk);
      continue;
    }
    const before = filter.goawaysDropped;
    for (const part of filter.push(chunk)) await writeAll(dst, part);
    for (let k = before; k < filter.goawaysDropped; k++) onDropped?.();
  }
}

/** The guard's connection to the gRPC server behind it (Unix socket, or TCP without Nagle). */
async function connectUpstream(opts: GuardUpstream): Promise<Deno.Conn> {
  if ("upstreamPath" in opts) {
    return await Deno.connect({ transport: "unix", path: opts.upstreamPath });
  }
  const tcp = await Deno.connect({ hostname: opts.upstreamHostname, port: opts.upstreamPort });
  tcp.setNoDelay(true);
  return tcp;
}

/**
 * Starts the guard: listens on `hostname:port` and relays each connection to
 * the upstream gRPC server, dropping client GOAWAY frames. When either side
 * ends, both sockets are closed (the server sees the client's close as a
 * plain connection end).
 *
 * @example
 * ```ts
 * const g = startGoawayGuard({ hostname: "127.0.0.1", port: 0, upstreamHostname: "127.0.0.1", upstreamPort: 41234 });
 * console.log(g.port);
 * await g.close();
 * ```
 */
export function startGoawayGuard(opts: GoawayGuardOptions): GoawayGuard {
  const listener: Deno.Listener = "path" in opts
    ? Deno.listen({ transport: "unix", path: opts.path })
    : Deno.listen({ hostname: opts.hostname, port: opts.port });
  const live = new Set<Deno.Conn>();
  const pairs = new Set<Promise<void>>();
  const fail = (e: unknown) => {
    if (isHangup(e)) return;
    opts.onError?.(e instanceof Error ? e : new Error(String(e)));
  };
  const handle = async (client: Deno.Conn) => {
    live.add(client);
    let upstream: Deno.Conn | undefined;
    try {
      // Small RPCs go out at once (Nagle does not apply to a Unix socket).
      if (client.localAddr.transport === "tcp") (client as Deno.TcpConn).setNoDelay(true);
      upstream = await connectUpstream(opts);
      live.add(upstream);
      const up = upstream;
      // Whichever direction ends first closes both sockets: the server then
      // sees the client's close as a plain end of the connection.
      const end = () => {
        closeQuietly(client);
        closeQuietly(up);
      };
      await Promise.all([
        relay(client, up, new GoawayFilter(), opts.onGoawayDropped).catch(fail).finally(end),
        relay(up, client, undefined, undefined).catch(fail).finally(end),
      ]);
    } catch (e) {
      fail(e);
      closeQuietly(client);
      if (upstream) closeQuietly(upstream);
    } finally {
      live.delete(client);
      if (upstream) live.delete(upstream);
    }
  };
  let closed = false;
  const accepting = acceptEach(listener, () => closed, {
    serve(conn) {
      const p = handle(conn);
      pairs.add(p);
      p.finally(() => pairs.delete(p));
    },
    retrying: fail, // close() closes the listener; any other accept error is reported
  });
  return {
    port: listener.addr.transport === "tcp" ? listener.addr.port : 0,
    get connections() {
      return pairs.size;
    },
    async close() {
      closed = true;
      try {
        listener.close();
      } catch (e) {
        if (!(e instanceof Deno.errors.BadResource)) throw e;
      }
      await accepting;
      for (const c of live) closeQuietly(c);
      await Promise.all(pairs);
    },
  };
}
