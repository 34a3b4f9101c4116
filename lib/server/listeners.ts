/**
 * The server's sockets for the engines: the gRPC address (behind the GOAWAY
 * guard when it is on), the `--uds` Unix socket and the local RPC socket
 * beside it. The public sockets were bound before the pool was built
 * (early_bind.ts); here grpc-js binds behind them and they start serving.
 * Binds them all or none: a failure closes what was opened and names the
 * flag.
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
  releaseSocketPath,
  UPSTREAM_SOCKET_MODE,
  upstreamSocketPath,
} from "./uds.ts";
import { type LocalRpcServer, serveLocalRpc } from "./local_rpc.ts";
import type { EarlySockets, EarlyUds } from "./early_bind.ts";

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
 * Binds the gRPC `server` behind the sockets `early` bound and serves the
 * local RPC socket (answered by `impl`, the gRPC service's own handlers). The
 * guard relays an address exactly when `early` holds its listener (bindEarly
 * binds it when `--goaway-guard` is on); the listeners `early` holds are
 * owned from here on. On failure everything it opened is closed, `server` is
 * force-shut, and an Error naming the flag is thrown (`--addr …: cannot
 * listen: …`, `--uds …: cannot listen: …`); what `early` holds and was not
 * handed on yet is left to `early.close()`.
 *
 * @example
 * ```ts
 * const l = await openListeners(server, impl, cfg, early, metrics, log);
 * console.log(l.grpcAddr);
 * await l.close();
 * ```
 */
export async function openListeners(
  server: grpc.Server,
  impl: grpc.UntypedServiceImplementation,
  cfg: Pick<ServeConfig, "addr" | "maxMessageBytes">,
  early: Pick<EarlySockets, "grpc" | "uds">,
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
    throw new Error(`${flag}: cannot listen: ${(e as Error).message}`);
  };
  const startGuard = guardStarter(metrics, log);
  const hostPart = cfg.addr.slice(0, cfg.addr.lastIndexOf(":"));
  let port: number;
  try {
    port = await bindAddr(server, cfg.addr, early.grpc, startGuard, opened);
  } catch (e) {
    return await fail(`--addr ${cfg.addr}`, e);
  }
  if (early.uds) {
    try {
      await bindUds(server, impl, cfg.maxMessageBytes, early.uds, startGuard, opened, log);
    } catch (e) {
      return await fail(`--uds ${early.uds.path}`, e);
    }
  }
  return {
    grpcAddr: `${hostPart}:${port}`,
    udsPath: early.uds?.path,
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

/**
 * `--addr`: grpc-js itself, or behind a guard on the listener bound early.
 * Resolves the public port.
 */
async function bindAddr(
  server: grpc.Server,
  addr: string,
  listener: Deno.TcpListener | undefined,
  startGuard: StartGuard,
  opened: Opened,
): Promise<number> {
  if (!listener) return await bindGrpc(server, addr);
  const port = await bindGrpc(server, UPSTREAM_ADDR);
  const guard = startGuard({ listener }, { upstreamHostname: UPSTREAM_HOST, upstreamPort: port });
  opened.guards.push(guard);
  return guard.port;
}

/**
 * `--uds`: grpc-js behind a guard on the socket bound early (relayed over
 * the upstream socket beside it), or grpc-js on the path itself; then the
 * local RPC socket beside it serves.
 */
async function bindUds(
  server: grpc.Server,
  impl: grpc.UntypedServiceImplementation,
  maxMessageBytes: number,
  uds: EarlyUds,
  startGuard: StartGuard,
  opened: Opened,
  log: Logger,
): Promise<void> {
  opened.sockets.push(...uds.files);
  if (uds.listener) {
    const upstreamPath = upstreamSocketPath(uds.path);
    await bindGrpc(server, `unix:${upstreamPath}`);
    opened.sockets.push(await boundSocket(upstreamPath));
    await Deno.chmod(upstreamPath, UPSTREAM_SOCKET_MODE);
    opened.guards.push(startGuard({ listener: uds.listener }, { upstreamPath }));
  } else {
    // Claimed before the pool was built; claimed again in case a server took it since.
    await claimSocketPath(uds.path);
    await bindGrpc(server, `unix:${uds.path}`);
    opened.sockets.push(await boundSocket(uds.path));
  }
  opened.localRpc = serveLocalRpc(uds.rpc, impl, maxMessageBytes, log);
}
