/**
 * The byte layouts of the output structs in `csrc/pegaflow.h` and their
 * decoders: the one place in TypeScript that knows at which offset a field
 * of `pf_engine_props`, `pf_pool_props`, `pf_region_props`,
 * `pf_uring_stats`, `pf_file_props`, `pf_fs_usage`, `pf_xfer_stats` or
 * `pf_xfer_peer_status` lives. Each layout is
 * pinned on the C side by a `_Static_assert` on its size; the offsets here
 * follow the header's comments field by field.
 *
 * A caller allocates `new Uint8Array(X_BYTES)`, passes it as the `out`
 * pointer, and decodes it with `decodeX`.
 *
 * @module
 */

/** Little-endian reader over one output struct. */
function view(buf: Uint8Array, bytes: number, what: string): DataView {
  if (buf.byteLength < bytes) {
    throw new RangeError(`${what}: buffer of ${buf.byteLength} bytes; expected ${bytes}`);
  }
  return new DataView(buf.buffer, buf.byteOffset, bytes);
}

/**
 * True for an integer in [0, 2^53): a u64 descriptor field that a Number
 * carries exactly and the u32-pair encoding (`x >>> 0`, `(x / 2^32) >>> 0`)
 * writes as itself. A negative value would come out as 2^32 - |x|, NaN or
 * a fraction as a truncated one: other offsets the library would accept.
 */
export function isU53(x: number): boolean {
  return Number.isSafeInteger(x) && x >= 0;
}

/** The RangeError naming the first of `values` (named `names`) that is not {@link isU53}. */
export function notU53(
  where: string,
  names: readonly string[],
  values: readonly number[],
): RangeError {
  const i = values.findIndex((x) => !isU53(x));
  return new RangeError(
    `${where}: ${names[i]} ${values[i]} is not an integer in [0, 2^53)`,
  );
}

function u64(v: DataView, off: number): number {
  return Number(v.getBigUint64(off, true));
}

const DECODER = new TextDecoder();

/** `pf_backend` values as the engine reports them (never AUTO). */
const BACKEND_NAMES: Record<number, "cuda" | "host"> = { 1: "cuda", 2: "host" };
/** `pf_kernel_variant` values. */
const KERNEL_VARIANTS: Record<number, "simt" | "tma"> = { 0: "simt", 1: "tma" };

/** sizeof(pf_engine_props). */
export const ENGINE_PROPS_BYTES = 104;
/** `PF_DEVICE_NAME_BYTES`. */
export const DEVICE_NAME_BYTES = 64;

/** What `pf_engine_info` reports. */
export interface EngineProps {
  backend: "cuda" | "host";
  device: number;
  abiVersion: number;
  /** `cuDriverGetVersion` (12080 = 12.8); 0 on host. */
  driverVersion: number;
  /** 0 on host. */
  smCount: number;
  /** Blocks the kernel path launches now (0 on host). */
  kernelGrid: number;
  kernelVariant: "simt" | "tma";
  /** The gather/scatter kernel is loaded (cuda). */
  hasKernel: boolean;
  /** `cuMemcpyBatchAsync` is available (cuda, driver 12.8+). */
  hasDmaBatch: boolean;
  /** CUDA IPC export/import works. */
  hasIpc: boolean;
  /** Total device memory (0 on host). */
  deviceMemBytes: number;
  /** `cuDeviceGetName`, or `"host"`. */
  deviceName: string;
}

