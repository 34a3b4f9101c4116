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
import { engineServiceImpl } from "./grpc_service.ts";
import { Sessions } from "./sessions.ts";
import { lenientService } from "./decode.ts";
import { SessionEvent_Kind } from "../../proto/pegaflow.ts";
import { httpHandler } from "./http.ts";
import { ServerMetrics } from "./metrics.ts";
import { MAX_PEER_LOCK_TTL_MS } from "../peer/locks.ts";
import { type Listeners, openListeners } from "./listeners.ts";
import { indexAdvertiser } from "../index/attach.ts";
import type { CrossNode } from "./cross_node.ts";
import type { LowerTiers } from "../storage/lower_tiers.ts";
import { closeNative, type EngineHold, type OpenedNative, openLowerTiers } from "./open_tiers.ts";
import { bindEarly, type EarlySockets } from "./early_bind.ts";
import type { SocketPathLock } from "./uds.ts";
import { Unwind } from "./unwind.ts";
import { HTTP_CLOSE_WAIT_MS, settlesWithin } from "../http/shutdown.ts";

/** HTTP/2 keepalive: ping an idle client every 30 s, drop it after 20 s of silence. */
const KEEPALIVE_TIME_MS = 30_000;
const KEEPALIVE_TIMEOUT_MS = 20_000;

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

/**
 * The store's transfer lock lifetime. Those locks back the peer locks
 * (granted for up to MAX_PEER_LOCK_TTL_MS; they expire and release on their
 * own timer) and the SSD writer's pins, so they must not expire first: at the
 * lease TTL, a short `--lease-ttl-ms` freed blocks a peer was still reading.
 */
export function transferLockTtlMs(leaseTtlMs: number): number {
  return Math.max(leaseTtlMs, MAX_PEER_LOCK_TTL_MS);
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
 * Starts everything described by `cfg`: the composition root. Every address
 * is probed first (early_bind.ts), so a taken port refuses the start before
 * the pinned pool is built (seconds); the sockets are bound once the server
 * can serve. On a failure what was opened is closed before the error (naming
 * the flag) goes up.
 *
 * `signal` stops a start (SIGINT/SIGTERM while the pool is built, main.ts):
 * once it aborts, the HTTP server bound early is closed at once, and the
 * start rejects with the abort's reason; what the start opens after that is
 * closed when it gets there.
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
  signal?: AbortSignal,
): Promise<RunningServer> {
  const early = await bindEarly(cfg, log);
  try {
    signal?.throwIfAborted();
    return await unlessAborted(startOn(early, cfg, log, signal), signal, log);
  } catch (e) {
    await early.close();
    throw e;
  }
}

/**
 * `started`, or its rejection with `signal`'s reason as soon as `signal`
 * aborts; a server that starts after that is closed in the background.
 */
async function unlessAborted(
  started: Promise<RunningServer>,
  signal: AbortSignal | undefined,
  log: Logger,
): Promise<RunningServer> {
  if (!signal) return await started;
  let onAbort = () => {};
  const aborted = new Promise<never>((_, reject) => {
    onAbort = () => reject(signal.reason);
    signal.addEventListener("abort", onAbort, { once: true });
  });
  try {
    return await Promise.race([started, aborted]);
  } catch (e) {
    if (signal.aborted) {
      started.then((s) => s.close(), () => {}).catch((err) =>
        log.warn("closing a server started after its start was stopped failed", {
          error: (err as Error).message,
        })
      );
    }
    throw e;
  } finally {
    signal.removeEventListener("abort", onAbort);
  }
}

/**
 * The rest of the start, the HTTP server `early` bound answering 503 until
 * it is ready. Each piece is its own function or module (openStorage,
 * openLowerTiers, openListeners, stopServer); what each opens is recorded
 * on one stack, and any failure — before or after the listeners are bound —
 * closes all of it, last opened first, before the error goes up (`early`,
 * the HTTP server and the `--uds` lock, is the caller's).
 */
async function startOn(
  early: EarlySockets,
  cfg: ServeConfig,
  log: Logger,
  signal: AbortSignal | undefined,
): Promise<RunningServer> {
  const opened = new Unwind(log);
  try {
    const core = await openCore(cfg, log, opened);
    return await serveOn(core, early, cfg, log, signal, opened);
  } catch (e) {
    await opened.close();
    throw e;
  }
}

