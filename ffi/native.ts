/**
 * Thin typed wrappers over libpegaflow's objects: {@link Engine},
 * {@link Pool}, {@link Region}, {@link SharedMemory}, and the
 * {@link NativeError} every failing call throws. No policy lives here.
 *
 * @module
 */
import { loadLibrary, type PegaflowSymbols } from "./symbols.ts";
import {
  decodeEngineProps,
  decodePoolProps,
  decodeRegionProps,
  ENGINE_PROPS_BYTES,
  type EngineProps,
  POOL_PROPS_BYTES,
  type PoolInfo,
  REGION_PROPS_BYTES,
  type RegionInfo,
} from "./structs.ts";

/** `PF_E*` status codes of `pegaflow.h`, by name. */
export const PF_STATUS = {
  PF_OK: 0,
  PF_EINVAL: -1,
  PF_EHANDLE: -2,
  PF_ERANGE: -3,
  PF_ENOMEM: -4,
  PF_ENODEV: -5,
  PF_EBUSY: -6,
  PF_ECUDA: -7,
  PF_EIO: -8,
  PF_ESHUTDOWN: -9,
  PF_ETIMEDOUT: -10,
  PF_EUNSUPPORTED: -11,
  PF_EOVERFLOW: -12,
  PF_EFAULT: -13,
  PF_ECANCELED: -14,
} as const;

/** One of the `PF_E*` names (or `PF_OK`). */
export type StatusName = keyof typeof PF_STATUS;

const STATUS_NAMES = new Map<number, StatusName>(
  Object.entries(PF_STATUS).map(([k, v]) => [v, k as StatusName]),
);

/** Maps a status code to its `PF_E*` name (`"PF_E?<code>"` if unknown). */
export function statusName(code: number): string {
  return STATUS_NAMES.get(code) ?? `PF_E?${code}`;
}

const ERR_BUF = new Uint8Array(1024);
const DECODER = new TextDecoder();

/** The calling thread's last libpegaflow error message. */
export function lastError(): string {
  const n = loadLibrary().pf_last_error(ERR_BUF, ERR_BUF.length);
  return DECODER.decode(ERR_BUF.subarray(0, Math.min(n, ERR_BUF.length - 1)));
}

/**
 * A libpegaflow call failed. `code` is the `PF_E*` number, `codeName` its
 * name, and the message is the library's own (it names the function, the
 * object, and expected vs got values).
 *
 * @example
 * ```ts
 * try { engine.importRegion(handle, 1024); }
 * catch (e) { if (e instanceof NativeError && e.codeName === "PF_EHANDLE") {} }
 * ```
 */
export class NativeError extends Error {
  /** The `PF_E*` status code (negative). */
  readonly code: number;
  /** The status code's name, e.g. `"PF_ERANGE"`. */
  readonly codeName: string;
  /** The libpegaflow function that failed. */
  readonly fn: string;

  constructor(fn: string, code: number, message: string) {
    super(`${fn} failed with ${statusName(code)}: ${message}`);
    this.name = "NativeError";
    this.fn = fn;
    this.code = code;
    this.codeName = statusName(code);
  }
}

/** Throws a {@link NativeError} for a negative status; returns it otherwise. */
export function check(fn: string, rc: number): number {
  if (rc < 0) throw new NativeError(fn, rc, lastError());
  return rc;
}

/** Feature flags an engine reports. */
export interface EngineFeatures {
  /** The gather/scatter kernel is loaded (cuda). */
  kernel: boolean;
  /** `cuMemcpyBatchAsync` is available (cuda, driver 12.8+). */
  dmaBatch: boolean;
  /** CUDA IPC export/import works. */
  ipc: boolean;
}