/** Decodes a `pf_engine_props`. */
export function decodeEngineProps(buf: Uint8Array): EngineProps {
  const v = view(buf, ENGINE_PROPS_BYTES, "pf_engine_props");
  const backendCode = v.getUint32(0, true);
  const backend = BACKEND_NAMES[backendCode];
  if (!backend) throw new RangeError(`pf_engine_props: backend ${backendCode}; expected 1 or 2`);
  const name = buf.subarray(40, 40 + DEVICE_NAME_BYTES);
  const nul = name.indexOf(0);
  return {
    backend,
    device: v.getInt32(4, true),
    abiVersion: v.getUint32(8, true),
    driverVersion: v.getUint32(12, true),
    smCount: v.getUint32(16, true),
    kernelGrid: v.getUint32(20, true),
    kernelVariant: KERNEL_VARIANTS[v.getUint32(24, true)] ?? "simt",
    hasKernel: v.getUint8(28) === 1,
    hasDmaBatch: v.getUint8(29) === 1,
    hasIpc: v.getUint8(30) === 1,
    deviceMemBytes: u64(v, 32),
    deviceName: DECODER.decode(name.subarray(0, nul < 0 ? name.length : nul)),
  };
}

/** sizeof(pf_pool_props). */
export const POOL_PROPS_BYTES = 32;

/** What `pf_pool_info` reports: what the library applied, and timing. */
export interface PoolInfo {
  bytes: number;
  hugepages: boolean;
  pretouched: boolean;
  /** Page-locked (cuda: registered; host: mlock succeeded). */
  locked: boolean;
  /** Time spent allocating and pre-touching, ns. */
  allocNs: number;
  /** Huge page size used (0 if none). */
  hugePageBytes: number;
}

/** Decodes a `pf_pool_props`. */
export function decodePoolProps(buf: Uint8Array): PoolInfo {
  const v = view(buf, POOL_PROPS_BYTES, "pf_pool_props");
  return {
    bytes: u64(v, 0),
    allocNs: u64(v, 8),
    hugePageBytes: u64(v, 16),
    hugepages: v.getUint8(24) === 1,
    pretouched: v.getUint8(25) === 1,
    locked: v.getUint8(26) === 1,
  };
}

/** sizeof(pf_region_props). */
export const REGION_PROPS_BYTES = 24;

/** What `pf_region_info` reports. */
export interface RegionInfo {
  bytes: number;
  /** Device address (cuda) or host address (host), as a BigInt. */
  addr: bigint;
  imported: boolean;
  /** Layer groups in flight that touch this region. */
  inflight: number;
}

/** Decodes a `pf_region_props`. */
export function decodeRegionProps(buf: Uint8Array): RegionInfo {
  const v = view(buf, REGION_PROPS_BYTES, "pf_region_props");
  return {
    bytes: u64(v, 0),
    addr: v.getBigUint64(8, true),
    imported: v.getUint32(16, true) === 1,
    inflight: v.getUint32(20, true),
  };
}

/** sizeof(pf_uring_stats). */
export const URING_STATS_BYTES = 48;

/** What `pf_uring_info` reports. */
export interface UringInfo {
  depth: number;
  hdrPages: number;
  fixedBuffers: boolean;
  fixedFiles: boolean;
  submitted: number;
  completed: number;
  alignmentFallbacks: number;
  inflight: number;
}

/** Decodes a `pf_uring_stats`. */
export function decodeUringStats(buf: Uint8Array): UringInfo {
  const v = view(buf, URING_STATS_BYTES, "pf_uring_stats");
  return {
    depth: v.getUint32(0, true),
    hdrPages: v.getUint32(4, true),
    fixedBuffers: v.getUint8(8) === 1,
    fixedFiles: v.getUint8(9) === 1,
    submitted: u64(v, 16),
    completed: u64(v, 24),
    alignmentFallbacks: u64(v, 32),
    inflight: u64(v, 40),
  };
}

/** sizeof(pf_file_props). */
export const FILE_PROPS_BYTES = 24;

/** What `pf_file_info` reports. */
export interface FileInfo {
  sizeBytes: number;
  /** O_DIRECT offset/length alignment. */
  offsetAlign: number;
  /** O_DIRECT buffer address alignment. */
  memAlign: number;
  /** False when the filesystem refused O_DIRECT and the file runs buffered. */
  direct: boolean;
}