/** What serves requests: storage, tiers, engine, sessions and metrics. */
interface Core {
  native: OpenedNative;
  store: KvStore;
  cross: CrossNode;
  tiers: LowerTiers | undefined;
  engine: KvEngine;
  sessions: Sessions;
  metrics: ServerMetrics;
  collector: ReturnType<typeof setInterval>;
  ssdHold: EngineHold[];
}

/** Storage, the tiers below it and the engine over them, each recorded on `opened`. */
async function openCore(cfg: ServeConfig, log: Logger, opened: Unwind): Promise<Core> {
  const ssdHold: EngineHold[] = [];
  const { native, placement, store, advertiser, collector } = await openStorage(
    cfg,
    log,
    opened,
    ssdHold,
  );
  const sessions = new Sessions({ graceMs: cfg.sessionGraceMs });
  // The gauges read the engine at scrape time, by which point it exists.
  const metrics: ServerMetrics = new ServerMetrics(() => store.stats(), {
    instances: () => engine.instances().length,
    sessions: () => sessions.count,
    prefetchWaits: () => engine.prefetchWaits,
  });
  metrics.devicesServed(native.devices);
  const { cross, tiers } = await openLowerTiers(
    cfg,
    native,
    store,
    advertiser,
    metrics,
    log,
    ssdHold,
  );
  opened.push("cross-node endpoint", () => cross.close());
  opened.push("lower tiers", () => tiers?.close());
  const engine = newEngine(cfg, { native, placement, store, advertiser }, tiers, metrics, log);
  // Once the listeners are bound, an engine may register before a later step fails.
  opened.push("sessions and engine", () => {
    sessions.endAll(SessionEvent_Kind.SHUTDOWN, "the server's start failed");
    return engine.close();
  });
  return { native, store, cross, tiers, engine, sessions, metrics, collector, ssdHold };
}

/**
 * Binds the listeners, hands the HTTP server its handler and opens the
 * block index (it needs the bound gRPC address), each recorded on `opened`.
 */
async function serveOn(
  core: Core,
  early: EarlySockets,
  cfg: ServeConfig,
  log: Logger,
  signal: AbortSignal | undefined,
  opened: Unwind,
): Promise<RunningServer> {
  const { engine, sessions, metrics, cross, store } = core;
  const server = grpcServer(cfg.maxMessageBytes);
  const impl = engineServiceImpl(engine, sessions, metrics, log);
  server.addService(lenientService(), impl);
  cross.addServices(server);
  signal?.throwIfAborted(); // stopped while the pool was built: nothing serves
  const listeners = await openListeners(server, impl, cfg, metrics, log);
  opened.push("gRPC server", () => server.forceShutdown());
  opened.push("gRPC and local RPC listeners", () => listeners.close());
  const grpcAddr = listeners.grpcAddr;
  // The HTTP side answered 503 `starting` until now.
  early.http?.serve(httpHandler({
    engine,
    store,
    metrics,
    log,
    cleanup: async (id, reason) => {
      metrics.cleanup(reason);
      return await engine.unregister(id, reason);
    },
  }));
  opened.push("HTTP server", () => early.http?.close());
  opened.push("block index", () => cross.closeIndex());
  cross.openIndex(grpcAddr); // throws naming --index-redis
  log.info("serving", {
    grpc: grpcAddr,
    uds: listeners.udsPath,
    local_rpc: listeners.localRpcPath,
    http: early.http?.addr,
    backend: core.native.backend,
  });
  let closing: Promise<void> | undefined;
  const close = () =>
    closing ??= stopServer({
      ...core,
      log,
      http: early.http?.server,
      udsLock: early.udsLock,
      listeners,
    });
  return { grpcAddr, udsPath: listeners.udsPath, httpAddr: early.http?.addr, engine, close };
}

/** The KV engine over the storage and the tiers; what it seals is counted and advertised. */
function newEngine(
  cfg: ServeConfig,
  storage: Pick<
    Awaited<ReturnType<typeof openStorage>>,
    "native" | "placement" | "store" | "advertiser"
  >,
  tiers: LowerTiers | undefined,
  metrics: ServerMetrics,
  log: Logger,
): KvEngine {
  const { native, placement, store, advertiser } = storage;
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
  return engine;
}

