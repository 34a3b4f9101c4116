/**
 * Starts the KV server: native engine + pinned pool, block store, KV engine,
 * gRPC service, optional HTTP, and the shutdown path. `main.ts` parses the
 * CLI and calls {@link startServer}; tests start it as a child process the
 * same way.
 *
 * On start it prints ONE line on stdout, a JSON object
 * `{"listening":{"grpc":"127.0.0.1:41234","http":"127.0.0.1:9091"}}`, after
 * both sockets are bound (port 0 resolved), so supervisors and tests can
 * parse the real ports. Everything else goes to stderr as JSON logs.
 *
 * @module
 */
import * as grpc from "@grpc/grpc-js";
import { KvEngine } from "../engine/engine.ts";
import { openNative } from "../engine/native_adapter.ts";
import { KvStore } from "../storage/store.ts";
import { Logger } from "../log.ts";
import { capPoolSize, type ServeConfig } from "./config.ts";
import { numaPlacement, resolveDevices } from "./devices.ts";
import { engineServiceImpl, Sessions } from "./grpc_service.ts";
import { lenientService } from "./decode.ts";
import { SessionEvent_Kind } from "../../proto/pegaflow.ts";
import { httpHandler } from "./http.ts";
import { ServerMetrics } from "./metrics.ts";
import { SsdOpenError, SsdTier } from "../ssd/tier.ts";
import { SsdStorageTier } from "../ssd/ssd_tier_port.ts";
import { registerSsdMetrics } from "../ssd/metrics.ts";
import { LowerTiers } from "../storage/lower_tiers.ts";
import { storeTierHost } from "../storage/tier_host.ts";
import { registerTierMetrics } from "./tier_metrics.ts";
import {
  advertisedFills,
  type BlockIndexHandle,
  indexAdvertiser,
  openBlockIndex,
} from "../index/attach.ts";
import { type OpenedTransport, openTransport } from "../transfer/transport.ts";
import { registerTransferMetrics } from "../transfer/metrics.ts";
import { poolChecksums } from "../../ffi/uring.ts";
import { type ChecksumFn, PeerLockTable } from "../peer/locks.ts";
import { PeerLinks } from "../peer/link.ts";
import { PeerTier } from "../peer/peer_tier.ts";
import { registerPeerMetrics } from "../peer/metrics.ts";
import { peerServiceImpl } from "../peer/service.ts";
import { PeerService } from "../../proto/pegaflow.ts";
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

/** HTTP/2 keepalive: ping an idle client every 30 s, drop it after 20 s of silence. */
const KEEPALIVE_TIME_MS = 30_000;
const KEEPALIVE_TIMEOUT_MS = 20_000;

/** Where grpc-js listens behind the GOAWAY guard: loopback, any free port. */
const UPSTREAM_HOST = "127.0.0.1";
const UPSTREAM_ADDR = `${UPSTREAM_HOST}:0`;

/** Idle-time lease expiry / stale inflight collection period. */
const COLLECT_INTERVAL_MS = 1_000;
/** One layer's K (or V) of one 16-token Llama-3.1-8B block. */
const TYPICAL_SEGMENT_BYTES = 32 * 1024;
/** Allocation unit bounds: 512 B (O_DIRECT sector) .. 64 KiB. */
const MIN_UNIT = 512;
const MAX_UNIT = 64 * 1024;
const DEFAULT_UNIT = 4096;

/**
 * Allocation unit for a hinted value size: the largest power of two that
 * divides it (so items pack without waste), clamped to 512 B..64 KiB; 4 KiB
 * without a hint.
 */
export function allocationUnit(hint: number): number {
  if (!hint) return DEFAULT_UNIT;
  let u = MIN_UNIT;
  while (u * 2 <= MAX_UNIT && hint % (u * 2) === 0) u *= 2;
  return u;
}

