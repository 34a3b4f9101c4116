/**
 * The SSD tier's cache files: lock each file before anything reads or sizes
 * it (one server per file), size it to its share of the capacity (capped to
 * the filesystem's free space), and read or write its superblock (a
 * generation that changes on reset and on a format or segment-size change,
 * so old records can never come back). A path that cannot be used is logged
 * and skipped; with none left the tier does not start.
 *
 * @module
 */

import { FileFlag, fsSpace, type Uring } from "../../ffi/uring.ts";
import { decodeSuperblock, encodeSuperblock, newGeneration, PAGE_BYTES } from "./format.ts";
import type { SsdIo } from "./io.ts";
import { lockCacheFile, SsdLockedError } from "./file_lock.ts";
import type { Logger } from "../log.ts";

/** File created inside a directory given as a cache path. */
export const CACHE_FILE_NAME = "pegaflow-ssd.cache";
/** Free space left to the filesystem when capping capacity (metadata, other users). */
const FREE_SPACE_RESERVE_FRACTION = 0.02;

/** One open cache file. */
export interface CacheFile {
  path: string;
  /** Held open with the exclusive advisory lock until close. */
  lock: Deno.FsFile;
  handle: number;
  segments: number;
  generation: number;
  direct: boolean;
  /** Size found at open, before the file was sized to its capacity (records past it are torn). */
  sizeAtOpen: number;
}

/** The tier could not start on any path (the server runs without it). */
export class SsdOpenError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "SsdOpenError";
  }
}

function isDirectory(path: string): boolean {
  try {
    return Deno.statSync(path).isDirectory;
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return false;
    throw e;
  }
}

function fileSize(path: string): number {
  try {
    return Deno.statSync(path).size;
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return 0;
    throw e;
  }
}

/**
 * Locks every cache file (a directory names the file inside it). A path
 * that cannot be opened maps to its error (logged and skipped later, like
 * any unusable path); a file another process holds refuses the whole start.
 *
 * @throws SsdLockedError naming the file and the holder.
 */
export function lockPaths(paths: string[]): Map<string, Deno.FsFile | Error> {
  const out = new Map<string, Deno.FsFile | Error>();
  try {
    for (const given of paths) {
      let path = given;
      try {
        if (isDirectory(given)) path = `${given.replace(/\/+$/, "")}/${CACHE_FILE_NAME}`;
        if (out.has(path)) continue; // the same file named twice is one file
        // ... and so is one file named through a symlink or a hard link: locking it again
        // would find this process's own lock and refuse the start.
        if (sameFileLocked(path, out)) continue;
        out.set(path, lockCacheFile(path));
      } catch (e) {
        // Unusable (not a directory on the way, a loop, no permission): skipped like the rest.
        if (e instanceof SsdLockedError) throw e;
        if (!out.has(path)) out.set(path, e as Error);
      }
    }
  } catch (e) {
    for (const l of out.values()) if (!(l instanceof Error)) l.close();
    throw e;
  }
  return out;
}

/** True when `path` is (through a link) a file already locked in `locked`. */
function sameFileLocked(path: string, locked: Map<string, Deno.FsFile | Error>): boolean {
  let st: Deno.FileInfo;
  try {
    st = Deno.statSync(path);
  } catch (_e) {
    return false; // not there yet (created when locked) or unusable: lockCacheFile says why
  }
  for (const l of locked.values()) {
    if (l instanceof Error) continue;
    const o = l.statSync();
    if (o.dev === st.dev && o.ino !== null && o.ino === st.ino) return true;
  }
  return false;
}

function dirOf(path: string): string {
  const i = path.lastIndexOf("/");
  return i <= 0 ? (i === 0 ? "/" : ".") : path.slice(0, i);
}

/** What sizing a cache file needs. */
interface SizeOptions {
  capacityBytes: number;
  segmentBytes: number;
  direct: boolean;
}

/**
 * Opens and sizes every locked path; a path that fails is logged, its lock
 * dropped, and skipped. The capacity is split over the paths that can be
 * used: an unusable one (not opened, no room for a segment) gets no share,
 * so the others hold what was asked (each capped to its free space).
 *
 * @throws SsdOpenError when no path is usable, with every path's reason.
 */
export async function openCacheFiles(
  uring: Uring,
  io: SsdIo,
  locks: Map<string, Deno.FsFile | Error>,
  opts: SizeOptions,
  reset: boolean,
  log: Logger,
): Promise<CacheFile[]> {
  const problems: string[] = [];
  const handles = new Map<string, number>();
  const drop = (path: string, e: unknown): void => {
    const handle = handles.get(path);
    if (handle) uring.closeFile(handle);
    handles.delete(path);
    const lock = locks.get(path);
    if (lock && !(lock instanceof Error)) lock.close();
    locks.delete(path);
    problems.push(`${path}: ${(e as Error).message}`);
    log.error("SSD cache path is not usable", { path, error: (e as Error).message });
  };
  const given = locks.size;
  for (const [path, lock] of locks) {
    try {
      if (lock instanceof Error) throw lock;
      handles.set(
        path,
        uring.openFile(path, FileFlag.CREATE | (opts.direct ? FileFlag.DIRECT : 0)),
      );
    } catch (e) {
      drop(path, e);
    }
  }
  const plan = planSegments([...handles.keys()], opts, drop, log);
  if (plan.size > 0 && plan.size < given) {
    log.warn("SSD cache capacity split over the usable paths only", {
      paths_given: given,
      paths_usable: plan.size,
      capacity_bytes: opts.capacityBytes,
    });
  }
  const files: CacheFile[] = [];
  for (const [path, segments] of plan) {
    const lock = locks.get(path) as Deno.FsFile;
    try {
      files.push(
        await openCacheFile(uring, io, path, lock, handles.get(path)!, segments, opts, reset, log),
      );
    } catch (e) {
      drop(path, e);
    }
  }
  if (files.length === 0) {
    throw new SsdOpenError(`no SSD cache path is usable: ${problems.join("; ")}`);
  }
  return files;
}