/** The gRPC server: message size limits and HTTP/2 keepalive. */
function grpcServer(maxMessageBytes: number): grpc.Server {
  return new grpc.Server({
    "grpc.max_receive_message_length": maxMessageBytes,
    "grpc.max_send_message_length": maxMessageBytes,
    "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
    "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
    "grpc.keepalive_permit_without_calls": 1,
  });
}

/** Graceful stop, in dependency order: sessions, engine, index, tiers, sockets, `--uds` lock, native. */
async function stopServer(
  s: Core & {
    log: Logger;
    http: Deno.HttpServer | undefined;
    udsLock: SocketPathLock | undefined;
    listeners: Listeners;
  },
): Promise<void> {
  s.log.info("shutting down");
  s.sessions.endAll(SessionEvent_Kind.SHUTDOWN, "server is stopping");
  await s.engine.close();
  await s.cross.closeIndex();
  await s.tiers?.close();
  await s.cross.close();
  // grpc-js's sockets are left to process exit on purpose: its
  // tryShutdown/forceShutdown send GOAWAY, and a Deno process receiving a
  // GOAWAY on a busy HTTP/2 session can abort inside nghttp2
  // (denoland/deno#36788; engines built on this SDK run on Deno). Every
  // instance is already cleaned up and every session ended: nothing is lost.
  if (s.http && !(await settlesWithin(s.http.shutdown(), HTTP_CLOSE_WAIT_MS))) {
    s.log.warn("HTTP connections still open at shutdown (a client stalled mid-request); stopping", {
      wait_ms: HTTP_CLOSE_WAIT_MS,
    });
  }
  // Closing the guard's sockets sends no GOAWAY: clients see the connection end.
  await s.listeners.close();
  // Its socket files are gone: the next server on the path may start.
  await s.udsLock?.release();
  clearInterval(s.collector);
  await closeNative(s.native, s.ssdHold, s.log);
}

/**
 * The pinned pool (one engine per served device) and the block store over
 * it, each recorded on `opened` (the pool is freed unless an engine of
 * `ssdHold` still holds it).
 */
async function openStorage(
  cfg: ServeConfig,
  log: Logger,
  opened: Unwind,
  ssdHold: readonly EngineHold[],
) {
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
  const served = resolveDevices(cfg.backend, cfg.devices, log);
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
  opened.push("pinned pool and native engines", () => closeNative(native, ssdHold, log));
  log.info("pinned pool ready", { backend: native.backend, pool_bytes: native.poolBytes });
  const unitBytes = allocationUnit(cfg.hintValueSize);
  // Cross-node index: seal and evict events feed it; it starts once the gRPC port is known.
  const advertiser = cfg.index.redisUrl ? indexAdvertiser(log) : undefined;
  const store = new KvStore({
    capacityBytes: native.poolBytes,
    unitBytes,
    parts: placement?.parts.map((p) => p.bytes),
    leaseTtlMs: cfg.leaseTtlMs,
    transferLockTtlMs: transferLockTtlMs(cfg.leaseTtlMs),
    // Sketch sized for the blocks the pool can hold at the hinted (or a typical 32 KiB) segment size.
    lfuCapacityBlocks: cfg.enableLfuAdmission
      ? Math.max(1024, Math.floor(native.poolBytes / (cfg.hintValueSize || TYPICAL_SEGMENT_BYTES)))
      : undefined,
    onEvict: advertiser ? (ns, hash) => advertiser.onEvicted(ns, hash) : undefined,
  });
  // Leases expire and stale inflight blocks are collected on every store call;
  // the timer covers an idle server so pins do not outlive their TTL.
  const collector = setInterval(() => store.collect(), COLLECT_INTERVAL_MS);
  opened.push("store collector timer", () => clearInterval(collector));
  log.info("store ready", {
    unit_bytes: unitBytes,
    lfu_admission: cfg.enableLfuAdmission,
    lease_ttl_ms: cfg.leaseTtlMs,
  });
  return { native, placement, store, advertiser, collector };
}