/** Which backend an engine runs: `auto` resolves to one of the others. */
export type BackendName = "auto" | "cuda" | "host";
/** Copy direction: D2H gathers region → pool, H2D scatters pool → region. */
export type Direction = "d2h" | "h2d";
/**
 * Copy path a batch carries (`pf_path`). The library runs exactly this path
 * and never picks one: the caller's policy does (`lib/copy_path.ts`).
 * `host` is the host backend's memcpy (the cuda backend refuses it); the
 * host backend accepts every path, copies with memcpy and reports the path
 * back. `mixed` runs the kernel and the copy engines on one batch at once.
 */
export type CopyPath = "host" | "kernel" | "dma_batch" | "dma" | "mixed";
/** The paths that run on a GPU (the ones a calibration table measures). */
export type GpuPath = Exclude<CopyPath, "host">;

/** `pf_path` numbers by name. */
export const PATH_CODES: Record<CopyPath, number> = {
  host: 0,
  kernel: 1,
  dma_batch: 2,
  dma: 3,
  mixed: 4,
};
/** `pf_path` names by number. */
export const PATH_NAMES: readonly CopyPath[] = ["host", "kernel", "dma_batch", "dma", "mixed"];
/** `pf_direction` numbers by name. */
export const DIRECTION_CODES: Record<Direction, number> = { d2h: 0, h2d: 1 };

const BACKEND_CODES: Record<BackendName, number> = { auto: 0, cuda: 1, host: 2 };

/** `PF_HANDLE_BYTES`: a region's cross-process handle (CUipcMemHandle, or a NUL-padded shm name). */
export const HANDLE_BYTES = 64;

/** Options of {@link Engine.open}. */
export interface EngineOptions {
  /** `auto` (default) picks cuda when a GPU is usable, else host. */
  backend?: BackendName;
  /** CUDA device ordinal (ignored by host). Default 0. */
  device?: number;
  /** Host-backend copy threads; 0 / absent = library default. */
  workers?: number;
}

/** Options of {@link Engine.createPool}. */
export interface PoolOptions {
  /** Back the pool with huge pages (needs /proc/sys/vm/nr_hugepages). */
  hugepages?: boolean;
  /** Fault every page in at creation, in parallel. */
  pretouch?: boolean;
  /** Pre-touch threads (0 / absent = library default). */
  touchThreads?: number;
  /**
   * NUMA split: consecutive parts of the pool (bytes summing to the pool's
   * size, each but the last a multiple of the mapping's page) whose pages are
   * bound to `node` before pre-touch (-1: not bound). Absent: one part.
   */
  parts?: readonly PoolPart[];
}

/** One part of a pool split across NUMA nodes (`pf_pool_part`). */
export interface PoolPart {
  bytes: number;
  /** NUMA node its pages are bound to; -1 = not bound. */
  node: number;
}

/** sizeof(pf_pool_part). */
const POOL_PART_BYTES = 16;

/** The `pf_pool_part` array of `parts` (null when the pool is not split). */
function encodeParts(parts: readonly PoolPart[] | undefined): Uint8Array | null {
  if (!parts || parts.length === 0) return null;
  const buf = new Uint8Array(parts.length * POOL_PART_BYTES);
  const v = new DataView(buf.buffer);
  parts.forEach((p, i) => {
    v.setBigUint64(i * POOL_PART_BYTES, BigInt(p.bytes), true);
    v.setInt32(i * POOL_PART_BYTES + 8, p.node, true);
  });
  return buf;
}

/**
 * Devices `backend` can open: cuda asks the driver (cuDeviceGetCount; throws
 * PF_ENODEV without one); host answers 0 (no physical devices: any id is a
 * name); auto answers cuda's count where a GPU is usable, else 0.
 */
export function deviceCount(backend: BackendName): number {
  const out = new Uint32Array(1);
  check("pf_device_count", loadLibrary().pf_device_count(BACKEND_CODES[backend], out));
  return out[0];
}

/**
 * The NUMA node `device` is attached to (cuda: sysfs `numa_node` of its PCI
 * bus id), or -1 where the platform does not say; always -1 on host.
 */
