/**
 * The server's sockets for the engines: the gRPC address (behind the GOAWAY
 * guard when it is on), the `--uds` Unix socket and the local RPC socket
 * beside it. They were probed before the pool was built (early_bind.ts) and
 * released, so that nothing listens while the pool is built (a call then is
 * refused at once, not left in a backlog); they are bound here, once the
 * server can serve. Binds them all or none: a failure (an address another
 * process took since the probe) closes what was opened and names the flag.
 *
 * With the guard on, grpc-js listens on a loopback port that only the guard
 * connects to; the guard owns the public address and the Unix socket
 * (goaway_guard.ts). Behind it, `--uds` clients are relayed to grpc-js over a
 * second Unix socket beside the public one (`PATH.up`): both legs of their
 * relay skip the TCP stack; its name is fixed so a crashed server's is found
 * and taken over like the public one, and only the server's user may connect
 * to it. Without the guard grpc-js binds both itself.
 *
 * @module
 */
import * as grpc from "@grpc/grpc-js";
import type { Logger } from "../log.ts";
import type { ServeConfig } from "./config.ts";
import type { ServerMetrics } from "./metrics.ts";
import {
  type GoawayGuard,
  type GuardListen,
  type GuardUpstream,
  startGoawayGuard,
} from "./goaway_guard.ts";
import {
  type BoundSocket,
  boundSocket,
  claimSocketPath,
  localRpcSocketPath,
  releaseSocketPath,
  UPSTREAM_SOCKET_MODE,
  upstreamSocketPath,
} from "./uds.ts";
import { type LocalRpcServer, serveLocalRpc } from "./local_rpc.ts";
import { cannotListen } from "./early_bind.ts";

/** Where grpc-js listens behind the GOAWAY guard: loopback, any free port. */
const UPSTREAM_HOST = "127.0.0.1";
const UPSTREAM_ADDR = `${UPSTREAM_HOST}:0`;

/** The bound sockets. */
export interface Listeners {
  /** The public gRPC address, host:port (port 0 resolved). */
  readonly grpcAddr: string;
  /** The `--uds` socket, if any. */
  readonly udsPath: string | undefined;
  /** The local RPC socket beside it, if any. */
  readonly localRpcPath: string | undefined;
  /**
   * Closes the guards and the local RPC socket and removes the socket files
   * this server bound. grpc-js's own sockets are left to process exit (see
   * server.ts on GOAWAY).
   */
  close(): Promise<void>;
}

/**
 * Binds the gRPC `server` and the local RPC socket (answered by `impl`, the
 * gRPC service's own handlers) as `cfg` says. On failure everything it
 * opened is closed, `server` is force-shut, and an Error naming the flag is
 * thrown (`--addr …: cannot listen: …`, `--uds …: cannot listen: …`).
 *
 * @example
 * ```ts
 * const l = await openListeners(server, impl, cfg, metrics, log);
 * console.log(l.grpcAddr);
 * await l.close();
 * ```
 */
export async function openListeners(
  server: grpc.Server,
  impl: grpc.UntypedServiceImplementation,
  cfg: Pick<ServeConfig, "addr" | "goawayGuard" | "uds" | "maxMessageBytes">,
  metrics: ServerMetrics,
  log: Logger,
): Promise<Listeners> {
  const opened: Opened = { guards: [], sockets: [], localRpc: undefined };
  const close = async () => {
    for (const g of opened.guards) await g.close();
    opened.localRpc?.close();
    // Left behind, a file would make the next start probe it as stale.
    for (const s of opened.sockets) await releaseSocketPath(s);
  };
  const fail = async (flag: string, e: unknown): Promise<never> => {
    await close();
    server.forceShutdown();
    throw cannotListen(flag, e);
  };
  const startGuard = guardStarter(metrics, log);
  const hostPart = cfg.addr.slice(0, cfg.addr.lastIndexOf(":"));
  let port: number;
  try {
    port = await bindAddr(server, cfg, hostPart, startGuard, opened);
  } catch (e) {
    return await fail(`--addr ${cfg.addr}`, e);
  }
  let uds: BoundSocket | undefined;
  if (cfg.uds !== undefined) {
    try {
      uds = await bindUds(server, impl, { ...cfg, uds: cfg.uds }, startGuard, opened, log);
    } catch (e) {
      return await fail(`--uds ${cfg.uds}`, e);
    }
  }
  return {
    grpcAddr: `${hostPart}:${port}`,
    udsPath: uds?.path,
    localRpcPath: opened.localRpc?.path,
    close,
  };
}

