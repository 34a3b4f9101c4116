/**
 * The server's cross-node pieces (docs/peer.md), wired in one place: where
 * the block index runs (`--index-redis`), this node opens a transfer endpoint
 * over its pool, grants transfer locks to peers (the `Peer` service, on gRPC
 * and on the peer RPC socket, `--peer-rpc-port`) and — unless `--peer-fetch
 * false` — fetches from peers on a local miss (the peer tier). The index
 * itself opens once the gRPC address is known.
 *
 * @module
 */
import type * as grpc from "@grpc/grpc-js";
import type { Logger } from "../log.ts";
import type { ServeConfig } from "./config.ts";
import type { ServerMetrics } from "./metrics.ts";
import type { NativePort } from "../engine/ports.ts";
import type { KvStore } from "../storage/store.ts";
import type { TierHost } from "../storage/tier.ts";
import { type BlockIndexHandle, openBlockIndex } from "../index/attach.ts";
import type { IndexAdvertiser } from "../index/advertiser.ts";
import { redisWhere } from "../index/connection.ts";
import type { CopyEngine } from "../../ffi/mod.ts";
import { type OpenedTransport, openTransport } from "../transfer/transport.ts";
import { registerTransferMetrics } from "../transfer/metrics.ts";
import { poolChecksums } from "../../ffi/uring.ts";
import { type ChecksumFn, PeerLockTable } from "../peer/locks.ts";
import { PeerLinks } from "../peer/link.ts";
import { PeerTier } from "../peer/peer_tier.ts";
import { type LenderEndpoint, TransferLender } from "../peer/lender.ts";
import { registerPeerMetrics } from "../peer/metrics.ts";
import { peerServiceImpl } from "../peer/service.ts";
import { lenientPeerService } from "./decode.ts";
import { listenPeerRpc } from "./early_bind.ts";
import { servePeerRpc } from "./local_rpc.ts";

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

/** This node's RAM as the cross-node pieces use it. */
export interface CrossNodeRam {
  store: KvStore;
  /** What the peer tier fills and pins through. */
  tierHost: TierHost;
  /** Drops blocks found damaged here from RAM and the tiers below (lib/peer/damage_report.ts). */
  condemn: (namespace: string, hashes: readonly Uint8Array[]) => void;
}

/** The opened cross-node pieces. */
export interface CrossNode {
  /** The peer tier (a tier below RAM), when this node fetches from peers. */
  readonly peerTier: PeerTier | undefined;
  /** Adds the `Peer` service (this node lends blocks) to the gRPC server. */
  addServices(server: grpc.Server): void;
  /**
   * Opens the block index, advertising `grpcAddr` unless `--advertise-addr`
   * says otherwise. Throws naming `--index-redis` when the index cannot be
   * made (a URL its client cannot parse: `redis://u:%zz@h:6379`); an
   * unreachable Redis is no error (it connects in the background).
   */
  openIndex(grpcAddr: string): void;
  /** Stops advertising (first, while the tiers still run). */
  closeIndex(): Promise<void>;
  /** Closes the locks, the links to other nodes and the transfer endpoint. */
  close(): Promise<void>;
}

/**
 * Opens what `cfg` asks for; nothing at all without `--index-redis`. Throws
 * when an explicitly named transport cannot open (the server must not start),
 * naming the flags (the peer RPC port, `--peer-rpc-port`, was probed before
 * the pool was built, early_bind.ts; it is bound here, and one taken since
 * refuses the start naming the flag).
 * A flat wiring list (endpoint → locks → tier → the object the server
 * drives), each step reading what the one before it opened.
 *
 * long function: that list, in the order things open; the steps with more
 * than a constructor call are functions below.
 *
 * @example
 * ```ts
 * const cross = openCrossNode(cfg, native, { store, tierHost, condemn }, advertiser, metrics, log);
 * cross.addServices(server);
 * cross.openIndex("10.0.0.5:50055");
 * ```
 */