export function deviceNumaNode(backend: BackendName, device: number): number {
  const out = new Int32Array(1);
  check(
    "pf_device_numa_node",
    loadLibrary().pf_device_numa_node(BACKEND_CODES[backend], device, out),
  );
  return out[0];
}

/** Phases of pool creation, as the library reports them (`pf_pool_phase`). */
export type PoolPhase = "map" | "touch" | "lock" | "done";
const POOL_PHASES: readonly PoolPhase[] = ["map", "touch", "lock", "done"];
/** sizeof(pf_pool_progress). */
const POOL_PROGRESS_BYTES = 16 + 256;

/** A snapshot of a pool being created ({@link Engine.createPoolAsync}). */
export interface PoolProgress {
  /** The engine creating the pool. */
  backend: "cuda" | "host";
  device: number;
  phase: PoolPhase;
  /** Bytes pre-touched so far. */
  touchedBytes: number;
  /** The pool's size. */
  totalBytes: number;
  /** Milliseconds since the call started. */
  elapsedMs: number;
}

/** Options of {@link Engine.createPoolAsync}. */
export interface PoolProgressOptions {
  /** Called every `intervalMs` while the pool is created (never in phase `done`). */
  onProgress?: (p: PoolProgress) => void;
  /** Period of `onProgress`, ms. Default 1000. */
  intervalMs?: number;
}

/** One calibration table: GB/s per segment size and path. */
export interface CalibrationTable {
  direction: Direction;
  /** Segment sizes measured, bytes. */
  sizes: number[];
  /** One large contiguous copy (the link's peak), GB/s. */
  peak: number;
  /** GB/s per path per size (0 where the path is absent). */
  gbps: Record<GpuPath, number[]>;
}

/** `pf_pool_flags` (inputs of pf_pool_create). */
const POOL_FLAG = { HUGEPAGES: 1 << 0, PRETOUCH: 1 << 1 } as const;

function poolFlags(opts: PoolOptions): number {
  return (opts.hugepages ? POOL_FLAG.HUGEPAGES : 0) | (opts.pretouch ? POOL_FLAG.PRETOUCH : 0);
}

function u64(x: number | bigint): bigint {
  return typeof x === "bigint" ? x : BigInt(x);
}

/**
 * A copy engine on one device (cuda) or the host backend. It owns pools and
 * regions; close them before {@link Engine.close}.
 *
 * @example
 * ```ts
 * const engine = Engine.open({ backend: "host" });
 * const pool = engine.createPool(1 << 20);
 * const region = engine.allocRegion(1 << 16);
 * region.write(0, new Uint8Array([1, 2, 3]));
 * region.close(); pool.close(); engine.close();
 * ```
 */
export class Engine {
  /** The u32 engine handle. */
  readonly handle: number;
  /** The backend actually running. */
  readonly backend: "cuda" | "host";
  /** What this engine can do. */
  readonly features: EngineFeatures;
  /** SM count (0 on host). */
  readonly smCount: number;
  /** Device ordinal. */
  readonly device: number;
  /** Total device memory in bytes (0 on host). */
  readonly deviceMemBytes: number;
  /** `cuDeviceGetName` (e.g. "NVIDIA H100 80GB HBM3"), or "host". */
  readonly deviceName: string;
  /** `cuDriverGetVersion` (12080 = 12.8); 0 on host. */
  readonly driverVersion: number;
  readonly #pf: PegaflowSymbols;
  #closed = false;

  private constructor(pf: PegaflowSymbols, handle: number) {
    this.#pf = pf;
    this.handle = handle;
    const p = this.props();
    this.backend = p.backend;
    this.features = { kernel: p.hasKernel, dmaBatch: p.hasDmaBatch, ipc: p.hasIpc };
    this.smCount = p.smCount;
    this.device = p.device;
    this.deviceMemBytes = p.deviceMemBytes;
    this.deviceName = p.deviceName;
    this.driverVersion = p.driverVersion;
  }

