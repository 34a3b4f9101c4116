/**
 * The calibration tables behind the copy-path policy (`lib/copy_path.ts`):
 * measured with `pf_calibrate` at start-up, or read from a cache file so a
 * restart does not spend seconds measuring the same GPU again.
 *
 * The cache is one JSON file holding an entry per hardware key — the
 * device's name, the driver version and the library's ABI version (a new
 * driver or a rebuilt kernel can move the crossovers) — so one file serves
 * every GPU model of a fleet. A missing entry is measured and written back
 * (atomically: temp file + rename; writers take turns on `<file>.lock`). An unreadable or malformed file is
 * never trusted: it is reported, measured over and rewritten. `--recalibrate`
 * measures even when an entry exists.
 *
 * File layout:
 *
 * ```json
 * { "format": "pegaflow-calibration/1",
 *   "entries": { "NVIDIA H100 80GB HBM3 | driver 12080 | abi 4":
 *     { "measuredAt": "2026-11-23T14:00:00.000Z",
 *       "d2h": CalibrationTable, "h2d": CalibrationTable } } }
 * ```
 *
 * @module
 */
import { basename, dirname, join } from "node:path";
import type { CalibrationTable, Direction, Engine, GpuPath, Pool } from "../ffi/mod.ts";
import { CALIBRATION_SIZES } from "./copy_path.ts";

/** The `format` tag of the cache file. */
export const CALIBRATION_FORMAT = "pegaflow-calibration/1";
/**
 * Bytes moved per measured point: 256 MiB is ~5 ms at the link rate, long
 * enough to hide launch costs, short enough that a 9-size sweep of both
 * directions and four paths stays within seconds.
 */
export const CALIBRATION_BYTES = 256 << 20;
/**
 * Smallest number of segments per measured point: fewer and the per-batch
 * fixed cost (~0.1 ms) dominates the figure.
 */
const MIN_SEGMENTS = 16;

const GPU_PATHS: readonly GpuPath[] = ["kernel", "dma_batch", "dma", "mixed"];

/** Both directions' tables for one device. */
export interface CalibrationTables {
  d2h: CalibrationTable;
  h2d: CalibrationTable;
}

/** The hardware an engine runs on, as the cache keys it. */
export interface CalibrationHardware {
  deviceName: string;
  driverVersion: number;
  abiVersion: number;
}

/** The cache key of a device: tables measured on one are valid for every one like it. */
export function calibrationKey(hw: CalibrationHardware): string {
  return `${hw.deviceName} | driver ${hw.driverVersion} | abi ${hw.abiVersion}`;
}

/**
 * The default cache file: `$XDG_CACHE_HOME/pegaflow/calibration.json`, else
 * `~/.cache/pegaflow/calibration.json`; undefined when neither is known.
 */
export function defaultCalibrationFile(
  env: (name: string) => string | undefined,
): string | undefined {
  const xdg = env("XDG_CACHE_HOME");
  if (xdg) return join(xdg, "pegaflow", "calibration.json");
  const home = env("HOME");
  return home ? join(home, ".cache", "pegaflow", "calibration.json") : undefined;
}

/** A cache file that cannot be used; `file` and the reason are in the message. */
export class CalibrationCacheError extends Error {
  readonly file: string;
  constructor(file: string, reason: string) {
    super(`calibration cache ${file}: ${reason}`);
    this.name = "CalibrationCacheError";
    this.file = file;
  }
}

function isNumberArray(v: unknown, n: number): v is number[] {
  return Array.isArray(v) && v.length === n &&
    v.every((x) => typeof x === "number" && Number.isFinite(x) && x >= 0);
}

