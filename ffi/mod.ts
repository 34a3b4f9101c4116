/**
 * PegaFlow's FFI layer: libpegaflow's symbols and thin typed wrappers.
 *
 * @module
 */
export { EXPECTED_ABI_VERSION, libraryPath, loadLibrary, SYMBOLS } from "./symbols.ts";
export type { PegaflowSymbols } from "./symbols.ts";
export {
  check,
  deviceCount,
  deviceNumaNode,
  DIRECTION_CODES,
  Engine,
  HANDLE_BYTES,
  lastError,
  NativeError,
  PATH_CODES,
  PATH_NAMES,
  PF_STATUS,
  Pool,
  Region,
  SharedMemory,
  statusName,
} from "./native.ts";
export type {
  BackendName,
  CalibrationTable,
  CopyPath,
  Direction,
  EngineFeatures,
  EngineOptions,
  GpuPath,
  PoolOptions,
  PoolPart,
  PoolPhase,
  PoolProgress,
  PoolProgressOptions,
  ShmOptions,
  StatusName,
} from "./native.ts";
export type { EngineProps, PoolInfo, RegionInfo } from "./structs.ts";
export { type Completion, COMPLETION_KIND, CompletionRing } from "./ring.ts";
export { type BatchOptions, CopyBatch, type ProgressTarget } from "./batch.ts";
export {
  CopyEngine,
  type CopyEngineOptions,
  type CopyResult,
  type Submission,
} from "./copy_engine.ts";
