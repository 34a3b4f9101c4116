/**
 * Binds the engine's {@link NativePort} to ffi/: one CopyEngine (engine +
 * pinned pool + completion ring) per server process, region imports, shm
 * control blocks, and a reusable CopyBatch that grows to the largest batch
 * seen (so steady state allocates nothing per request).
 *
 * @module
 */
import {
  CopyBatch,
  CopyEngine,
  type Engine,
  NativeError,
  PF_STATUS,
  type PoolPart,
  type PoolProgress,
  SharedMemory,
} from "../../ffi/mod.ts";
import type { Logger } from "../log.ts";
import { forcedPath, PathPolicy, type TransferPathFlag } from "../copy_path.ts";
import { calibrationKey, loadOrMeasure, measureCalibration } from "../copy_calibration.ts";
import {
  type BatchWriter,
  type BatchWriterOptions,
  ClientMemoryFault,
  type CopyDirection,
  type CopyDone,
  type NativePort,
  type RegionPort,
  type ShmPort,
} from "./ports.ts";

/** A copy batch that ended with a native error; `status` is the PF_E* code. */
export class CopyFailed extends Error {
  readonly status: number;
  constructor(status: number, message: string) {
    super(message);
    this.name = "CopyFailed";
    this.status = status;
  }
}

/** Runs a native call; a fault on client memory becomes a {@link ClientMemoryFault}. */
function guarded<T>(fn: () => T): T {
  try {
    return fn();
  } catch (e) {
    if (e instanceof NativeError && e.code === PF_STATUS.PF_EFAULT) {
      throw new ClientMemoryFault(e.code, e.message);
    }
    throw e;
  }
}

const GIB = 1 << 30;

/** One "pool creation" log line's fields: how far, how fast, which device. */
function progressFields(p: PoolProgress) {
  const secs = p.elapsedMs / 1000;
  return {
    backend: p.backend,
    device: p.device,
    phase: p.phase,
    touched_bytes: p.touchedBytes,
    total_bytes: p.totalBytes,
    percent: p.totalBytes ? Math.floor((100 * p.touchedBytes) / p.totalBytes) : 0,
    gib_per_s: secs > 0 ? Math.round((p.touchedBytes / GIB / secs) * 100) / 100 : 0,
    elapsed_ms: Math.round(p.elapsedMs),
  };
}

/** Options of {@link openNative}. */
export interface NativeOptions {
  backend: "auto" | "cuda" | "host";
  /** Devices to serve; the first owns the pool. */
  devices: readonly number[];
  /** Test hook: devices whose copies fail from the start (see pf_engine_fail). */
  failDevices?: readonly number[];
  /** NUMA split of the pool (lib/numa.ts); absent = one part. */
  poolParts?: readonly PoolPart[];
  poolBytes: number;
  useHugepages: boolean;
  transferPath: TransferPathFlag;
  /** Calibration cache file (`--calibration-file`); undefined = measure every start. */
  calibrationFile?: string;
  /** Measure even when the cache has this device (`--recalibrate`). */
  recalibrate?: boolean;
  /** Period of the pool-creation progress log lines, ms (default 1000). */
  poolProgressMs?: number;
}

/** First descriptor capacity; grows by doubling. */
const INITIAL_GROUPS = 64;
const INITIAL_SEGS = 4096;

/**
 * The engine's batch writer: grows its CopyBatch to the largest batch seen,
 * so steady state allocates nothing per request. Segments arrive merged
 * (lib/transfer/plan.ts writes through the one range merger).
 */
class GrowingBatch implements BatchWriter {
  batch: CopyBatch;
  /** The device of the regions of the batch being written (its first group's). */
  device = -1;
  constructor() {
    this.batch = new CopyBatch(INITIAL_GROUPS, INITIAL_SEGS);
  }
  ensure(groups: number, segs: number): void {
    if (groups <= this.batch.maxGroups && segs <= this.batch.maxSegs) return;
    let g = this.batch.maxGroups;
    let s = this.batch.maxSegs;
    while (g < groups) g *= 2;
    while (s < segs) s *= 2;
    this.batch = new CopyBatch(g, s);
  }
  reset(
    direction: CopyDirection,
    progress?: { shm: ShmPort; offset: number },
    opts: BatchWriterOptions = {},
  ): void {
    // The path is set at submit, once the segments are known (PathPolicy).
    this.batch.reset(
      direction === "gather" ? "d2h" : "h2d",
      "host",
      progress ? { shm: progress.shm.handle, offset: progress.offset } : undefined,
      opts,
    );
    this.device = -1;
  }
  group(region: RegionPort, layerId: number): void {
    if (this.device === -1) this.device = region.device;
    else if (this.device !== region.device) {
      throw new Error(
        `a copy batch mixes regions of devices ${this.device} and ${region.device}; a batch is one rank's`,
      );
    }
    this.batch.group(region.handle, layerId);
  }
  seg(regionOff: number, poolOff: number, bytes: number): void {
    this.batch.seg(regionOff, poolOff, bytes);
  }
  get numSegs(): number {
    return this.batch.numSegs;
  }
}