/** Checks one table's shape; returns what is wrong, or undefined. */
function tableProblem(t: unknown, direction: Direction): string | undefined {
  if (typeof t !== "object" || t === null) return `${direction}: not an object`;
  const o = t as Record<string, unknown>;
  if (o.direction !== direction) return `${direction}: direction is ${JSON.stringify(o.direction)}`;
  const sizes = o.sizes;
  if (
    !Array.isArray(sizes) || sizes.length === 0 ||
    !sizes.every((s) => Number.isSafeInteger(s) && s > 0)
  ) {
    return `${direction}: sizes must be a non-empty list of positive integers`;
  }
  if (typeof o.peak !== "number" || !(o.peak > 0)) {
    return `${direction}: peak must be a positive number, got ${JSON.stringify(o.peak)}`;
  }
  const gbps = o.gbps as Record<string, unknown> | undefined;
  for (const p of GPU_PATHS) {
    if (!gbps || !isNumberArray(gbps[p], sizes.length)) {
      return `${direction}: gbps.${p} must hold ${sizes.length} non-negative numbers`;
    }
  }
  return undefined;
}

type CacheFile = { format: string; entries: Record<string, unknown> };

/** Reads the cache; undefined when the file does not exist. */
function readCacheFile(file: string): CacheFile | undefined {
  let text: string;
  try {
    text = Deno.readTextFileSync(file);
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return undefined;
    throw new CalibrationCacheError(file, `cannot be read: ${(e as Error).message}`);
  }
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch (e) {
    throw new CalibrationCacheError(file, `is not JSON: ${(e as Error).message}`);
  }
  const d = doc as Partial<CacheFile> | null;
  if (typeof d !== "object" || d === null || d.format !== CALIBRATION_FORMAT) {
    throw new CalibrationCacheError(
      file,
      `format is ${JSON.stringify(d?.format)}; expected "${CALIBRATION_FORMAT}"`,
    );
  }
  if (typeof d.entries !== "object" || d.entries === null) {
    throw new CalibrationCacheError(file, "has no entries object");
  }
  return d as CacheFile;
}

/**
 * The tables cached for `key`, or undefined when the file or the entry is
 * absent.
 *
 * @throws CalibrationCacheError when the file or the entry is malformed.
 */
export function readCalibration(file: string, key: string): CalibrationTables | undefined {
  const doc = readCacheFile(file);
  const entry = doc?.entries[key];
  if (entry === undefined) return undefined;
  const e = entry as Record<string, unknown>;
  for (const dir of ["d2h", "h2d"] as const) {
    const problem = tableProblem(e?.[dir], dir);
    if (problem) throw new CalibrationCacheError(file, `entry "${key}": ${problem}`);
  }
  return { d2h: e.d2h as CalibrationTable, h2d: e.h2d as CalibrationTable };
}

/**
 * How long a writer waits for another writer of the same cache (the servers
 * of a node's GPUs starting together) before writing anyway: at worst an
 * entry is lost and measured again at the next start.
 */
const WRITE_LOCK_WAIT_MS = 5_000;
const WRITE_LOCK_POLL_MS = 2;

/**
 * Stores `tables` under `key`, keeping the file's other entries (a
 * malformed file is replaced). Atomic: a reader sees the old file or the
 * new one. Writers of one file take turns (an exclusive `flock` on
 * `<file>.lock` around the read-modify-write), so entries written at the
 * same time by several processes are all kept.
 */
export function writeCalibration(file: string, key: string, tables: CalibrationTables): void {
  Deno.mkdirSync(dirname(file), { recursive: true });
  const lock = Deno.openSync(`${file}.lock`, { create: true, write: true });
  try {
    const until = performance.now() + WRITE_LOCK_WAIT_MS;
    const pause = new Int32Array(new SharedArrayBuffer(4));
    // flock, not lockSync: a holder that hangs must not hang this start.
    while (!lock.tryLockSync(true) && performance.now() < until) {
      Atomics.wait(pause, 0, 0, WRITE_LOCK_POLL_MS);
    }
    replaceEntry(file, key, tables);
  } finally {
    lock.close(); // releases the flock
  }
}