/** Decodes a `pf_file_props`. */
export function decodeFileProps(buf: Uint8Array): FileInfo {
  const v = view(buf, FILE_PROPS_BYTES, "pf_file_props");
  return {
    sizeBytes: u64(v, 0),
    offsetAlign: v.getUint32(8, true),
    memAlign: v.getUint32(12, true),
    direct: v.getUint32(16, true) === 1,
  };
}

/** sizeof(pf_fs_usage). */
export const FS_USAGE_BYTES = 24;

/** Filesystem space at a path (file or directory). */
export interface FsSpace {
  totalBytes: number;
  availableBytes: number;
  blockBytes: number;
}

/** Decodes a `pf_fs_usage`. */
export function decodeFsUsage(buf: Uint8Array): FsSpace {
  const v = view(buf, FS_USAGE_BYTES, "pf_fs_usage");
  return { totalBytes: u64(v, 0), availableBytes: u64(v, 8), blockBytes: u64(v, 16) };
}

/** sizeof(pf_xfer_stats). */
export const XFER_STATS_BYTES = 96;
/** `pf_xfer_transport` values. */
const TRANSPORT_NAMES: Record<number, "tcp" | "rdma"> = { 1: "tcp", 2: "rdma" };

/** What `pf_xfer_info` reports. */
export interface XferInfo {
  transport: "tcp" | "rdma";
  /** TCP listen port (0 for RDMA). */
  port: number;
  streams: number;
  peers: number;
  submitted: number;
  ok: number;
  failed: number;
  timedOut: number;
  /** Bytes of ended batches that arrived late and were discarded. */
  lateBytes: number;
  /** TCP connections being served. */
  servingConnections: number;
  /** READ payload bytes this endpoint served to peers. */
  bytesServed: number;
  /** WRITE payload bytes peers landed in this pool. */
  bytesLanded: number;
  /** TCP connections refused at once: over the cap, or out of descriptors, memory or threads. */
  connsRefused: number;
  /** TCP accepts that failed (out of descriptors or kernel memory). */
  acceptErrors: number;
}

/** Decodes a `pf_xfer_stats`. */
export function decodeXferStats(buf: Uint8Array): XferInfo {
  const v = view(buf, XFER_STATS_BYTES, "pf_xfer_stats");
  const code = v.getUint32(0, true);
  const transport = TRANSPORT_NAMES[code];
  if (!transport) throw new RangeError(`pf_xfer_stats: transport ${code}; expected 1 or 2`);
  return {
    transport,
    port: v.getUint32(4, true),
    streams: v.getUint32(8, true),
    peers: v.getUint32(12, true),
    submitted: u64(v, 16),
    ok: u64(v, 24),
    failed: u64(v, 32),
    timedOut: u64(v, 40),
    lateBytes: u64(v, 48),
    servingConnections: u64(v, 56),
    bytesServed: u64(v, 64),
    bytesLanded: u64(v, 72),
    connsRefused: u64(v, 80),
    acceptErrors: u64(v, 88),
  };
}

/** sizeof(pf_xfer_peer_status). */
export const XFER_PEER_STATUS_BYTES = 24;

/** What `pf_xfer_peer_state` reports. */
export interface PeerState {
  connected: boolean;
  /** The remote pool's size in bytes (after connect). */
  remoteBytes: number;
  inflight: number;
  /** The `PF_E*` code that broke the peer (0 = healthy). */
  broken: number;
}

/** Decodes a `pf_xfer_peer_status`. */
export function decodeXferPeerStatus(buf: Uint8Array): PeerState {
  const v = view(buf, XFER_PEER_STATUS_BYTES, "pf_xfer_peer_status");
  return {
    connected: v.getUint32(0, true) === 1,
    inflight: v.getUint32(4, true),
    remoteBytes: u64(v, 8),
    broken: v.getInt32(16, true),
  };
}
