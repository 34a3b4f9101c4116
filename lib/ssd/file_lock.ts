/**
 * One server per SSD cache file. Two servers on one file would each append
 * records the other's index does not know and reuse segments under each
 * other's blocks: the first silently loses its cache. So a server takes an
 * exclusive advisory lock (`flock`, on a thread of its own: lock_thread.ts) on
 * every cache file before it reads or sizes it, holds it while it runs (the
 * kernel drops it when the process dies, even on kill -9), and a second
 * server is refused with the file and the holder's pid.
 *
 * The holder is read from `/proc/locks` (the kernel's own table: never
 * stale, unlike a pid written to a file) by the file's device and inode.
 *
 * @module
 */

import { OpenFs, passHung, SsdOpenAbandoned } from "./open_fs.ts";
import type { LockFile } from "./lock_thread.ts";

/** File created inside a directory given as a cache path. */
export const CACHE_FILE_NAME = "pegaflow-ssd.cache";

/** The cache file is held by another process: the server must not start. */
export class SsdLockedError extends Error {
  readonly path: string;
  /** Pid of the holder, when the kernel's lock table shows it. */
  readonly holderPid: number | undefined;

  constructor(path: string, holderPid: number | undefined, holderCmd: string | undefined) {
    const who = holderPid === undefined
      ? "another process (its pid is not visible in /proc/locks)"
      : `process ${holderPid}${holderCmd ? ` (${holderCmd})` : ""}`;
    super(
      `SSD cache file ${path} is in use by ${who}; two servers cannot share one cache file: ` +
        `give this server its own --ssd-cache-path, or stop pid ${holderPid ?? "?"} first`,
    );
    this.name = "SsdLockedError";
    this.path = path;
    this.holderPid = holderPid;
  }
}

/**
 * Opens (creating it if missing) and exclusively locks `path`. The returned
 * file holds the lock until it is closed. Every filesystem call goes through
 * `fs` (off the JS thread, bounded by its deadline: a hung disk gives up the
 * open with {@link SsdFsHung} instead of freezing the server).
 *
 * @throws SsdLockedError when another process holds the file, or this
 *   process still holds it after `settleMs` (two tiers on one file); the OS
 *   error when it cannot be opened (missing directory, read-only filesystem).
 * @example
 * ```ts
 * const lock = await lockCacheFile("/mnt/nvme/pegaflow-ssd.cache");
 * // ... use the file ...
 * await lock.close(); // releases the lock
 * ```
 */
export async function lockCacheFile(
  path: string,
  settleMs = LOCK_SETTLE_MS,
  fs = new OpenFs(),
): Promise<LockFile> {
  const f = await fs.openRw(path);
  const until = performance.now() + settleMs;
  try {
    for (;;) {
      if (await fs.tryLock(f, path)) return f;
      const info = await fs.fstat(f, path);
      const pid = await lockHolder(info.dev, info.ino ?? -1, fs);
      // Another live process: refused at once. A lock in transition (this process's own,
      // closed but its file still shared with a child being spawned, or no holder left by
      // the time the table was read) is given up within `settleMs`: waited out.
      if ((pid !== undefined && pid !== Deno.pid) || performance.now() >= until) {
        const cmd = pid === undefined ? undefined : await commandOf(pid, fs);
        throw new SsdLockedError(path, pid, cmd);
      }
      await new Promise((r) => setTimeout(r, LOCK_RETRY_MS));
    }
  } catch (e) {
    // A hung filesystem may hang a close too: not on this thread, once the hung call returned
    // (and an open that gave up makes no call: its files close once none runs).
    if (e instanceof SsdOpenAbandoned) fs.closeWhenSettled(f);
    else await fs.closeLock(f, path);
    throw e;
  }
}

/**
 * Locks every cache file (a directory names the file inside it) into
 * `locks`, which the caller closes (also when this throws). A path that
 * cannot be opened maps to its error (logged and skipped later, like any
 * unusable path); a file another process holds refuses the whole start, and
 * so does a filesystem call past `fs`'s deadline ({@link SsdFsHung}).
 *
 * @throws SsdLockedError naming the file and the holder.
 */