/**
 * Opens the native side for the server. The pool is created off the JS
 * thread: pre-touching tens of GiB takes seconds, and a progress line
 * ("pool creation progress") is logged every `poolProgressMs` meanwhile so an
 * operator sees the server is alive and how far it got.
 *
 * @example
 * ```ts
 * const native = await openNative({ backend: "host", devices: [0], poolBytes: 1 << 30,
 *   useHugepages: false, transferPath: "auto" }, log);
 * ```
 */
export async function openNative(
  opts: NativeOptions,
  log: Logger,
): Promise<NativePort & { copyEngine: CopyEngine }> {
  log.info("creating pinned pool", {
    backend: opts.backend,
    devices: opts.devices.join(","),
    pool_bytes: opts.poolBytes,
    hugepages: opts.useHugepages,
  });
  const ce = await CopyEngine.openAsync({
    backend: opts.backend,
    device: opts.devices[0],
    moreDevices: opts.devices.slice(1),
    poolBytes: opts.poolBytes,
    hugepages: opts.useHugepages,
    pretouch: true,
    parts: opts.poolParts,
  }, {
    intervalMs: opts.poolProgressMs ?? 1000,
    onProgress: (p) => log.info("pool creation progress", progressFields(p)),
  });
  const info = ce.pool.info();
  log.info("native engine open", {
    backend: ce.engine.backend,
    devices: [...ce.engines.keys()].join(","),
    device_name: ce.engine.deviceName,
    driver_version: ce.engine.driverVersion,
    kernel: ce.engine.features.kernel,
    dma_batch: ce.engine.features.dmaBatch,
    pool_bytes: info.bytes,
    hugepages: info.hugepages,
    locked: info.locked,
    pool_alloc_ms: Math.round(info.allocNs / 1e6),
  });
  let policies: Map<number, PathPolicy>;
  try {
    // Calibrate first: a device failed by the test hook would measure nothing.
    policies = openPathPolicies(ce, opts, log);
    for (const d of opts.failDevices ?? []) {
      const en = ce.engines.get(d);
      if (!en) throw new Error(`PEGAFLOW_TEST_FAIL_DEVICES names device ${d}, which is not served`);
      en.fail(PF_STATUS.PF_EIO);
      log.warn("device marked failed by the test hook", { device: d });
    }
  } catch (e) {
    await ce.close();
    throw e;
  }
  return portOver(ce, policies);
}

/**
 * The engine's {@link NativePort} over an open CopyEngine; the policy of the
 * batch's device stamps its copy path at submit.
 */