export function openCrossNode(
  cfg: ServeConfig,
  native: NativePort & { copyEngine: CopyEngine },
  ram: CrossNodeRam,
  advertiser: IndexAdvertiser | undefined,
  metrics: ServerMetrics,
  log: Logger,
): CrossNode {
  const { store, tierHost } = ram;
  const plog = log.child({ component: "peer" });
  const { rpcListener, transfer } = cfg.index.redisUrl
    ? openPeerListeners(cfg, native.copyEngine, metrics, log, plog)
    : { rpcListener: undefined, transfer: undefined };
  let index: BlockIndexHandle | undefined;
  // The gRPC address once bound (peers are told the advertised one; this is its default).
  let boundGrpcAddr = cfg.addr;
  const checksum: ChecksumFn = (blocks) => poolChecksums(native.copyEngine.pool.handle, blocks);
  const peerLinks = new PeerLinks(plog);
  const peerLocks = transfer
    ? new PeerLockTable({
      host: tierHost,
      ram: store,
      checksum,
      log: plog,
      defaultTtlMs: cfg.peer.lockTtlMs,
      condemn: ram.condemn,
    })
    : undefined;
  const advertised = () => index?.index.advertiseAddr ?? boundGrpcAddr;
  const lending = transfer && peerLocks && rpcListener
    ? openLending(cfg, transfer, peerLocks, rpcListener, advertised, plog)
    : undefined;
  let peerTier: PeerTier | undefined;
  const observeFetch = transfer
    ? registerPeerMetrics(
      metrics.registry,
      () => peerTier?.stats(),
      () => peerLocks?.stats(),
      () => peerLinks.stats(),
    )
    : undefined;
  if (transfer && cfg.peer.fetch) {
    peerTier = new PeerTier({
      host: tierHost,
      index: () => index?.index,
      endpoint: transfer.endpoint,
      transport: transfer.name,
      links: peerLinks,
      checksum,
      log: plog,
      fetchTimeoutMs: cfg.peer.fetchTimeoutMs,
      stageMetrics: (stage) => metrics.stage(stage),
      onFetchDuration: observeFetch,
      beforeRead: readDelayHook(plog),
    });
  }
  return {
    peerTier,
    addServices(server) {
      if (lending) server.addService(lenientPeerService(), lending.impl);
    },
    openIndex(grpcAddr) {
      boundGrpcAddr = grpcAddr;
      if (!cfg.index.redisUrl || !advertiser) return;
      try {
        index = openBlockIndex(
          { ...cfg.index, redisUrl: cfg.index.redisUrl },
          grpcAddr,
          log,
          metrics.registry,
          advertiser,
        );
      } catch (e) {
        throw cannotOpenIndex(cfg.index.redisUrl, e);
      }
    },
    async closeIndex() {
      await index?.close();
    },
    async close() {
      lending?.rpc.close();
      peerLocks?.close();
      peerLinks.close();
      await lending?.lender.close();
      await transfer?.endpoint.close();
    },
  };
}

/**
 * What a block index that cannot be made is refused with: `--index-redis`
 * and where it points (credentials left out: they go to the log), then why.
 */
function cannotOpenIndex(redisUrl: string, e: unknown): Error {
  // ioredis percent-decodes the user and password: a stray `%` throws URIError.
  const hint = e instanceof URIError
    ? " (a % in the user or password that does not start a %XX escape: write it as %25)"
    : "";
  return new Error(
    `--index-redis ${redisWhere(redisUrl)}: cannot open the block index: ${
      (e as Error).message
    }${hint}`,
  );
}

/** The peer RPC listener, then the transfer endpoint; both or (throwing) neither. */
function openPeerListeners(
  cfg: ServeConfig,
  copyEngine: CopyEngine,
  metrics: ServerMetrics,
  log: Logger,
  plog: Logger,
): { rpcListener: Deno.TcpListener; transfer: OpenedTransport } {
  // Bound first: a --peer-rpc-port taken since it was probed refuses the start
  // before anything else opens.
  const rpcListener = listenPeerRpc(cfg.peer.rpcPort);
  plog.info("peer RPC open", { port: rpcListener.addr.port });
  try {
    return { rpcListener, transfer: openPeerTransport(cfg, copyEngine, metrics, log, plog) };
  } catch (e) {
    rpcListener.close();
    throw e;
  }
}