/**
 * Segments per path: the capacity split evenly over the paths whose
 * filesystem has room for a segment, each share capped to that room
 * (logged). A path with no room is dropped before the split (its share goes
 * to the others); a share too small for a segment drops every path.
 */
function planSegments(
  paths: string[],
  opts: SizeOptions,
  drop: (path: string, e: unknown) => void,
  log: Logger,
): Map<string, number> {
  const need = PAGE_BYTES + opts.segmentBytes;
  const room = new Map<string, number>();
  for (const path of paths) {
    try {
      const bytes = usableBytes(path);
      if (bytes >= need) room.set(path, bytes);
      else {
        drop(
          path,
          new Error(`free space ${bytes} bytes holds no ${opts.segmentBytes}-byte segment`),
        );
      }
    } catch (e) {
      drop(path, e);
    }
  }
  const plan = new Map<string, number>();
  if (room.size === 0) return plan;
  const share = Math.floor(opts.capacityBytes / room.size);
  for (const [path, usable] of room) {
    if (share < need) {
      drop(path, new Error(`capacity ${share} bytes holds no ${opts.segmentBytes}-byte segment`));
      continue;
    }
    if (share > usable) {
      log.info("SSD cache capacity capped to the free space of its filesystem", {
        path,
        asked_bytes: share,
        capped_bytes: usable,
      });
    }
    plan.set(path, Math.floor((Math.min(share, usable) - PAGE_BYTES) / opts.segmentBytes));
  }
  return plan;
}

/**
 * Opens one cache file, already open as `h`, with `segments` segments:
 * keeps its generation when its superblock matches, else starts it empty
 * under a new one.
 */
async function openCacheFile(
  uring: Uring,
  io: SsdIo,
  path: string,
  lock: Deno.FsFile,
  h: number,
  segments: number,
  opts: SizeOptions,
  reset: boolean,
  log: Logger,
): Promise<CacheFile> {
  const info = uring.fileInfo(h);
  if (opts.direct && !info.direct) {
    log.warn("the filesystem refused O_DIRECT; running through the page cache", { path });
  }
  let generation = 0;
  if (!reset && info.sizeBytes >= PAGE_BYTES) {
    generation = await keptGeneration(io, h, path, segments, opts.segmentBytes, log);
  }
  if (generation === 0) {
    generation = newGeneration();
    uring.truncate(h, 0); // a reset frees the old records' space at once
  }
  uring.truncate(h, PAGE_BYTES + segments * opts.segmentBytes);
  await writeSuper(io, h, {
    generation,
    segmentBytes: opts.segmentBytes,
    segmentCount: segments,
    createdAtMs: Date.now(),
  }, path);
  return {
    path,
    lock,
    handle: h,
    segments,
    generation,
    direct: info.direct,
    sizeAtOpen: reset ? 0 : info.sizeBytes,
  };
}

/**
 * Bytes a cache file may take: its filesystem's free space (less a reserve)
 * plus what the file holds already.
 */
function usableBytes(path: string): number {
  const space = fsSpace(dirOf(path));
  return Math.floor((space.availableBytes + fileSize(path)) * (1 - FREE_SPACE_RESERVE_FRACTION));
}

/**
 * The generation of an existing file's superblock when its records can be
 * kept (same format and segment size), else 0 (logged): the file starts empty.
 */
async function keptGeneration(
  io: SsdIo,
  handle: number,
  path: string,
  segments: number,
  segmentBytes: number,
  log: Logger,
): Promise<number> {
  const sb = await readSuper(io, handle);
  if (typeof sb === "string") {
    // An older format is never misread: its records are dropped with the generation.
    log.warn("SSD cache file not read: starting this file empty", { path, problem: sb });
    return 0;
  }
  if (sb.segmentBytes !== segmentBytes) {
    log.warn("SSD cache file written with another segment size: starting it empty", {
      path,
      on_disk_segment_bytes: sb.segmentBytes,
      segment_bytes: segmentBytes,
    });
    return 0;
  }
  if (sb.segmentCount !== segments) {
    log.info("SSD cache file resized: keeping its first segments", {
      path,
      on_disk_segments: sb.segmentCount,
      segments,
      kept: Math.min(sb.segmentCount, segments),
    });
  }
  return sb.generation;
}

async function readSuper(io: SsdIo, handle: number) {
  const b = io.newBatch();
  b.read(handle, 0, true, [], false);
  const r = await io.run(b);
  try {
    if (r.status[0] !== 0) return `superblock read failed: ${r.errorText(0)}`;
    return decodeSuperblock(r.header(0));
  } finally {
    r.release();
  }
}

async function writeSuper(
  io: SsdIo,
  handle: number,
  sb: Parameters<typeof encodeSuperblock>[1],
  path: string,
): Promise<void> {
  const b = io.newBatch();
  const i = b.write(handle, 0, true, []);
  encodeSuperblock(b.headerPage(i), sb);
  const r = await io.run(b);
  r.release();
  if (r.status[0] !== 0) {
    throw new Error(
      `writing the superblock of ${path} failed: ${r.errorText(0)} (errno ${r.aux[0]})`,
    );
  }
}
