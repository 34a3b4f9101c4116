/**
 * One server per SSD cache file. Two servers on one file would each append
 * records the other's index does not know and reuse segments under each
 * other's blocks: the first silently loses its cache. So a server takes an
 * exclusive advisory lock (`flock`, through `Deno.FsFile.tryLockSync`) on
 * every cache file before it reads or sizes it, holds it while it runs (the
 * kernel drops it when the process dies, even on kill -9), and a second
 * server is refused with the file and the holder's pid.
 *
 * The holder is read from `/proc/locks` (the kernel's own table: never
 * stale, unlike a pid written to a file) by the file's device and inode.
 *
 * @module
 */

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
 * file holds the lock until it is closed.
 *
 * @throws SsdLockedError when another process holds the file, or this
 *   process still holds it after `settleMs` (two tiers on one file); the OS
 *   error when it cannot be opened (missing directory, read-only filesystem).
 * @example
 * ```ts
 * const lock = lockCacheFile("/mnt/nvme/pegaflow-ssd.cache");
 * // ... use the file ...
 * lock.close(); // releases the lock
 * ```
 */
export function lockCacheFile(path: string, settleMs = LOCK_SETTLE_MS): Deno.FsFile {
  const f = Deno.openSync(path, { read: true, write: true, create: true });
  const until = performance.now() + settleMs;
  try {
    for (;;) {
      if (f.tryLockSync(true)) return f;
      const info = f.statSync();
      const pid = lockHolder(info.dev, info.ino ?? -1);
      // Another live process: refused at once. A lock in transition (this process's own,
      // closed but its file still shared with a child being spawned, or no holder left by
      // the time the table was read) is given up within `settleMs`: waited out.
      if ((pid !== undefined && pid !== Deno.pid) || performance.now() >= until) {
        throw new SsdLockedError(path, pid, pid === undefined ? undefined : commandOf(pid));
      }
      sleepSync(LOCK_RETRY_MS);
    }
  } catch (e) {
    f.close();
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
const sleeper = new Int32Array(new SharedArrayBuffer(4));

function sleepSync(ms: number): void {
  Atomics.wait(sleeper, 0, 0, ms);
}

/** Pid holding a FLOCK on (dev, ino) per /proc/locks, or undefined. */
export function lockHolder(dev: number, ino: number): number | undefined {
  let table: string;
  try {
    table = Deno.readTextFileSync("/proc/locks");
  } catch (_e) {
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

function commandOf(pid: number): string | undefined {
  try {
    const argv = Deno.readTextFileSync(`/proc/${pid}/cmdline`).split("\0").filter((a) => a);
    const cmd = argv.join(" ");
    return cmd.length > 160 ? `${cmd.slice(0, 157)}...` : cmd || undefined;
  } catch (_e) {
    return undefined; // the holder may have just exited, or be in another pid namespace
  }
}