export async function lockPaths(
  paths: string[],
  fs: OpenFs,
  locks: Map<string, LockFile | Error>,
): Promise<void> {
  const held: { dev: number; ino: number }[] = [];
  for (const given of paths) {
    let path = given;
    let mine: LockFile | undefined;
    try {
      if (await isDirectory(given, fs)) path = `${given.replace(/\/+$/, "")}/${CACHE_FILE_NAME}`;
      if (locks.has(path)) continue; // the same file named twice is one file
      // ... and so is one file named through a symlink or a hard link: locking it again
      // would find this process's own lock and refuse the start.
      const st = await fs.stat(path).catch((e) => (passHung(e), undefined));
      if (st && held.some((h) => h.dev === st.dev && st.ino !== null && h.ino === st.ino)) continue;
      mine = await lockCacheFile(path, LOCK_SETTLE_MS, fs);
      locks.set(path, mine);
      const info = await fs.fstat(mine, path);
      held.push({ dev: info.dev, ino: info.ino ?? -1 });
      // What the io engine can open (its own refusal's text stays on another thread).
      if (!info.isFile && !info.isBlockDevice) {
        throw new Error(`open ${path}: not a regular file or block device`);
      }
    } catch (e) {
      // Unusable (not a directory on the way, a loop, no permission): skipped like the rest.
      if (e instanceof SsdLockedError) throw e;
      passHung(e);
      if (mine) await fs.closeLock(mine, path);
      if (mine || !locks.has(path)) locks.set(path, e as Error);
    }
  }
}

async function isDirectory(path: string, fs: OpenFs): Promise<boolean> {
  try {
    return (await fs.stat(path)).isDirectory;
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return false;
    throw e;
  }
}

/**
 * How long a lock in transition is waited out. A flock belongs to the open file, which a
 * child forked at that moment shares until it execs: a cache file closed by this process
 * (an SSD tier reopened in place) can stay locked for that short while.
 */
export const LOCK_SETTLE_MS = 500;
const LOCK_RETRY_MS = 5;

/** Pid holding a FLOCK on (dev, ino) per /proc/locks, or undefined. */
export async function lockHolder(
  dev: number,
  ino: number,
  fs: OpenFs,
): Promise<number | undefined> {
  let table: string;
  try {
    table = await fs.readText("/proc/locks");
  } catch (e) {
    passHung(e);
    return undefined; // not Linux, or /proc not mounted: the message says the pid is unknown
  }
  // glibc's major()/minor() of st_dev; /proc/locks prints them in hex.
  const d = BigInt(dev);
  const major = Number(((d >> 8n) & 0xfffn) | ((d >> 32n) & ~0xfffn));
  const minor = Number((d & 0xffn) | ((d >> 12n) & ~0xffn));
  let inodeOnly: number | undefined;
  for (const line of table.split("\n")) {
    // "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5326088 0 EOF" (blocked waiters start with "->")
    const m = /^\d+:\s+FLOCK\s+\S+\s+\S+\s+(\d+)\s+([0-9a-f]+):([0-9a-f]+):(\d+)\s/.exec(line);
    if (!m || Number(m[4]) !== ino) continue;
    const pid = Number(m[1]);
    if (parseInt(m[2], 16) === major && parseInt(m[3], 16) === minor) return pid;
    inodeOnly ??= pid; // overlay filesystems may report another device
  }
  return inodeOnly;
}

/**
 * The holder's command line, for the message. Undefined when it cannot be
 * read: the holder may have just exited, be in another pid namespace, or be
 * stuck itself (reading its cmdline waits for its memory map's lock, which a
 * process hung on a disk can hold): then past the deadline, without giving
 * up the open.
 */
async function commandOf(pid: number, fs: OpenFs): Promise<string | undefined> {
  const text = await fs.optional(() => Deno.readTextFile(`/proc/${pid}/cmdline`));
  const cmd = (text ?? "").split("\0").filter((a) => a).join(" ");
  return cmd.length > 160 ? `${cmd.slice(0, 157)}...` : cmd || undefined;
}
