/**
 * The SSD tier's cache files, once locked (file_lock.ts: one server per
 * file): size each to its share of the capacity (capped to the filesystem's
 * free space), and read or write its superblock (a generation that changes
 * on reset and on a format or segment-size change, so old records can never
 * come back). A path that cannot be used is logged and skipped; with none
 * left the tier does not start. Every filesystem call runs off the JS thread
 * with a deadline (open_fs.ts); once the open gave up (a call past it, or
 * its io stalled) nothing here goes on: each step checks first.
 *
 * @module
 */

import { FileFlag, type Uring } from "../../ffi/uring.ts";
import { decodeSuperblock, encodeSuperblock, newGeneration, PAGE_BYTES } from "./format.ts";
import type { SsdIo } from "./io.ts";
import { type OpenFs, passHung } from "./open_fs.ts";
import type { LockFile } from "./lock_thread.ts";
import type { Logger } from "../log.ts";

export { CACHE_FILE_NAME } from "./file_lock.ts";
/** Free space left to the filesystem when capping capacity (metadata, other users). */
const FREE_SPACE_RESERVE_FRACTION = 0.02;

/** One open cache file. */
export interface CacheFile {
  path: string;
  /** Held open with the exclusive advisory lock until close (on the lock thread). */
  lock: LockFile;
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

/** What sizing a cache file needs. */
interface SizeOptions {
  capacityBytes: number;
  segmentBytes: number;
  direct: boolean;
}

/** An opened cache file before it is sized: what its superblock says it may keep. */
interface Found {
  handle: number;
  direct: boolean;
  sizeAtOpen: number;
  /** The generation kept, or a new one when `fresh` (its old records are never read). */
  generation: number;
  fresh: boolean;
  /** Segments the kept superblock names (0 when fresh). */
  onDiskSegments: number;
}

/**
 * Opens and sizes every locked path; a path that fails is logged, its lock
 * dropped, and skipped. The capacity is split over the paths that can be
 * used: an unusable one (not opened, no room for a segment, its superblock
 * not written) gets no share, so the others hold what was asked (capped to
 * the free space of their filesystems). Every filesystem call goes through
 * `bounded` (off the JS thread, with a deadline).
 *
 * @throws SsdOpenError when no path is usable, with every path's reason.
 * @throws SsdFsHung when a filesystem call passed its deadline (the whole open gives up).
 * @throws SsdOpenAbandoned once the open gave up otherwise (its io stalled, `bounded.abandon`).
 */
export async function openCacheFiles(
  uring: Uring,
  io: SsdIo,
  locks: Map<string, LockFile | Error>,
  bounded: OpenFs,
  opts: SizeOptions,
  reset: boolean,
  log: Logger,
): Promise<CacheFile[]> {
  const problems: string[] = [];
  const found = new Map<string, Found>();
  const handles = new Map<string, number>();
  const drop = async (path: string, e: unknown): Promise<void> => {
    passHung(e); // not an unusable path: the open gives up
    bounded.check(); // nor is an io refused because the open gave up: nothing more runs
    const handle = handles.get(path);
    handles.delete(path);
    if (handle !== undefined) await bounded.closeFile(handle, path);
    found.delete(path);
    const lock = locks.get(path);
    if (lock && !(lock instanceof Error)) await bounded.closeLock(lock, path);
    locks.delete(path);
    problems.push(`${path}: ${(e as Error).message}`);
    log.error("SSD cache path is not usable", { path, error: (e as Error).message });
  };
  const given = locks.size;
  for (const [path, lock] of locks) {
    try {
      if (lock instanceof Error) throw lock;
      const flags = FileFlag.CREATE | (opts.direct ? FileFlag.DIRECT : 0);
      const h = await bounded.openFile(uring.handle, path, flags);
      handles.set(path, h);
      io.namePath(h, path);
      found.set(path, await inspectCacheFile(bounded, io, path, h, opts, reset, log));
    } catch (e) {
      await drop(path, e);
    }
  }
  // A path whose sizing fails after the plan gives its share back: the rest are planned again.
  let plan = new Map<string, Share>();
  for (let sized = false; !sized;) {
    plan = await planSegments([...found.keys()], bounded, opts, drop);
    sized = true;
    for (const [path, share] of plan) {
      try {
        const lock = locks.get(path) as LockFile;
        const f = found.get(path)!;
        await sizeCacheFile(bounded, io, path, lock, f, share.segments, opts, log);
      } catch (e) {
        await drop(path, e);
        sized = false;
      }
    }
  }
  bounded.check(); // the last superblock write may have returned after the open gave up
  logPlan(log, plan, given, opts.capacityBytes);
  if (plan.size === 0) {
    throw new SsdOpenError(`no SSD cache path is usable: ${problems.join("; ")}`);
  }
  return [...plan].map(([path, { segments }]) => {
    const f = found.get(path)!;
    return {
      path,
      lock: locks.get(path) as LockFile,
      handle: f.handle,
      segments,
      generation: f.generation,
      direct: f.direct,
      sizeAtOpen: reset ? 0 : f.sizeAtOpen,
    };
  });
}

/** Logs the shares that were capped, and a split over fewer paths than given. */
function logPlan(log: Logger, plan: Map<string, Share>, given: number, capacity: number): void {
  for (const [path, s] of plan) {
    if (s.askedBytes <= s.roomBytes) continue;
    log.info("SSD cache capacity capped to the free space of its filesystem", {
      path,
      asked_bytes: s.askedBytes,
      capped_bytes: s.roomBytes,
      filesystem_room_bytes: s.filesystemRoomBytes,
      shared_with: s.sharedWith.join(", "),
    });
  }
  if (plan.size > 0 && plan.size < given) {
    log.warn("SSD cache capacity split over the usable paths only", {
      paths_given: given,
      paths_usable: plan.size,
      capacity_bytes: capacity,
    });
  }
}

/** Cache paths on one filesystem, and the bytes they may take together. */
interface Filesystem {
  paths: string[];
  roomBytes: number;
}

/**
 * The paths grouped by the filesystem their file lies on (its device; the
 * file is open, so a symlink is followed to where the bytes go): the files
 * are sparse, so paths on one filesystem take from one free space, and each
 * file's own bytes count once (what it holds, not its sparse size).
 */
async function filesystemsOf(
  paths: string[],
  bounded: OpenFs,
  drop: (path: string, e: unknown) => Promise<void>,
): Promise<Filesystem[]> {
  const byDevice = new Map<number, { paths: string[]; available: number; held: number }>();
  for (const path of paths) {
    try {
      const st = await bounded.stat(path);
      let fs = byDevice.get(st.dev);
      if (!fs) {
        fs = { paths: [], available: (await bounded.fsSpace(path)).availableBytes, held: 0 };
        byDevice.set(st.dev, fs);
      }
      fs.paths.push(path);
      // st_blocks counts 512-byte units whatever the filesystem's block size.
      fs.held += st.blocks === null ? st.size : st.blocks * 512;
    } catch (e) {
      await drop(path, e);
    }
  }
  return [...byDevice.values()].map((fs) => ({
    paths: fs.paths,
    roomBytes: Math.floor((fs.available + fs.held) * (1 - FREE_SPACE_RESERVE_FRACTION)),
  }));
}

/** One path's part of the capacity. */
interface Share {
  segments: number;
  /** Its even share of the capacity, and what its filesystem leaves it. */
  askedBytes: number;
  roomBytes: number;
  filesystemRoomBytes: number;
  /** The other cache paths on its filesystem. */
  sharedWith: string[];
}

/**
 * Segments per path: the capacity split evenly over the paths that have
 * room for a segment, each share capped to its part of its filesystem's
 * room (the paths on one filesystem split it evenly, so together they never
 * take more than it has). A path with no room is dropped before the split
 * (its share goes to the others); a share too small for a segment drops
 * every path.
 */
async function planSegments(
  paths: string[],
  bounded: OpenFs,
  opts: SizeOptions,
  drop: (path: string, e: unknown) => Promise<void>,
): Promise<Map<string, Share>> {
  const need = PAGE_BYTES + opts.segmentBytes;
  const room = new Map<string, Omit<Share, "segments" | "askedBytes">>();
  for (const fs of await filesystemsOf(paths, bounded, drop)) {
    // As many of its paths as it has room for a segment each; the last ones go.
    let n = fs.paths.length;
    while (n > 0 && Math.floor(fs.roomBytes / n) < need) n--;
    const kept = fs.paths.slice(0, n);
    for (const path of fs.paths.slice(n)) {
      const beside = n === 0 ? "" : ` beside ${n} other cache path(s) on it (${kept.join(", ")})`;
      await drop(
        path,
        new Error(
          `free space ${fs.roomBytes} bytes holds no ${opts.segmentBytes}-byte segment${beside}`,
        ),
      );
    }
    for (const path of kept) {
      room.set(path, {
        roomBytes: Math.floor(fs.roomBytes / n),
        filesystemRoomBytes: fs.roomBytes,
        sharedWith: kept.filter((p) => p !== path),
      });
    }
  }
  const plan = new Map<string, Share>();
  if (room.size === 0) return plan;
  const share = Math.floor(opts.capacityBytes / room.size);
  for (const path of paths) {
    const r = room.get(path);
    if (!r) continue;
    if (share < need) {
      await drop(
        path,
        new Error(`capacity ${share} bytes holds no ${opts.segmentBytes}-byte segment`),
      );
      continue;
    }
    const bytes = Math.min(share, r.roomBytes);
    plan.set(path, {
      ...r,
      askedBytes: share,
      segments: Math.floor((bytes - PAGE_BYTES) / opts.segmentBytes),
    });
  }
  return plan;
}

/**
 * What an opened cache file keeps: its superblock's generation when the
 * superblock matches (and no reset), else a new one (the file starts empty).
 */
async function inspectCacheFile(
  bounded: OpenFs,
  io: SsdIo,
  path: string,
  h: number,
  opts: SizeOptions,
  reset: boolean,
  log: Logger,
): Promise<Found> {
  const info = await bounded.fileInfo(h, path);
  if (opts.direct && !info.direct) {
    log.warn("the filesystem refused O_DIRECT; running through the page cache", { path });
  }
  let kept: { generation: number; segments: number } | undefined;
  if (!reset && info.sizeBytes >= PAGE_BYTES) {
    kept = await keptGeneration(io, bounded, h, path, opts.segmentBytes, log);
  }
  return {
    handle: h,
    direct: info.direct,
    sizeAtOpen: info.sizeBytes,
    generation: kept?.generation ?? newGeneration(),
    fresh: !kept,
    onDiskSegments: kept?.segments ?? 0,
  };
}

/**
 * Sizes a cache file to `segments` segments (through its lock's open file:
 * the same file) and writes its superblock. A fresh file is emptied first (a
 * reset frees the old records' space at once). Safe to repeat: the plan may
 * change when another path fails.
 */
async function sizeCacheFile(
  bounded: OpenFs,
  io: SsdIo,
  path: string,
  lock: LockFile,
  f: Found,
  segments: number,
  opts: SizeOptions,
  log: Logger,
): Promise<void> {
  if (!f.fresh && f.onDiskSegments !== segments) {
    log.info("SSD cache file resized: keeping its first segments", {
      path,
      on_disk_segments: f.onDiskSegments,
      segments,
      kept: Math.min(f.onDiskSegments, segments),
    });
  }
  if (f.fresh) await bounded.truncate(lock, path, 0);
  await bounded.truncate(lock, path, PAGE_BYTES + segments * opts.segmentBytes);
  await writeSuper(io, f.handle, {
    generation: f.generation,
    segmentBytes: opts.segmentBytes,
    segmentCount: segments,
    createdAtMs: Date.now(),
  }, path);
}

/**
 * The generation and segment count of an existing file's superblock when its
 * records can be kept (same format and segment size), else undefined
 * (logged): the file starts empty.
 */
async function keptGeneration(
  io: SsdIo,
  bounded: OpenFs,
  handle: number,
  path: string,
  segmentBytes: number,
  log: Logger,
): Promise<{ generation: number; segments: number } | undefined> {
  const sb = await readSuper(io, handle);
  bounded.check(); // a read that stalled the open returned: the open is gone
  if (typeof sb === "string") {
    // An older format is never misread: its records are dropped with the generation.
    log.warn("SSD cache file not read: starting this file empty", { path, problem: sb });
    return undefined;
  }
  if (sb.segmentBytes !== segmentBytes) {
    log.warn("SSD cache file written with another segment size: starting it empty", {
      path,
      on_disk_segment_bytes: sb.segmentBytes,
      segment_bytes: segmentBytes,
    });
    return undefined;
  }
  return { generation: sb.generation, segments: sb.segmentCount };
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