/** `PEGAFLOW_TEST_PEER_READ_DELAY_MS` (tests only): the peer tier waits this long before each READ. */
function readDelayHook(log: Logger): (() => Promise<void>) | undefined {
  const v = Deno.env.get("PEGAFLOW_TEST_PEER_READ_DELAY_MS");
  if (!v) return undefined;
  const ms = Number(v);
  if (!Number.isInteger(ms) || ms < 0) {
    throw new Error(`PEGAFLOW_TEST_PEER_READ_DELAY_MS must be an integer ≥ 0, got "${v}"`);
  }
  return () => {
    log.warn("test hook: delaying the peer read", { delay_ms: ms });
    return new Promise((r) => setTimeout(r, ms));
  };
}

/** A started server. */
export interface RunningServer {
  /** Bound gRPC address host:port. */
  grpcAddr: string;
  /** The Unix-domain socket path gRPC is also served on (`--uds`), if any. */
  udsPath: string | undefined;
  httpAddr: string | undefined;
  engine: KvEngine;
  /** Graceful stop: sessions ended, instances cleaned up, sockets closed, native freed. */
  close(): Promise<void>;
}

/**
 * Starts everything described by `cfg`.
 *
 * @example
 * ```ts
 * const s = await startServer({ ...config, addr: "127.0.0.1:0" });
 * console.log(s.grpcAddr);
 * await s.close();
 * ```
 */
