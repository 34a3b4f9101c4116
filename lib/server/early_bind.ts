/**
 * The server's listening addresses, bound before anything slow starts. The
 * pinned pool takes seconds to build (10-15 s for the default on a small
 * machine): a taken port must refuse the start at once, naming its flag and
 * address, not after that wait.
 *
 * What can be bound for real is bound here and handed on to what serves it
 * (a listener bound now cannot be taken by another process; connections
 * wait in its backlog until the server accepts):
 *  - `--addr` behind the GOAWAY guard: the guard's TCP listener (listeners.ts);
 *  - `--uds PATH`: the path claimed (uds.ts: a live server's path is refused,
 *    a stale one taken over), the guard's listener on it and the local RPC
 *    socket `PATH.rpc` (listeners.ts);
 *  - `--peer-rpc-port` (with `--index-redis`): the peer RPC listener (cross_node.ts);
 *  - `--http-addr`: the HTTP server, answering 503 `starting` until the
 *    server is ready ({@link EarlyHttp.serve}; Deno.serve takes no listener).
 *
 * Bound by code that takes no listener, so only probed (bound, and released
 * once every other address is bound, so that another of the server's flags
 * naming the same port is refused here; another process may take the port
 * before the real bind, which then refuses the start naming the flag all the
 * same):
 *  - `--addr` without the guard (grpc-js binds it);
 *  - `--xfer-port` with `--transport tcp` (the native transfer endpoint binds
 *    it over the pool). With `auto` RDMA may not use the port at all: not probed.
 *
 * @module
 */
import { dirname } from "node:path";
import type { Logger } from "../log.ts";
import { HTTP_CLOSE_WAIT_MS, settlesWithin } from "../http/shutdown.ts";
import type { ServeConfig } from "./config.ts";
import {
  type BoundSocket,
  boundSocket,
  claimSocketPath,
  localRpcSocketPath,
  releaseSocketPath,
  upstreamSocketPath,
} from "./uds.ts";

/** The `--uds` sockets bound early. */
export interface EarlyUds {
  readonly path: string;
  /** The public socket when the GOAWAY guard relays it; undefined: grpc-js binds `path` later. */
  readonly listener: Deno.UnixListener | undefined;
  /** The local RPC socket `PATH.rpc`. */
  readonly rpc: Deno.UnixListener;
  /** The socket files bound here, for whoever serves them to remove at shutdown. */
  readonly files: readonly BoundSocket[];
}

/** The HTTP server bound early (`--http-addr`). */
export interface EarlyHttp {
  readonly server: Deno.HttpServer;
  /** host:port, port 0 resolved. */
  readonly addr: string;
  /** Requests go to `handler` from now on; until then each is a 503 `starting`. */
  serve(handler: Deno.ServeHandler): void;
}

/** What {@link bindEarly} bound; each piece is handed on to what serves it. */
export interface EarlySockets {
  /** `--addr`'s listener when the GOAWAY guard relays it; undefined: grpc-js binds it later. */
  readonly grpc: Deno.TcpListener | undefined;
  readonly uds: EarlyUds | undefined;
  /** The peer RPC listener (`--peer-rpc-port`), with `--index-redis`. */
  readonly peerRpc: Deno.TcpListener | undefined;
  readonly http: EarlyHttp | undefined;
  /**
   * Closes everything bound here and removes its socket files: for a start
   * that failed. What was handed on and closed since is skipped.
   */
  close(): Promise<void>;
}

/** What {@link bindEarly} reads of the configuration. */
export type EarlyConfig = Pick<
  ServeConfig,
  "addr" | "goawayGuard" | "uds" | "httpAddr" | "index" | "peer"
>;

type Closer = () => unknown;

/**
 * Binds (or probes) every address `cfg` names, in flag order. Throws an
 * Error naming the flag and the address (`--addr 127.0.0.1:50055: cannot
 * listen: …`) for the first that cannot be bound, having closed the others.
 *
 * @example
 * ```ts
 * const early = await bindEarly(cfg, log);
 * try {
 *   // build the pool, hand early.grpc, early.uds, ... on
 * } catch (e) {
 *   await early.close();
 *   throw e;
 * }
 * ```
 */
export async function bindEarly(cfg: EarlyConfig, log: Logger): Promise<EarlySockets> {
  const closers: Closer[] = [];
  const close = async () => {
    for (const c of closers.reverse()) {
      try {
        await c();
      } catch (e) {
        log.warn("closing a socket of a failed start failed", { error: (e as Error).message });
      }
    }
    closers.length = 0;
  };
  // Probes stay bound until every address is: one of the server's own flags
  // naming a probed port (--http-addr = --addr without the guard) is refused
  // here naming that flag, not after the pool when the real bind finds it taken.
  const probes: Deno.Listener[] = [];
  try {
    const grpc = bindAddr(cfg, closers, probes);
    const uds = cfg.uds === undefined
      ? undefined
      : await bindUds(cfg.uds, cfg.goawayGuard, closers, log);
    const peerRpc = cfg.index.redisUrl ? bindPeer(cfg.peer, closers, probes, log) : undefined;
    const http = cfg.httpAddr ? serveHttp(cfg.httpAddr, closers) : undefined;
    for (const p of probes) closeListener(p);
    return { grpc, uds, peerRpc, http, close };
  } catch (e) {
    await close();
    throw e;
  }
}

/** `host:port` as Deno.listen takes it (IPv6 brackets dropped). */
function hostPort(addr: string): { hostname: string; port: number } {
  const i = addr.lastIndexOf(":");
  return {
    hostname: addr.slice(0, i).replace(/^\[(.*)\]$/, "$1"),
    port: Number(addr.slice(i + 1)),
  };
}