  /** Opens an engine. @throws NativeError (e.g. PF_ENODEV for cuda without a GPU). */
  static open(opts: EngineOptions = {}): Engine {
    const pf = loadLibrary();
    const backend = opts.backend ?? "auto";
    const code = BACKEND_CODES[backend];
    if (code === undefined) {
      throw new TypeError(`Engine.open: backend "${backend}"; expected auto, cuda or host`);
    }
    const out = new Uint32Array(1);
    check("pf_engine_open", pf.pf_engine_open(code, opts.device ?? 0, opts.workers ?? 0, out));
    return new Engine(pf, out[0]);
  }

  /** Everything `pf_engine_info` reports, read now. */
  props(): EngineProps {
    const out = new Uint8Array(ENGINE_PROPS_BYTES);
    check("pf_engine_info", this.#pf.pf_engine_info(this.handle, out));
    return decodeEngineProps(out);
  }

  /** Kernel grid (blocks) currently used by the kernel path (0 on host). */
  get kernelGrid(): number {
    return this.props().kernelGrid;
  }

  /** Kernel variant in use: `simt` (loads/stores) or `tma` (Hopper bulk copy). */
  get kernelVariant(): "simt" | "tma" {
    return this.props().kernelVariant;
  }

  /** Sets the kernel path's grid; 0 restores the default. */
  setKernelGrid(blocks: number): void {
    check("pf_engine_set_kernel_grid", this.#pf.pf_engine_set_kernel_grid(this.handle, blocks));
  }

  /**
   * Sets the copy engines' share of `mixed` batches in permille of each
   * group's bytes; 0 restores the default.
   */
  setDmaShare(permille: number): void {
    check("pf_engine_set_dma_share", this.#pf.pf_engine_set_dma_share(this.handle, permille));
  }

  /**
   * Marks this engine's device failed, as a lost GPU would be (a test hook;
   * the cuda backend also does it itself on an error that leaves the context
   * unusable): every batch it runs from now on fails with `code` (a negative
   * PF_E*) and a text naming its device. Other engines keep serving. Not
   * reversible.
   */
  fail(code: number = PF_STATUS.PF_EIO): void {
    check("pf_engine_fail", this.#pf.pf_engine_fail(this.handle, code));
  }

  /** Allocates a page-locked host pool of `bytes` (blocks this thread meanwhile). */
  createPool(bytes: number | bigint, opts: PoolOptions = {}): Pool {
    const out = new Uint32Array(1);
    check(
      "pf_pool_create",
      this.#pf.pf_pool_create_split(
        this.handle,
        u64(bytes),
        poolFlags(opts),
        opts.touchThreads ?? 0,
        null,
        encodeParts(opts.parts),
        opts.parts?.length ?? 0,
        out,
      ),
    );
    return new Pool(this.#pf, out[0]);
  }

  /**
   * Allocates a pool off the JS thread and reports its progress on a timer
   * (pre-touching tens of GiB takes seconds): the library counts touched
   * bytes in two words this call owns, and `onProgress` reads them.
   *
   * @example
   * ```ts
   * const pool = await engine.createPoolAsync(12 << 30, { pretouch: true }, {
   *   onProgress: (p) => console.log(p.phase, p.touchedBytes, "/", p.totalBytes),
   * });
   * ```
   */
  async createPoolAsync(
    bytes: number | bigint,
    opts: PoolOptions = {},
    watch: PoolProgressOptions = {},
  ): Promise<Pool> {
    const out = new Uint32Array(1);
    // pf_pool_progress: u64 touched_bytes, u32 phase, u32 reserved, char error[256].
    // Written by the library while the call runs; referenced here until it returns.
    const block = new Uint8Array(POOL_PROGRESS_BYTES);
    const touched = new BigUint64Array(block.buffer, 0, 1);
    const phase = new Uint32Array(block.buffer, 8, 1);
    const total = Number(bytes);
    const t0 = performance.now();
    const timer = watch.onProgress
      ? setInterval(() => {
        // Finished, but the promise has not settled yet: nothing left to report.
        if (POOL_PHASES[phase[0]] === "done") return;
        watch.onProgress!({
          backend: this.backend,
          device: this.device,
          phase: POOL_PHASES[phase[0]] ?? "map",
          touchedBytes: Math.min(Number(touched[0]), total),
          totalBytes: total,
          elapsedMs: performance.now() - t0,
        });
      }, watch.intervalMs ?? 1000)
      : undefined;
    try {
      const parts = encodeParts(opts.parts);
      const rc = await this.#pf.pf_pool_create_split_nonblocking(
        this.handle,
        u64(bytes),
        poolFlags(opts),
        opts.touchThreads ?? 0,
        block,
        parts,
        opts.parts?.length ?? 0,
        out,
      );
      if (rc < 0) {
        // The call ran on another thread: its error text comes back in the block.
        const text = block.subarray(16);
        const end = text.indexOf(0);
        throw new NativeError(
          "pf_pool_create",
          rc,
          DECODER.decode(text.subarray(0, end < 0 ? text.length : end)),
        );
      }
    } finally {
      if (timer !== undefined) clearInterval(timer);
    }
    return new Pool(this.#pf, out[0]);
  }

  /**
   * Exporting side: allocates `bytes` of device memory (host backend: a shm
   * file) and returns it with its 64-byte handle for another process.
   */
  allocRegion(bytes: number | bigint): Region {
    const handle = new Uint8Array(HANDLE_BYTES);
    const out = new Uint32Array(1);
    check("pf_region_alloc", this.#pf.pf_region_alloc(this.handle, u64(bytes), handle, out));
    return new Region(this.#pf, out[0], handle);
  }

  /** Importing side: opens a peer's 64-byte handle declared `bytes` long. */
  importRegion(handle: Uint8Array, bytes: number | bigint): Region {
    if (handle.length !== HANDLE_BYTES) {
      throw new NativeError(
        "pf_region_import",
        PF_STATUS.PF_EINVAL,
        `handle is ${handle.length} bytes; expected ${HANDLE_BYTES}`,
      );
    }
    const out = new Uint32Array(1);
    check("pf_region_import", this.#pf.pf_region_import(this.handle, handle, u64(bytes), out));
    return new Region(this.#pf, out[0], handle.slice());
  }

  /**
   * Measures every path for each segment size in `sizes`, moving
   * `totalBytes` per point through `pool` (synchronous, seconds on a GPU).
   */
  calibrate(
    pool: Pool,
    direction: Direction,
    sizes: number[],
    totalBytes: number,
  ): CalibrationTable {
    const n = sizes.length;
    const s = new BigUint64Array(sizes.map((x) => BigInt(x)));
    const out = new Float64Array(5 * n);
    check(
      "pf_calibrate",
      this.#pf.pf_calibrate(
        this.handle,
        pool.handle,
        DIRECTION_CODES[direction],
        s,
        n,
        BigInt(totalBytes),
        out,
      ),
    );
    const row = (p: number) => Array.from(out.subarray(p * n, p * n + n));
    return {
      direction,
      sizes: [...sizes],
      peak: out[0],
      gbps: { kernel: row(1), dma_batch: row(2), dma: row(3), mixed: row(4) },
    };
  }

  /** Closes the engine. @throws NativeError PF_EBUSY while pools/regions live. */
  close(): void {
    if (this.#closed) return;
    check("pf_engine_close", this.#pf.pf_engine_close(this.handle));
    this.#closed = true;
  }
}

/** A page-locked host pool; slices of it hold KV blocks. */
export class Pool {
  /** The u32 pool handle. */
  readonly handle: number;
  /** Size in bytes. */
  readonly bytes: number;
  readonly #pf: PegaflowSymbols;
  readonly #ptr: Deno.PointerObject;
  #closed = false;

  /** @internal Use {@link Engine.createPool}. */
  constructor(pf: PegaflowSymbols, handle: number) {
    this.#pf = pf;
    this.handle = handle;
    const ptr = pf.pf_pool_ptr(handle);
    if (!ptr) throw new NativeError("pf_pool_ptr", PF_STATUS.PF_EHANDLE, lastError());
    this.#ptr = ptr;
    this.bytes = this.info().bytes;
  }

  /** What the library applied (huge pages, pre-touch, locking) and timing. */
  info(): PoolInfo {
    const out = new Uint8Array(POOL_PROPS_BYTES);
    check("pf_pool_info", this.#pf.pf_pool_info(this.handle, out));
    return decodePoolProps(out);
  }

  /**
   * A Uint8Array over pool bytes [off, off+len) — host memory, zero-copy.
   * Valid until {@link Pool.close}; never touch it while a copy into that
   * range is in flight.
   */
  view(off: number, len: number): Uint8Array {
    if (this.#closed) {
      throw new NativeError(
        "Pool.view",
        PF_STATUS.PF_EHANDLE,
        `pool ${this.handle} is closed: its memory is unmapped (or another pool's now)`,
      );
    }
    if (
      !Number.isSafeInteger(off) || !Number.isSafeInteger(len) || off < 0 || len < 0 ||
      off + len > this.bytes
    ) {
      throw new NativeError(
        "Pool.view",
        PF_STATUS.PF_ERANGE,
        `pool ${this.handle}: off ${off} + len ${len} exceeds pool size ${this.bytes}`,
      );
    }
    if (len === 0) return new Uint8Array(0);
    return new Uint8Array(Deno.UnsafePointerView.getArrayBuffer(this.#ptr, len, off));
  }

  /** Frees the pool. @throws NativeError PF_EBUSY while copies are in flight. */
  close(): void {
    if (this.#closed) return;
    check("pf_pool_destroy", this.#pf.pf_pool_destroy(this.handle));
    this.#closed = true;
  }
}

/**
 * A client's KV memory: allocated here (exporter) or imported from another
 * process by its 64-byte handle (importer).
 */
export class Region {
  /** The u32 region handle used in copy batches. */
  readonly id: number;
  /** The 64-byte cross-process handle (CUDA IPC handle or shm name). */
  readonly handle: Uint8Array;
  /** Size in bytes. */
  readonly bytes: number;
  readonly #pf: PegaflowSymbols;
  #closed = false;

  /** @internal Use {@link Engine.allocRegion} / {@link Engine.importRegion}. */
  constructor(pf: PegaflowSymbols, id: number, handle: Uint8Array) {
    this.#pf = pf;
    this.id = id;
    this.handle = handle;
    this.bytes = this.info().bytes;
  }

  /** Size, address, import flag and in-flight count. */
  info(): RegionInfo {
    const out = new Uint8Array(REGION_PROPS_BYTES);
    check("pf_region_info", this.#pf.pf_region_info(this.id, out));
    return decodeRegionProps(out);
  }

  /** Copies `data` into the region at `off` (synchronous; not a hot path). */
  write(off: number, data: Uint8Array): void {
    check(
      "pf_region_write",
      this.#pf.pf_region_write(this.id, BigInt(off), data, BigInt(data.length)),
    );
  }

  /** Reads `len` bytes at `off` into a new array (synchronous). */
  read(off: number, len: number): Uint8Array {
    const out = new Uint8Array(len);
    check("pf_region_read", this.#pf.pf_region_read(this.id, BigInt(off), out, BigInt(len)));
    return out;
  }

  /**
   * Closes the mapping (import) or frees the memory (alloc; a host region
   * also unlinks its shm name). @throws NativeError PF_EBUSY while copies
   * are in flight: drain first.
   */
  close(): void {
    if (this.#closed) return;
    check("pf_region_close", this.#pf.pf_region_close(this.id));
    this.#closed = true;
  }
}

/** Options of {@link SharedMemory.open}. */
export interface ShmOptions {
  /** Create (exclusively) and size the object. */
  create?: boolean;
  /** Unlink the name on close. */
  unlink?: boolean;
}

const ENCODER = new TextEncoder();

/**
 * A named POSIX shared-memory mapping for small control blocks shared with
 * other processes (load progress words, state).
 *
 * @example
 * ```ts
 * const shm = SharedMemory.open("/pegaflow-load-1", 4096, { create: true, unlink: true });
 * new Uint32Array(shm.view().buffer)[0] = 0;
 * shm.close();
 * ```
 */
export class SharedMemory {
  /** The u32 shm handle (pass to CopyBatch.reset for progress words). */
  readonly handle: number;
  /** The object's name ("/..."). */
  readonly name: string;
  /** Mapped size. */
  readonly bytes: number;
  readonly #pf: PegaflowSymbols;
  readonly #ptr: Deno.PointerObject;
  #closed = false;

  private constructor(pf: PegaflowSymbols, handle: number, name: string, bytes: number) {
    this.#pf = pf;
    this.handle = handle;
    this.name = name;
    this.bytes = bytes;
    const ptr = pf.pf_shm_ptr(handle);
    if (!ptr) throw new NativeError("pf_shm_ptr", PF_STATUS.PF_EHANDLE, lastError());
    this.#ptr = ptr;
  }

  /** Maps (and with `create`, creates) the shm object `name`. */
  static open(name: string, bytes: number, opts: ShmOptions = {}): SharedMemory {
    const pf = loadLibrary();
    const cname = new Uint8Array(ENCODER.encode(name).length + 1);
    ENCODER.encodeInto(name, cname);
    const flags = (opts.create ? 1 : 0) | (opts.unlink ? 2 : 0);
    const out = new Uint32Array(1);
    check("pf_shm_open", pf.pf_shm_open(cname, BigInt(bytes), flags, out));
    return new SharedMemory(pf, out[0], name, bytes);
  }

  /**
   * Copies `dst.length` bytes at `offset` out of the object (whole u32 words
   * when aligned). Guarded: a peer that shrank the object makes this throw
   * `PF_EFAULT` instead of killing the process. Use it (not
   * {@link SharedMemory.view}) on a peer's object.
   */
  read(offset: number, dst: Uint8Array): void {
    check(
      "pf_shm_read",
      this.#pf.pf_shm_read(this.handle, BigInt(offset), dst, BigInt(dst.length)),
    );
  }

  /** Copies `src` into the object at `offset`; guarded like {@link SharedMemory.read}. */
  write(offset: number, src: Uint8Array): void {
    check(
      "pf_shm_write",
      this.#pf.pf_shm_write(this.handle, BigInt(offset), src, BigInt(src.length)),
    );
  }

  /**
   * The whole mapping as bytes (zero-copy), for the process that owns the
   * object. Unguarded: if another process shrinks the object, touching the
   * view kills this process with SIGBUS.
   */
  view(): Uint8Array {
    if (this.#closed) {
      throw new NativeError(
        "SharedMemory.view",
        PF_STATUS.PF_EHANDLE,
        `shm ${this.handle} (${this.name}) is closed: its mapping is gone`,
      );
    }
    return new Uint8Array(Deno.UnsafePointerView.getArrayBuffer(this.#ptr, this.bytes));
  }

  /**
   * True while {@link SharedMemory.name} still names the object this maps, at
   * least {@link SharedMemory.bytes} long (one `stat`): false once the owner
   * unlinked it, made a new one under the name, or shrank it. For a process
   * that keeps a peer's mapping between uses.
   */
  same(): boolean {
    const r = this.#pf.pf_shm_same(this.handle);
    if (r < 0) check("pf_shm_same", r);
    return r === 1;
  }

  /** Unmaps (and unlinks if asked). @throws NativeError PF_EBUSY while a batch reports here. */
  close(): void {
    if (this.#closed) return;
    check("pf_shm_close", this.#pf.pf_shm_close(this.handle));
    this.#closed = true;
  }
}