export async function startServer(
  cfg: ServeConfig,
  log = new Logger(cfg.logLevel),
): Promise<RunningServer> {
  const cap = capPoolSize(cfg.poolSize);
  if (cap.capped) {
    log.warn("pool size capped to what this machine can hold", {
      requested_bytes: cfg.poolSize,
      pool_bytes: cap.bytes,
      mem_available_bytes: cap.availBytes,
    });
  }
  // One engine per device over one pool and ring (docs/native.md, "Several
  // devices"); on a multi-node host the pool is split per NUMA node.
  const served = resolveDevices(cfg.backend, cfg.devices);
  const placement = numaPlacement(cfg, served, cap.bytes, log);
  const native = await openNative({
    backend: cfg.backend,
    devices: served.devices,
    failDevices: cfg.testFailDevices,
    poolParts: placement?.parts,
    poolBytes: cap.bytes,
    useHugepages: cfg.useHugepages,
    transferPath: cfg.transferPath,
    calibrationFile: cfg.calibrationFile,
    recalibrate: cfg.recalibrate,
    poolProgressMs: cfg.poolProgressMs,
  }, log);
  log.info("pinned pool ready", { backend: native.backend, pool_bytes: native.poolBytes });
  const unitBytes = allocationUnit(cfg.hintValueSize);
  // Cross-node index: seal and evict events feed it; it starts once the gRPC port is known.
  const advertiser = cfg.index.redisUrl ? indexAdvertiser(log) : undefined;
  const store = new KvStore({
    capacityBytes: native.poolBytes,
    unitBytes,
    parts: placement?.parts.map((p) => p.bytes),
    leaseTtlMs: cfg.leaseTtlMs,
    // Sketch sized for the blocks the pool can hold at the hinted (or a typical 32 KiB) segment size.
    lfuCapacityBlocks: cfg.enableLfuAdmission
      ? Math.max(1024, Math.floor(native.poolBytes / (cfg.hintValueSize || TYPICAL_SEGMENT_BYTES)))
      : undefined,
    onEvict: advertiser ? (ns, hash) => advertiser.onEvicted(ns, hash) : undefined,
  });
  // Leases expire and stale inflight blocks are collected on every store call;
  // the timer covers an idle server so pins do not outlive their TTL.
  const collector = setInterval(() => store.collect(), COLLECT_INTERVAL_MS);
  log.info("store ready", {
    unit_bytes: unitBytes,
    lfu_admission: cfg.enableLfuAdmission,
    lease_ttl_ms: cfg.leaseTtlMs,
  });
  const sessions = new Sessions();
  // The gauges read the engine at scrape time, by which point it exists.
  const metrics: ServerMetrics = new ServerMetrics(() => store.stats(), {
    instances: () => engine.instances().length,
    sessions: () => sessions.count,
  });
  metrics.devicesServed(native.devices);
  let ssd: SsdTier | undefined;
  if (cfg.ssd.paths.length > 0) {
    try {
      ssd = await SsdTier.open({
        ...cfg.ssd,
        pool: native.copyEngine.pool.handle,
        ring: native.copyEngine.ring,
        log: log.child({ tier: "ssd" }),
        stageMetrics: (stage) => metrics.stage(stage),
      });
      registerSsdMetrics(metrics.registry, () => ssd!.stats());
      log.info("SSD tier ready", {
        paths: ssd.files.map((f) => f.path).join(","),
        capacity_bytes: ssd.stats().capacityBytes,
        recovered_blocks: ssd.recovery.blocks,
      });
    } catch (e) {
      if (!(e instanceof SsdOpenError)) {
        // E.g. SsdLockedError: another server holds the cache file. Not starting at all
        // beats serving beside it; free what was opened so an embedder can retry.
        clearInterval(collector);
        await native.close();
        throw e;
      }
      // The RAM tier serves without it; the reason names the path.
      log.error("SSD tier disabled", { error: e.message });
    }
  }
  // Cross-node (docs/peer.md): where the block index runs, this node opens a
  // transfer endpoint over its pool, grants transfer locks to peers, and —
  // unless --peer-fetch false — fetches from peers on a local miss.
  // Blocks the tiers bring into RAM are advertised like saved ones.
  const tierHost = advertiser
    ? advertisedFills(storeTierHost(store), advertiser)
    : storeTierHost(store);
  const plog = log.child({ component: "peer" });
  let transfer: OpenedTransport | undefined;
  if (cfg.index.redisUrl) {
    try {
      transfer = openTransport(native.copyEngine.pool, native.copyEngine.ring, {
        transport: cfg.peer.transport,
        nics: cfg.peer.nics,
        qpsPerNic: cfg.peer.xferStreams,
        tcpStreams: cfg.peer.xferStreams,
        port: cfg.peer.xferPort,
      }, log);
    } catch (e) {
      // An explicit transport that cannot open, or a bad --nics: refuse to start.
      await ssd?.close();
      clearInterval(collector);
      await native.close();
      throw e;
    }
    registerTransferMetrics(metrics.registry, () => transfer?.endpoint);
    plog.info("transfer endpoint open", {
      transport: transfer.name,
      port: transfer.endpoint.info().port,
    });
  }
  // Opened once the gRPC port is known (below); the peer tier and service read it late.
  // deno-lint-ignore prefer-const
  let index: BlockIndexHandle | undefined;
  // The gRPC address once bound (peers are told the advertised one; this is its default).
  let boundGrpcAddr = cfg.addr;
  const checksum: ChecksumFn = (blocks) => poolChecksums(native.copyEngine.pool.handle, blocks);
  const peerLinks = new PeerLinks();
  const peerLocks = transfer
    ? new PeerLockTable({
      host: tierHost,
      ram: store,
      checksum,
      log: plog,
      defaultTtlMs: cfg.peer.lockTtlMs,
    })
    : undefined;
  let peerTier: PeerTier | undefined;
  const observeFetch = transfer
    ? registerPeerMetrics(metrics.registry, () => peerTier?.stats(), () => peerLocks?.stats())
    : undefined;
  if (transfer && cfg.peer.fetch) {
    if (transfer.name !== "tcp") {
      plog.error("peer fetch is off: over RDMA it needs the QP handshake, which is not built", {
        transport: transfer.name,
      });
    } else {
      peerTier = new PeerTier({
        host: tierHost,
        index: () => index?.index,
        endpoint: transfer.endpoint,
        links: peerLinks,
        checksum,
        log: plog,
        fetchTimeoutMs: cfg.peer.fetchTimeoutMs,
        stageMetrics: (stage) => metrics.stage(stage),
        onFetchDuration: observeFetch,
        beforeRead: readDelayHook(plog),
      });
    }
  }
  // The tiers below RAM, wired once through the Tier port: the engine hands
  // them sealed blocks (write-behind) and asks them on a RAM miss, SSD first.
  const lower = [
    ...(ssd ? [new SsdStorageTier(ssd, tierHost, log.child({ tier: "ssd" }))] : []),
    ...(peerTier ? [peerTier] : []),
  ];
  const tiers = lower.length > 0
    ? new LowerTiers({ ram: store, tiers: lower, stageMetrics: (stage) => metrics.stage(stage) })
    : undefined;
  if (tiers) registerTierMetrics(metrics.registry, tiers);
  const engine = new KvEngine({
    native,
    store,
    log,
    metrics,
    leaseTtlMs: cfg.leaseTtlMs,
    tiers,
    poolPartOf: placement ? (device) => placement.partOfDevice.get(device) : undefined,
  });
  engine.onSealed((_ns, keys) => metrics.sealed(keys.length));
  if (advertiser) engine.onSealed((ns, keys) => advertiser.onSealed(ns, keys));

  const server = new grpc.Server({
    "grpc.max_receive_message_length": cfg.maxMessageBytes,
    "grpc.max_send_message_length": cfg.maxMessageBytes,
    "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
    "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
    "grpc.keepalive_permit_without_calls": 1,
  });
  const impl = engineServiceImpl(engine, sessions, metrics, log);
  server.addService(lenientService(), impl);
  if (transfer && peerLocks) {
    const ep = transfer;
    server.addService(
      PeerService,
      peerServiceImpl(peerLocks, () => {
        // The listener binds every address; peers dial the advertised host.
        const adv = index?.index.advertiseAddr ?? boundGrpcAddr;
        return {
          transport: ep.name,
          addr: `${adv.slice(0, adv.lastIndexOf(":"))}:${ep.endpoint.info().port}`,
        };
      }, plog),
    );
  }
  // With the GOAWAY guard on, grpc-js listens on a loopback port that only
  // the guard connects to; the guard owns the public address and the Unix
  // socket (goaway_guard.ts). Without it grpc-js binds both itself.
  const closeCrossNode = async () => {
    peerLocks?.close();
    peerLinks.close();
    await transfer?.endpoint.close();
  };
  const cleanupOnListenError = async () => {
    clearInterval(collector);
    await tiers?.close();
    await closeCrossNode();
    await native.close();
  };
  const bindGrpc = (addr: string) =>
    new Promise<number>((resolve, reject) =>
      server.bindAsync(
        addr,
        grpc.ServerCredentials.createInsecure(),
        (err, p) => err ? reject(err) : resolve(p),
      )
    );
  const grpcPort = await bindGrpc(cfg.goawayGuard ? UPSTREAM_ADDR : cfg.addr).catch(async (e) => {
    await cleanupOnListenError();
    throw new Error(`--addr ${cfg.addr}: cannot listen: ${(e as Error).message}`);
  });
  const hostPart = cfg.addr.slice(0, cfg.addr.lastIndexOf(":"));
  let port = grpcPort;
  const guards: GoawayGuard[] = [];
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
  // Behind the guard, --uds clients are relayed to grpc-js over a second Unix
  // socket beside the public one (PATH.up): both legs of their relay skip the
  // TCP stack. Its name is fixed so a crashed server's is found and taken over
  // like the public one; only the server's user may connect to it.
  let upstreamSocket: BoundSocket | undefined;
  let localRpc: LocalRpcServer | undefined;
  let localRpcSocket: BoundSocket | undefined;
  const failListen = async (flag: string, e: unknown): Promise<never> => {
    for (const g of guards) await g.close();
    localRpc?.close();
    if (localRpcSocket) await releaseSocketPath(localRpcSocket);
    if (upstreamSocket) await releaseSocketPath(upstreamSocket);
    server.forceShutdown();
    await cleanupOnListenError();
    throw new Error(`${flag}: cannot listen: ${(e as Error).message}`);
  };
  if (cfg.goawayGuard) {
    try {
      guards.push(startGuard({
        hostname: hostPart.replace(/^\[(.*)\]$/, "$1"),
        port: Number(cfg.addr.slice(cfg.addr.lastIndexOf(":") + 1)),
      }, { upstreamHostname: UPSTREAM_HOST, upstreamPort: grpcPort }));
    } catch (e) {
      return await failListen(`--addr ${cfg.addr}`, e);
    }
    port = guards[0].port;
  }
  let uds: BoundSocket | undefined;
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
        upstreamSocket = await boundSocket(upstreamPath);
        await Deno.chmod(upstreamPath, UPSTREAM_SOCKET_MODE);
        guards.push(startGuard({ path }, { upstreamPath }));
      } else {
        await bindGrpc(`unix:${path}`);
      }
      uds = await boundSocket(path);
      // The engines' hot calls in frames beside it (local_rpc.ts), same handlers.
      const rpcPath = localRpcSocketPath(path);
      await claimSocketPath(rpcPath);
      localRpc = serveLocalRpc(
        Deno.listen({ transport: "unix", path: rpcPath }),
        impl,
        cfg.maxMessageBytes,
        log,
      );
      localRpcSocket = await boundSocket(rpcPath);
    } catch (e) {
      return await failListen(`--uds ${path}`, e);
    }
  }
  const host = hostPart;
  const grpcAddr = `${host}:${port}`;
  boundGrpcAddr = grpcAddr;

  let http: Deno.HttpServer | undefined;
  let httpAddr: string | undefined;
  if (cfg.httpAddr) {
    const i = cfg.httpAddr.lastIndexOf(":");
    const hostname = cfg.httpAddr.slice(0, i);
    const handler = httpHandler({
      engine,
      store,
      metrics,
      log,
      cleanup: async (id, reason) => {
        metrics.cleanup(reason);
        return await engine.unregister(id, reason);
      },
    });
    try {
      http = Deno.serve(
        { hostname, port: Number(cfg.httpAddr.slice(i + 1)), onListen: () => {} },
        handler,
      );
    } catch (e) {
      if (uds) await releaseSocketPath(uds);
      return await failListen(`--http-addr ${cfg.httpAddr}`, e);
    }
    const a = http.addr as Deno.NetAddr;
    httpAddr = `${hostname}:${a.port}`;
  }
  index = cfg.index.redisUrl && advertiser
    ? openBlockIndex(
      { ...cfg.index, redisUrl: cfg.index.redisUrl },
      grpcAddr,
      log,
      metrics.registry,
      advertiser,
    )
    : undefined;
  log.info("serving", {
    grpc: grpcAddr,
    uds: uds?.path,
    local_rpc: localRpc?.path,
    http: httpAddr,
    backend: native.backend,
  });

  let closing: Promise<void> | undefined;
  const close = () =>
    closing ??= (async () => {
      log.info("shutting down");
      sessions.endAll(SessionEvent_Kind.SHUTDOWN, "server is stopping");
      await engine.close();
      await index?.close();
      await tiers?.close();
      await closeCrossNode();
      // grpc-js's sockets are left to process exit on purpose: its
      // tryShutdown/forceShutdown send GOAWAY, and a Deno process receiving a
      // GOAWAY on a busy HTTP/2 session can abort inside nghttp2
      // (denoland/deno#36788; engines built on this SDK run on Deno). Every
      // instance is already cleaned up and every session ended: nothing is lost.
      if (http) await http.shutdown();
      // Closing the guard's sockets sends no GOAWAY: clients see the connection end.
      for (const g of guards) await g.close();
      // Left behind, the file would make the next start probe it as stale.
      localRpc?.close();
      if (uds) await releaseSocketPath(uds);
      if (localRpcSocket) await releaseSocketPath(localRpcSocket);
      if (upstreamSocket) await releaseSocketPath(upstreamSocket);
      clearInterval(collector);
      await native.close();
    })();
  return { grpcAddr, udsPath: uds?.path, httpAddr, engine, close };
}
