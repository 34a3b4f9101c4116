/**
 * The server's sockets for the engines: the gRPC address (behind the GOAWAY
 * guard when it is on), the `--uds` Unix socket and the local RPC socket
 * beside it. Binds them all or none: a failure closes what was opened and
 * names the flag.
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
  const bindGrpc = (addr: string) =>
    new Promise<number>((resolve, reject) =>
      server.bindAsync(
        addr,
        grpc.ServerCredentials.createInsecure(),
        (err, p) => err ? reject(err) : resolve(p),
      )
    );
  const guards: GoawayGuard[] = [];
  const sockets: BoundSocket[] = [];
  let localRpc: LocalRpcServer | undefined;
  let uds: BoundSocket | undefined;
  const close = async () => {
    for (const g of guards) await g.close();
    localRpc?.close();
    // Left behind, a file would make the next start probe it as stale.
    for (const s of sockets) await releaseSocketPath(s);
  };
  const fail = async (flag: string, e: unknown): Promise<never> => {
    await close();
    server.forceShutdown();
    throw new Error(`${flag}: cannot listen: ${(e as Error).message}`);
  };
  const startGuard = (listen: GuardListen, upstream: GuardUpstream) =>
    startGoawayGuard({
      ...listen,
      ...upstream,
      onGoawayDropped: () => {
        metrics.goawayDropped();
        log.debug("dropped a client's GOAWAY (denoland/deno#36788 guard)");
      },
      onError: (e) => log.warn("gRPC relay connection failed", { error: e.message }),
    });

  const hostPart = cfg.addr.slice(0, cfg.addr.lastIndexOf(":"));
  let port: number;
  try {
    port = await bindGrpc(cfg.goawayGuard ? UPSTREAM_ADDR : cfg.addr);
    if (cfg.goawayGuard) {
      guards.push(startGuard({
        hostname: hostPart.replace(/^\[(.*)\]$/, "$1"),
        port: Number(cfg.addr.slice(cfg.addr.lastIndexOf(":") + 1)),
      }, { upstreamHostname: UPSTREAM_HOST, upstreamPort: port }));
      port = guards[0].port;
    }
  } catch (e) {
    return await fail(`--addr ${cfg.addr}`, e);
  }
  if (cfg.uds !== undefined) {
    const path = cfg.uds;
    try {
      if (await claimSocketPath(path) === "removed_stale") {
        log.info("removed a stale gRPC socket file (no server accepts on it)", { uds: path });
      }
      if (cfg.goawayGuard) {
        const upstreamPath = upstreamSocketPath(path);
        await claimSocketPath(upstreamPath);
        await bindGrpc(`unix:${upstreamPath}`);
        sockets.push(await boundSocket(upstreamPath));
        await Deno.chmod(upstreamPath, UPSTREAM_SOCKET_MODE);
        guards.push(startGuard({ path }, { upstreamPath }));
      } else {
        await bindGrpc(`unix:${path}`);
      }
      uds = await boundSocket(path);
      sockets.push(uds);
      localRpc = await openLocalRpc(path, impl, cfg.maxMessageBytes, log, sockets);
    } catch (e) {
      return await fail(`--uds ${path}`, e);
    }
  }
  return {
    grpcAddr: `${hostPart}:${port}`,
    udsPath: uds?.path,
    localRpcPath: localRpc?.path,
    close,
  };
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