function portOver(
  ce: CopyEngine,
  policies: ReadonlyMap<number, PathPolicy>,
): NativePort & { copyEngine: CopyEngine } {
  const first = policies.get(ce.engine.device)!;
  return {
    copyEngine: ce,
    backend: ce.engine.backend,
    poolBytes: ce.pool.bytes,
    devices: [...ce.engines.keys()],
    importRegion(handle: Uint8Array, bytes: number, device: number): RegionPort {
      const engine = ce.engines.get(device);
      if (!engine) {
        throw new Error(
          `device ${device} is not served (serves ${[...ce.engines.keys()].join(",")})`,
        );
      }
      const r = engine.importRegion(handle, bytes);
      return { handle: r.id, device, close: () => r.close() };
    },
    openShm(name: string, bytes: number): ShmPort {
      // The engine owns this object and may shrink it at any time: only the
      // guarded read/write touch it, never a view.
      const shm = SharedMemory.open(name, bytes);
      return {
        handle: shm.handle,
        read: (off, dst) => guarded(() => shm.read(off, dst)),
        write: (off, src) => guarded(() => shm.write(off, src)),
        same: () => shm.same(),
        close: () => shm.close(),
      };
    },
    batch(): BatchWriter {
      return new GrowingBatch();
    },
    // Not async on purpose: a batch the library refuses (bad segment, closed
    // region) throws here, synchronously, so the RPC fails instead of
    // answering OK for a copy that never started.
    submit(b: BatchWriter): Promise<CopyDone> {
      const gb = b as GrowingBatch;
      const batch = gb.batch;
      // Segments arrive merged (lib/transfer/ranges.ts), so this is the mean
      // range the copy path will see.
      const policy = gb.device === -1 ? first : policies.get(gb.device) ?? first;
      batch.setPath(policy.choose(batch.direction, batch.bytes / Math.max(1, batch.numSegs)));
      // Quiet: nothing here watches a batch's groups land (an engine watches
      // its load's progress words), so the ring carries one record a batch.
      const done = guarded(() => ce.submitQuiet(batch, gb.device === -1 ? undefined : gb.device));
      return done.then((r) => {
        if (r.status === PF_STATUS.PF_EFAULT) {
          throw new ClientMemoryFault(r.status, r.error ?? "client memory faulted");
        }
        if (r.status !== 0) {
          throw new CopyFailed(
            r.status,
            r.error ?? `copy batch failed with native status ${r.status}`,
          );
        }
        return { bytes: r.bytes, ns: r.ns };
      });
    },
    close(): Promise<void> {
      return ce.close();
    },
  };
}

/**
 * One path policy per served device. Devices of one GPU model and driver
 * share a calibration (its cache key), measured once per start at most.
 */
function openPathPolicies(
  ce: CopyEngine,
  opts: NativeOptions,
  log: Logger,
): Map<number, PathPolicy> {
  const byKey = new Map<string, PathPolicy>();
  const out = new Map<number, PathPolicy>();
  for (const [device, engine] of ce.engines) {
    const key = engine.backend === "host" ? "host" : calibrationKey(engine.props());
    let policy = byKey.get(key);
    if (!policy) {
      policy = openPathPolicy(ce, engine, opts, log.child({ device }));
      byKey.set(key, policy);
    }
    out.set(device, policy);
  }
  return out;
}

/**
 * The path policy for one engine: `host` on the host backend (memcpy, the
 * path is ignored); the forced path when `--transfer-path` names one; else
 * calibrated — from the cache file when it has this device, measured
 * otherwise (seconds, before the pool holds anything).
 */
function openPathPolicy(
  ce: CopyEngine,
  engine: Engine,
  opts: NativeOptions,
  log: Logger,
): PathPolicy {
  if (engine.backend === "host") {
    log.info("copy path policy", {
      backend: "host",
      path: "host",
      transfer_path: opts.transferPath,
    });
    return new PathPolicy({}, { backend: "host" });
  }
  const force = forcedPath(opts.transferPath, engine.features);
  if (force === "kernel" && !engine.features.kernel) {
    throw new Error(
      "--transfer-path kernel: this libpegaflow has no copy kernel (built without nvcc); " +
        "use --transfer-path auto or dma, or rebuild with `make native` where nvcc exists",
    );
  }
  if (force) {
    log.info("copy path policy", { path: force, source: "--transfer-path" });
    return new PathPolicy({}, { force });
  }
  const props = engine.props();
  const started = performance.now();
  let loaded;
  try {
    loaded = loadOrMeasure(props, {
      file: opts.calibrationFile,
      recalibrate: opts.recalibrate ?? false,
      measure: () => measureCalibration(engine, ce.pool),
    });
  } catch (e) {
    // Measuring needs scratch GPU memory (twice the bytes per point), which an engine that
    // already took most of the device may leave no room for. Serve anyway, on the copy
    // engines: no SMs taken, and at or near the link rate from 32 KB segments up.
    if (!(e instanceof NativeError)) throw e;
    const fallback = forcedPath("dma", engine.features)!;
    log.warn("copy path calibration failed; every batch takes the copy engines", {
      path: fallback,
      error: e.message,
      hint: "restart with --recalibrate once the GPU has room",
    });
    return new PathPolicy({}, { force: fallback });
  }
  if (loaded.cacheError) log.warn("calibration cache not used", { error: loaded.cacheError });
  const policy = new PathPolicy(loaded.tables);
  log.info("copy path policy", {
    source: loaded.source,
    key: calibrationKey(props),
    file: opts.calibrationFile ?? null,
    ms: Math.round(performance.now() - started),
    ...policy.summary(),
  });
  return policy;
}
