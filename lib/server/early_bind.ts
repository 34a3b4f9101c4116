/**
 * The server's listening addresses, checked before anything slow starts. The
 * pinned pool takes seconds to build (10-15 s for the default on a small
 * machine): a taken port must refuse the start at once, naming its flag and
 * address, not after that wait.
 *
 * Every address an engine or a peer calls is only probed here: bound, held
 * until every other address is bound too (so one of the server's own flags
 * naming another's port is refused here, naming it), then released, the
 * socket files removed. Nothing listens on them while the pool is built, so
 * a call made meanwhile is refused at once (connection refused, or no socket
 * file) instead of waiting its whole deadline in a listen backlog; the server
 * binds them for real once it can serve (listeners.ts, cross_node.ts). A
 * port another process takes in between still refuses the start, naming the
 * flag, after the pool. Probed:
 *  - `--addr` (port 0 needs no probe);
 *  - `--uds PATH`: the directory checked, the path's lock `PATH.lock` taken
 *    and kept (uds.ts: another server starting or serving on PATH is refused
 *    at once), PATH claimed (a live server's path is refused, a stale one
 *    taken over), `PATH.up` (the GOAWAY guard's relay) claimed, PATH and the
 *    local RPC socket `PATH.rpc` claimed and bound;
 *  - with `--index-redis`: `--xfer-port` where TCP is sure to bind it
 *    (`--transport tcp`; with `auto` RDMA may not use the port at all), and
 *    `--peer-rpc-port`.
 *
 * `--http-addr` is bound for real: the HTTP server answers 503 `starting` (a
 * fast answer) until the server is ready ({@link EarlyHttp.serve}).
 *
 * @module
 */
import { dirname } from "node:path";
import { splitHostPort } from "../host_port.ts";
import type { Logger } from "../log.ts";
import { HTTP_CLOSE_WAIT_MS, settlesWithin } from "../http/shutdown.ts";
import type { ServeConfig } from "./config.ts";
import {
  boundSocket,
  claimSocketPath,
  localRpcSocketPath,
  lockSocketPath,
  releaseSocketPath,
  type SocketPathLock,
  upstreamSocketPath,
} from "./uds.ts";

/** The HTTP server bound early (`--http-addr`). */
export interface EarlyHttp {
  readonly server: Deno.HttpServer;
  /** host:port, port 0 resolved. */
  readonly addr: string;
  /** Requests go to `handler` from now on; until then each is a 503 `starting`. */
  serve(handler: Deno.ServeHandler): void;
  /** Shuts it down (waiting at most HTTP_CLOSE_WAIT_MS for open requests); once, however often called. */
  close(): Promise<void>;
}

/**
 * What {@link bindEarly} leaves bound: the HTTP server alone (the probes are
 * released), and the `--uds` path's lock, held until the server stops.
 */
export interface EarlySockets {
  readonly http: EarlyHttp | undefined;
  /** The claim on `--uds PATH` (`PATH.lock`): released once its socket files are removed. */
  readonly udsLock: SocketPathLock | undefined;
  /** Shuts the HTTP server down, then releases the `--uds` lock: for a start that failed or was stopped. */
  close(): Promise<void>;
}

/** What {@link bindEarly} reads of the configuration. */
export type EarlyConfig = Pick<
  ServeConfig,
  "addr" | "goawayGuard" | "uds" | "httpAddr" | "index" | "peer"
>;

type Closer = () => unknown;

/**
 * Probes every address `cfg` names, in flag order, and binds `--http-addr`.
 * Throws an Error naming the flag and the address (`--addr 127.0.0.1:50055:
 * cannot listen: …`) for the first that cannot be bound, having closed the
 * others. On return nothing but the HTTP server listens, and no socket file
 * made here is left (`PATH.lock` stays, held, until {@link EarlySockets.close}
 * or the server's stop).
 *
 * @example
 * ```ts
 * const early = await bindEarly(cfg, log);
 * try {
 *   // build the pool, bind the listeners, early.http?.serve(handler)
 * } catch (e) {
 *   await early.close();
 *   throw e;
 * }
 * ```
 */
export async function bindEarly(cfg: EarlyConfig, log: Logger): Promise<EarlySockets> {
  const run = (closers: Closer[]) => async () => {
    for (const c of closers.splice(0).reverse()) {
      try {
        await c();
      } catch (e) {
        log.warn("closing a socket of a failed start failed", { error: (e as Error).message });
      }
    }
  };
  // Held until every address is bound: one flag naming another's port
  // (--http-addr = --addr) is refused here naming it.
  const probes: Closer[] = [];
  const closers: Closer[] = [];
  const release = run(probes);
  const close = run(closers);
  try {
    probeAddr(cfg.addr, probes);
    const udsLock = cfg.uds === undefined
      ? undefined
      : await probeUds(cfg.uds, cfg.goawayGuard, { probes, closers }, log);
    if (cfg.index.redisUrl) probePeer(cfg.peer, probes);
    const http = cfg.httpAddr ? serveHttp(cfg.httpAddr, closers) : undefined;
    await release();
    return { http, udsLock, close };
  } catch (e) {
    await release();
    await close();
    throw e;
  }
}