/** What the listeners opened so far: closed together on a failure or at close. */
interface Opened {
  guards: GoawayGuard[];
  sockets: BoundSocket[];
  localRpc: LocalRpcServer | undefined;
}

type StartGuard = (listen: GuardListen, upstream: GuardUpstream) => GoawayGuard;

/** Starts GOAWAY guards that count and log what they drop. */
function guardStarter(metrics: ServerMetrics, log: Logger): StartGuard {
  return (listen, upstream) =>
    startGoawayGuard({
      ...listen,
      ...upstream,
      onGoawayDropped: () => {
        metrics.goawayDropped();
        log.debug("dropped a client's GOAWAY (denoland/deno#36788 guard)");
      },
      onError: (e) => log.warn("gRPC relay connection failed", { error: e.message }),
    });
}

/** Binds grpc-js to `addr`; resolves the bound port. */
function bindGrpc(server: grpc.Server, addr: string): Promise<number> {
  return new Promise<number>((resolve, reject) =>
    server.bindAsync(
      addr,
      grpc.ServerCredentials.createInsecure(),
      (err, p) => err ? reject(err) : resolve(p),
    )
  );
}

/** `--addr`: grpc-js itself, or behind a guard that owns the address. Resolves the public port. */
async function bindAddr(
  server: grpc.Server,
  cfg: Pick<ServeConfig, "addr" | "goawayGuard">,
  hostPart: string,
  startGuard: StartGuard,
  opened: Opened,
): Promise<number> {
  const port = await bindGrpc(server, cfg.goawayGuard ? UPSTREAM_ADDR : cfg.addr);
  if (!cfg.goawayGuard) return port;
  const guard = startGuard({
    hostname: hostPart.replace(/^\[(.*)\]$/, "$1"),
    port: Number(cfg.addr.slice(cfg.addr.lastIndexOf(":") + 1)),
  }, { upstreamHostname: UPSTREAM_HOST, upstreamPort: port });
  opened.guards.push(guard);
  return guard.port;
}

/**
 * `--uds`: the Unix socket (a stale file taken over), relayed by a guard over
 * the upstream socket beside it when the guard is on, and the local RPC
 * socket beside it.
 */
async function bindUds(
  server: grpc.Server,
  impl: grpc.UntypedServiceImplementation,
  cfg: Pick<ServeConfig, "goawayGuard" | "maxMessageBytes"> & { uds: string },
  startGuard: StartGuard,
  opened: Opened,
  log: Logger,
): Promise<BoundSocket> {
  // Its directory was checked and its lock (`PATH.lock`) taken before the pool (early_bind.ts):
  // no other server removes or binds a file at PATH, PATH.up or PATH.rpc meanwhile.
  const path = cfg.uds;
  if (await claimSocketPath(path) === "removed_stale") {
    log.info("removed a stale gRPC socket file (no server accepts on it)", { uds: path });
  }
  if (cfg.goawayGuard) {
    const upstreamPath = upstreamSocketPath(path);
    await claimSocketPath(upstreamPath);
    await bindGrpc(server, `unix:${upstreamPath}`);
    opened.sockets.push(await boundSocket(upstreamPath));
    await Deno.chmod(upstreamPath, UPSTREAM_SOCKET_MODE);
    opened.guards.push(startGuard({ path }, { upstreamPath }));
  } else {
    await bindGrpc(server, `unix:${path}`);
  }
  const uds = await boundSocket(path);
  opened.sockets.push(uds);
  opened.localRpc = await openLocalRpc(path, impl, cfg.maxMessageBytes, log, opened.sockets);
  return uds;
}

/** The engines' hot calls in frames beside the `--uds` socket (local_rpc.ts), same handlers. */
async function openLocalRpc(
  udsPath: string,
  impl: grpc.UntypedServiceImplementation,
  maxMessageBytes: number,
  log: Logger,
  sockets: BoundSocket[],
): Promise<LocalRpcServer> {
  const rpcPath = localRpcSocketPath(udsPath);
  await claimSocketPath(rpcPath);
  const rpc = serveLocalRpc(
    Deno.listen({ transport: "unix", path: rpcPath }),
    impl,
    maxMessageBytes,
    log,
  );
  try {
    sockets.push(await boundSocket(rpcPath));
  } catch (e) {
    rpc.close(); // not handed back yet: the caller's unwinding cannot reach it
    throw e;
  }
  return rpc;
}