/**
 * The transfer endpoint over the pool (`--transport`, `--nics`, ...), with
 * its metrics. Throws naming the flags it was opened with.
 */
function openPeerTransport(
  cfg: ServeConfig,
  copyEngine: CopyEngine,
  metrics: ServerMetrics,
  log: Logger,
  plog: Logger,
): OpenedTransport {
  let transfer: OpenedTransport;
  try {
    transfer = openTransport(copyEngine.pool, copyEngine.ring, {
      transport: cfg.peer.transport,
      nics: cfg.peer.nics,
      qpsPerNic: cfg.peer.xferStreams,
      tcpStreams: cfg.peer.xferStreams,
      port: cfg.peer.xferPort,
    }, log);
  } catch (e) {
    const noFallback = cfg.peer.transport === "rdma"
      ? " (--transport rdma never falls back to TCP; --transport auto does)"
      : "";
    throw new Error(
      `${transportFlags(cfg.peer)}: cannot open the transfer endpoint: ${(e as Error).message}` +
        noFallback,
    );
  }
  registerTransferMetrics(metrics.registry, () => transfer.endpoint);
  plog.info("transfer endpoint open", {
    transport: transfer.name,
    port: transfer.endpoint.info().port,
  });
  return transfer;
}

/**
 * The flags that shaped the transfer endpoint, as given: `--transport`, the
 * TCP port unless RDMA alone was asked for, the RDMA devices unless TCP was.
 */
function transportFlags(peer: ServeConfig["peer"]): string {
  const flags = [`--transport ${peer.transport}`];
  if (peer.transport !== "rdma") flags.push(`--xfer-port ${peer.xferPort}`);
  if (peer.transport !== "tcp" && peer.nics.length > 0) flags.push(`--nics ${peer.nics.join(",")}`);
  return flags.join(" ");
}

/**
 * This node's lending side: the handshake's lender, the `Peer` handlers
 * (served on gRPC by `addServices`) and the peer RPC socket serving them.
 */
function openLending(
  cfg: ServeConfig,
  transfer: OpenedTransport,
  locks: PeerLockTable,
  listener: Deno.TcpListener,
  advertised: () => string,
  plog: Logger,
) {
  const lender = new TransferLender(
    lenderEndpoint(transfer, listener, advertised),
    cfg.peer.fetchTimeoutMs,
    plog,
  );
  const impl = peerServiceImpl(
    locks,
    () => ({ transport: transfer.name, addr: xferAddr(transfer, advertised) }),
    lender,
    plog,
  );
  return { lender, impl, rpc: servePeerRpc(listener, impl, cfg.maxMessageBytes, plog) };
}

/** `port` on the advertised host: how peers dial this node's listeners (each binds every address). */
function advertisedPort(advertisedGrpcAddr: () => string, port: number): string {
  const adv = advertisedGrpcAddr();
  return `${adv.slice(0, adv.lastIndexOf(":"))}:${port}`;
}

/** The transfer listener as peers dial it. */
function xferAddr(transfer: OpenedTransport, advertisedGrpcAddr: () => string): string {
  return advertisedPort(advertisedGrpcAddr, transfer.endpoint.info().port);
}

/** The endpoint as the handshake's lender sees it (lib/peer/lender.ts). */
function lenderEndpoint(
  transfer: OpenedTransport,
  rpc: Deno.TcpListener,
  advertisedGrpcAddr: () => string,
): LenderEndpoint {
  return {
    transport: transfer.name,
    addr: () => xferAddr(transfer, advertisedGrpcAddr),
    rpcAddr: () => advertisedPort(advertisedGrpcAddr, rpc.addr.port),
    createPeer: () => transfer.endpoint.createPeer(),
  };
}