function replaceEntry(file: string, key: string, tables: CalibrationTables): void {
  let doc: CacheFile;
  try {
    doc = readCacheFile(file) ?? { format: CALIBRATION_FORMAT, entries: {} };
  } catch (e) {
    if (!(e instanceof CalibrationCacheError)) throw e;
    doc = { format: CALIBRATION_FORMAT, entries: {} };
  }
  doc.entries[key] = { measuredAt: new Date().toISOString(), ...tables };
  // A temp name of its own (not the pid: two containers' servers are both
  // pid 1 on a shared cache volume), removed when the rename does not happen.
  // createNew keeps the umask's mode (a temp file's 0600 would hide the
  // cache from the other users of a shared one).
  const tmp = join(dirname(file), `${basename(file)}.${crypto.randomUUID()}.tmp`);
  try {
    Deno.writeTextFileSync(tmp, JSON.stringify(doc, null, 1) + "\n", { createNew: true });
    Deno.renameSync(tmp, file);
  } catch (e) {
    try {
      Deno.removeSync(tmp);
    } catch {
      // Best effort: the write's own error is the one to report.
    }
    throw e;
  }
}

/**
 * Measures both directions on `engine` through `pool` (synchronous; seconds
 * on a GPU, before the pool holds anything).
 */
export function measureCalibration(
  engine: Engine,
  pool: Pool,
  totalBytes = CALIBRATION_BYTES,
): CalibrationTables {
  const bytes = Math.min(totalBytes, pool.bytes);
  const sizes = CALIBRATION_SIZES.filter((s) => s <= bytes / MIN_SEGMENTS);
  if (sizes.length === 0) {
    throw new RangeError(
      `calibration: pool of ${pool.bytes} bytes is too small to measure ` +
        `${MIN_SEGMENTS} segments of ${CALIBRATION_SIZES[0]} bytes`,
    );
  }
  return {
    d2h: engine.calibrate(pool, "d2h", sizes, bytes),
    h2d: engine.calibrate(pool, "h2d", sizes, bytes),
  };
}

/** Options of {@link loadOrMeasure}. */
export interface LoadOrMeasureOptions {
  /** Cache file; undefined = measure every start, write nothing. */
  file: string | undefined;
  /** Measure even when the cache has an entry (and overwrite it). */
  recalibrate: boolean;
  /** Measures when needed (tests pass a fake; the server {@link measureCalibration}). */
  measure: () => CalibrationTables;
}

/** Where the tables came from, and what went wrong with the cache on the way. */
export interface LoadedCalibration {
  tables: CalibrationTables;
  source: "cache" | "measured";
  /** A cache that could not be read or written (the tables are still good). */
  cacheError?: string;
}

/**
 * The tables for `hw`: from the cache when it has a valid entry and
 * `recalibrate` is off, else measured (and written back when a file is
 * configured). A bad cache never stops the server: it is measured over and
 * the problem is returned for the log.
 *
 * @example
 * ```ts
 * const r = loadOrMeasure(engine.props(), {
 *   file: "/var/cache/pegaflow/calibration.json", recalibrate: false,
 *   measure: () => measureCalibration(engine, pool),
 * });
 * const policy = new PathPolicy(r.tables);
 * ```
 */
export function loadOrMeasure(
  hw: CalibrationHardware,
  opts: LoadOrMeasureOptions,
): LoadedCalibration {
  const key = calibrationKey(hw);
  let cacheError: string | undefined;
  if (opts.file && !opts.recalibrate) {
    try {
      const cached = readCalibration(opts.file, key);
      if (cached) return { tables: cached, source: "cache" };
    } catch (e) {
      if (!(e instanceof CalibrationCacheError)) throw e;
      cacheError = e.message;
    }
  }
  const tables = opts.measure();
  if (opts.file) {
    try {
      writeCalibration(opts.file, key, tables);
    } catch (e) {
      // Keep the read problem too: it is what made the file need rewriting.
      const write = `calibration cache ${opts.file}: cannot be written: ${(e as Error).message}`;
      cacheError = cacheError ? `${cacheError}; ${write}` : write;
    }
  }
  return { tables, source: "measured", cacheError };
}