/**
 * What a listening address that cannot be bound is refused with, early (a
 * probe here) or late (the real bind, listeners.ts): the flag and its value,
 * then the OS's reason.
 */
export function cannotListen(flag: string, e: unknown): Error {
  return new Error(`${flag}: cannot listen: ${(e as Error).message}`);
}

/** `host:port` (validated by config.ts) as Deno.listen takes it (IPv6 brackets dropped). */
function hostPort(addr: string): { hostname: string; port: number } {
  const { host, port } = splitHostPort(addr)!;
  return { hostname: host.replace(/^\[(.*)\]$/, "$1"), port };
}

/** Closes a listener; one closed already is fine. */
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
    throw cannotListen(flag, e);
  }
}

/** `--addr`, probed (port 0: any free port, nothing to probe). */
function probeAddr(addr: string, probes: Closer[]): void {
  const at = hostPort(addr);
  if (at.port === 0) return;
  const l = listenTcp(`--addr ${addr}`, at);
  probes.push(() => closeListener(l));
}

/**
 * `--uds PATH`: the directory checked, the path's lock taken (kept: it goes
 * on `closers`, first, so it is released last), PATH claimed (and
 * `PATH.up`, where the guard relays to grpc-js), PATH and the local RPC
 * socket beside it claimed and bound; each released with its file removed.
 * Throws naming the flag and the path.
 */
async function probeUds(
  path: string,
  guard: boolean,
  { probes, closers }: { probes: Closer[]; closers: Closer[] },
  log: Logger,
): Promise<SocketPathLock> {
  const probe = async (p: string) => {
    await claimSocketPath(p);
    const l = Deno.listen({ transport: "unix", path: p });
    probes.push(() => closeListener(l));
    const f = await boundSocket(p);
    probes.push(() => releaseSocketPath(f));
  };
  try {
    await checkSocketDir(path);
    // Before anything at the path is probed or removed: only the lock's holder may.
    const lock = await lockSocketPath(path);
    closers.push(() => lock.release());
    if (await claimSocketPath(path) === "removed_stale") {
      log.info("removed a stale gRPC socket file (no server accepts on it)", { uds: path });
    }
    if (guard) await claimSocketPath(upstreamSocketPath(path));
    await probe(path);
    await probe(localRpcSocketPath(path));
    return lock;
  } catch (e) {
    throw cannotListen(`--uds ${path}`, e);
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

/** `--xfer-port` where TCP is sure to bind it, then `--peer-rpc-port`; port 0 is not probed. */
function probePeer(peer: ServeConfig["peer"], probes: Closer[]): void {
  if (peer.transport === "tcp" && peer.xferPort !== 0) {
    const at = { hostname: "0.0.0.0", port: peer.xferPort };
    try {
      const l = Deno.listen(at);
      probes.push(() => closeListener(l));
    } catch (e) {
      throw new Error(
        `--xfer-port ${at.port}: cannot listen on ${at.hostname}:${at.port}: ${
          (e as Error).message
        }`,
      );
    }
  }
  if (peer.rpcPort === 0) return;
  const rpc = listenPeerRpc(peer.rpcPort);
  probes.push(() => closeListener(rpc));
}

/**
 * The peer RPC listener (`--peer-rpc-port`; it binds every address, like the
 * transfer listener), or an Error naming the flag.
 *
 * @example
 * ```ts
 * const l = listenPeerRpc(50057);
 * ```
 */
export function listenPeerRpc(port: number): Deno.TcpListener {
  try {
    return Deno.listen({ hostname: "0.0.0.0", port });
  } catch (e) {
    throw new Error(
      `cannot listen for peer RPC on port ${port} (--peer-rpc-port): ${(e as Error).message}`,
    );
  }
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
  const { host: hostname, port } = splitHostPort(httpAddr)!;
  let handler: Deno.ServeHandler = starting;
  let server: Deno.HttpServer;
  try {
    server = Deno.serve(
      { hostname, port, onListen: () => {} },
      (req, info) => handler(req, info),
    );
  } catch (e) {
    throw cannotListen(`--http-addr ${httpAddr}`, e);
  }
  let closing: Promise<unknown> | undefined;
  const close = async () => {
    await (closing ??= settlesWithin(server.shutdown(), HTTP_CLOSE_WAIT_MS));
  };
  closers.push(close);
  return {
    server,
    addr: `${hostname}:${(server.addr as Deno.NetAddr).port}`,
    serve(h) {
      handler = h;
    },
    close,
  };
}