/** Closes a listener; one closed already (handed on, then closed) is fine. */
function closeListener(l: Deno.Listener): void {
  try {
    l.close();
  } catch (e) {
    if (!(e instanceof Deno.errors.BadResource)) throw e;
  }
}

/** Binds a TCP listener, or throws naming `flag` (the flag and its value). */
function listenTcp(flag: string, at: { hostname: string; port: number }): Deno.TcpListener {
  try {
    return Deno.listen(at);
  } catch (e) {
    throw new Error(`${flag}: cannot listen: ${(e as Error).message}`);
  }
}

/** Holds a probe: released once every address is bound, or by `close()`. */
function holdProbe(l: Deno.Listener, closers: Closer[], probes: Deno.Listener[]): void {
  closers.push(() => closeListener(l));
  probes.push(l);
}

/** `--addr`: bound for the guard; probed for grpc-js (port 0 needs no probe). */
function bindAddr(
  cfg: Pick<ServeConfig, "addr" | "goawayGuard">,
  closers: Closer[],
  probes: Deno.Listener[],
): Deno.TcpListener | undefined {
  const at = hostPort(cfg.addr);
  if (!cfg.goawayGuard) {
    if (at.port !== 0) holdProbe(listenTcp(`--addr ${cfg.addr}`, at), closers, probes);
    return undefined;
  }
  const l = listenTcp(`--addr ${cfg.addr}`, at);
  closers.push(() => closeListener(l));
  return l;
}

/**
 * `--uds PATH`: the directory checked, PATH claimed (and `PATH.up` where the
 * guard relays to grpc-js), the guard's listener on PATH and the local RPC
 * socket beside it bound. Throws naming the flag and the path.
 */
async function bindUds(
  path: string,
  guard: boolean,
  closers: Closer[],
  log: Logger,
): Promise<EarlyUds> {
  const files: BoundSocket[] = [];
  const listen = async (p: string) => {
    await claimSocketPath(p);
    const l = Deno.listen({ transport: "unix", path: p });
    closers.push(() => closeListener(l));
    const f = await boundSocket(p);
    files.push(f);
    closers.push(() => releaseSocketPath(f));
    return l;
  };
  try {
    await checkSocketDir(path);
    if (await claimSocketPath(path) === "removed_stale") {
      log.info("removed a stale gRPC socket file (no server accepts on it)", { uds: path });
    }
    let listener: Deno.UnixListener | undefined;
    if (guard) {
      await claimSocketPath(upstreamSocketPath(path));
      listener = await listen(path);
    }
    const rpc = await listen(localRpcSocketPath(path));
    return { path, listener, rpc, files };
  } catch (e) {
    throw new Error(`--uds ${path}: cannot listen: ${(e as Error).message}`);
  }
}

/**
 * The socket's directory exists: else binding fails on the first socket made,
 * whose name says nothing to the user.
 */
async function checkSocketDir(path: string): Promise<void> {
  const dir = dirname(path);
  let info: Deno.FileInfo;
  try {
    info = await Deno.stat(dir);
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) throw new Error(`directory ${dir} does not exist`);
    throw e;
  }
  if (!info.isDirectory) throw new Error(`${dir} is not a directory`);
}

/**
 * The probe of `--xfer-port` where TCP is sure to bind it, then the peer RPC
 * listener (`--peer-rpc-port`; it binds every address, like the transfer listener).
 */
function bindPeer(
  peer: ServeConfig["peer"],
  closers: Closer[],
  probes: Deno.Listener[],
  log: Logger,
): Deno.TcpListener {
  if (peer.transport === "tcp" && peer.xferPort !== 0) {
    const at = { hostname: "0.0.0.0", port: peer.xferPort };
    try {
      holdProbe(Deno.listen(at), closers, probes);
    } catch (e) {
      throw new Error(
        `--xfer-port ${at.port}: cannot listen on ${at.hostname}:${at.port}: ${
          (e as Error).message
        }`,
      );
    }
  }
  let rpc: Deno.TcpListener;
  try {
    rpc = Deno.listen({ hostname: "0.0.0.0", port: peer.rpcPort });
  } catch (e) {
    throw new Error(
      `cannot listen for peer RPC on port ${peer.rpcPort} (--peer-rpc-port): ${
        (e as Error).message
      }`,
    );
  }
  closers.push(() => closeListener(rpc));
  log.child({ component: "peer" }).info("peer RPC open", { port: rpc.addr.port });
  return rpc;
}

/** The answer to every HTTP request before the server is ready. */
function starting(): Response {
  const body = {
    status: "starting",
    error: "the server is starting (building the pinned pool); retry shortly",
  };
  return new Response(JSON.stringify(body) + "\n", {
    status: 503,
    headers: { "content-type": "application/json", "retry-after": "1" },
  });
}

/** `--http-addr`: served from now on, 503 `starting` until {@link EarlyHttp.serve}. */
function serveHttp(httpAddr: string, closers: Closer[]): EarlyHttp {
  const i = httpAddr.lastIndexOf(":");
  const hostname = httpAddr.slice(0, i);
  let handler: Deno.ServeHandler = starting;
  let server: Deno.HttpServer;
  try {
    server = Deno.serve(
      { hostname, port: Number(httpAddr.slice(i + 1)), onListen: () => {} },
      (req, info) => handler(req, info),
    );
  } catch (e) {
    throw new Error(`--http-addr ${httpAddr}: cannot listen: ${(e as Error).message}`);
  }
  closers.push(() => settlesWithin(server.shutdown(), HTTP_CLOSE_WAIT_MS));
  return {
    server,
    addr: `${hostname}:${(server.addr as Deno.NetAddr).port}`,
    serve(h) {
      handler = h;
    },
  };
}
