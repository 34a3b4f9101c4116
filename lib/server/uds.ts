/**
 * The Unix-domain socket file of `--uds PATH`: who may take the path at
 * start, and who removes it at shutdown.
 *
 * A server killed without a shutdown (SIGKILL, a crash) leaves its socket
 * file behind, and binding over it fails with "address in use" although
 * nobody listens. So at start a path that is a socket nobody accepts on is
 * stale and removed; a path a live server accepts on is refused (removing it
 * would silently steal that server's clients), and so is a path that is not a
 * socket at all (a typo must not delete a file). At shutdown the file is
 * removed only if it is still the one this server bound (same inode): a
 * second server may have claimed the path since.
 *
 * Probing then removing is not atomic: two servers started at once on one
 * path could both find it stale, and the second's removal would take the
 * first's fresh socket (which then serves on an unlinked file nobody
 * reaches). So a server first takes the path's lock, an advisory `flock` on
 * `PATH.lock` held from its first probe to its stop ({@link lockSocketPath});
 * only the holder probes, removes or binds `PATH`, `PATH.up` and `PATH.rpc`.
 * The kernel drops the lock when its holder dies: a crashed server's lock
 * file blocks nobody.
 *
 * @module
 */

import { LOCAL_RPC_SUFFIX } from "../local_rpc/wire.ts";
import { LATE, within } from "../timer_limit.ts";

/** `sun_path` holds 108 bytes on Linux, the terminating NUL included. */
const SUN_PATH_BYTES = 107;
/**
 * Suffix of the socket grpc-js listens on behind the GOAWAY guard of `--uds`
 * (lib/server/server.ts): `PATH.up`, beside the public one.
 */
export const UPSTREAM_SUFFIX = ".up";
/** Longest `--uds` path: `PATH.up` and `PATH.rpc` must fit a `sun_path` too. */
export const MAX_UDS_PATH_BYTES = SUN_PATH_BYTES -
  Math.max(UPSTREAM_SUFFIX.length, LOCAL_RPC_SUFFIX.length);
/** The upstream socket is for the relay alone: only the server's user may connect. */
export const UPSTREAM_SOCKET_MODE = 0o600;

/**
 * Where grpc-js listens behind the guard of the `--uds` socket at `path`.
 *
 * @example
 * ```ts
 * upstreamSocketPath("/run/pegaflow/grpc.sock"); // "/run/pegaflow/grpc.sock.up"
 * ```
 */
export function upstreamSocketPath(path: string): string {
  return path + UPSTREAM_SUFFIX;
}
/**
 * Where the local RPC socket of the `--uds` socket at `path` is.
 *
 * @example
 * ```ts
 * localRpcSocketPath("/run/pegaflow/grpc.sock"); // "/run/pegaflow/grpc.sock.rpc"
 * ```
 */
export function localRpcSocketPath(path: string): string {
  return path + LOCAL_RPC_SUFFIX;
}
/** How long a probe connect to an existing socket may take before it counts as live. */
const PROBE_TIMEOUT_MS = 1_000;

/** Why a path cannot be served on; the message names the path. */
export class UdsPathError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "UdsPathError";
  }
}

/** What {@link claimSocketPath} found at the path. */
export type ClaimOutcome = "free" | "removed_stale";

/**
 * Makes `path` free to bind: nothing there, or a stale socket (removed).
 * Throws {@link UdsPathError} when a live server accepts on it, or when it is
 * not a socket.
 *
 * @example
 * ```ts
 * if (await claimSocketPath("/run/pegaflow.sock") === "removed_stale") log.info("stale socket removed");
 * ```
 */
export async function claimSocketPath(path: string): Promise<ClaimOutcome> {
  let info: Deno.FileInfo;
  try {
    info = await Deno.lstat(path);
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return "free";
    throw new UdsPathError(`cannot inspect ${path}: ${(e as Error).message}`);
  }
  if (!info.isSocket) {
    throw new UdsPathError(`${path} exists and is not a socket; refusing to replace it`);
  }
  if (await acceptsConnections(path)) {
    throw new UdsPathError(
      `${path} is in use: another process accepts connections on it (stop it, or pick another path)`,
    );
  }
  try {
    await Deno.remove(path);
  } catch (e) {
    // Another starting server may have removed it first: free either way.
    if (!(e instanceof Deno.errors.NotFound)) {
      throw new UdsPathError(`cannot remove the stale socket ${path}: ${(e as Error).message}`);
    }
  }
  return "removed_stale";
}

/** Whether something accepts a connection on the socket at `path` (a refusal means stale). */
async function acceptsConnections(path: string): Promise<boolean> {
  const connecting = Deno.connect({ transport: "unix", path });
  try {
    const conn = await within(connecting, PROBE_TIMEOUT_MS);
    // A listener too busy to accept within the probe's deadline is still alive.
    if (conn === LATE) {
      connecting.then((c) => c.close(), () => {});
      return true;
    }
    conn.close();
    return true;
  } catch (e) {
    if (e instanceof Deno.errors.ConnectionRefused || e instanceof Deno.errors.NotFound) {
      return false;
    }
    throw new UdsPathError(`cannot probe ${path}: ${(e as Error).message}`);
  }
}

/** Suffix of the lock file beside `--uds PATH` whose holder owns the path. */
export const LOCK_SUFFIX = ".lock";
/**
 * Lock attempts before giving up: one fails only when a stopping holder
 * removed the file between our open and our lock (we then hold a lock on a
 * file no longer at the path), so a second attempt is expected to succeed.
 */
const LOCK_ATTEMPTS = 3;

/**
 * The lock file of the `--uds` socket at `path`.
 *
 * @example
 * ```ts
 * socketLockPath("/run/pegaflow/grpc.sock"); // "/run/pegaflow/grpc.sock.lock"
 * ```
 */
export function socketLockPath(path: string): string {
  return path + LOCK_SUFFIX;
}

/** The claim on a `--uds` path: held until {@link SocketPathLock.release}. */
export interface SocketPathLock {
  /** The lock file, `PATH.lock`. */
  readonly lockPath: string;
  /** Removes the lock file (if still ours) and drops the lock; a second call does nothing. */
  release(): Promise<void>;
}

/**
 * Takes the claim on the `--uds` socket at `path`: an exclusive `flock` on
 * `PATH.lock`, which records the holder's pid. Throws {@link UdsPathError}
 * (`PATH is in use: another server is starting or serving on it (pid N
 * holds PATH.lock)`) when another process holds it; never waits.
 *
 * @example
 * ```ts
 * const lock = await lockSocketPath("/run/pegaflow/grpc.sock");
 * try {
 *   await claimSocketPath("/run/pegaflow/grpc.sock"); // then bind
 * } finally {
 *   await lock.release(); // at shutdown
 * }
 * ```
 */
export async function lockSocketPath(path: string): Promise<SocketPathLock> {
  const lockPath = socketLockPath(path);
  for (let attempt = 1;; attempt++) {
    const file = await openLockFile(lockPath);
    let kept = false;
    try {
      if (!(await file.tryLock(true))) {
        throw new UdsPathError(
          `${path} is in use: another server is starting or serving on it (${await lockHolder(
            lockPath,
          )} holds ${lockPath})`,
        );
      }
      const ino = (await file.stat()).ino;
      if (await isFileAt(lockPath, ino)) {
        await file.truncate(0);
        await file.write(new TextEncoder().encode(`${Deno.pid}\n`));
        kept = true;
        return heldLock(lockPath, file, ino);
      }
      if (attempt >= LOCK_ATTEMPTS) {
        throw new UdsPathError(`cannot lock ${lockPath}: it was replaced while being locked`);
      }
    } catch (e) {
      if (e instanceof UdsPathError) throw e;
      // A filesystem without flock (ENOLCK), a FIFO at the path: the OS's reason alone names nothing.
      throw new UdsPathError(`cannot lock ${lockPath}: ${(e as Error).message}`);
    } finally {
      if (!kept) file.close();
    }
  }
}

/** Opens (creating) the lock file; an error names it. */
async function openLockFile(lockPath: string): Promise<Deno.FsFile> {
  try {
    return await Deno.open(lockPath, { read: true, write: true, create: true, mode: 0o644 });
  } catch (e) {
    throw new UdsPathError(`cannot open the lock file ${lockPath}: ${(e as Error).message}`);
  }
}

/** Who holds the lock, as its file says (`pid 1234`), for the refusal. */
async function lockHolder(lockPath: string): Promise<string> {
  try {
    const pid = (await Deno.readTextFile(lockPath)).trim();
    if (/^\d+$/.test(pid)) return `pid ${pid}`;
  } catch (_e) {
    // Removed meanwhile, or unreadable: the holder's pid is only a hint.
  }
  return "another process";
}

/** Whether the file at `path` is still the inode `ino` (a stopping holder removes its lock file). */
async function isFileAt(path: string, ino: number | null): Promise<boolean> {
  try {
    return (await Deno.lstat(path)).ino === ino;
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return false;
    throw new UdsPathError(`cannot inspect ${path}: ${(e as Error).message}`);
  }
}

/** The held lock: released by removing its file while still locked, then closing it. */
function heldLock(lockPath: string, file: Deno.FsFile, ino: number | null): SocketPathLock {
  let released: Promise<void> | undefined;
  const release = async () => {
    try {
      // Removed while locked: whoever opened this file meanwhile finds it gone and retries.
      if (await isFileAt(lockPath, ino)) await Deno.remove(lockPath);
    } catch (e) {
      if (!(e instanceof Deno.errors.NotFound)) throw e;
    } finally {
      file.close();
    }
  };
  return { lockPath, release: () => released ??= release() };
}

/** Identity of a bound socket file, to remove exactly that file later. */
export interface BoundSocket {
  path: string;
  ino: number | null;
}

/**
 * Records the identity of the socket file just bound at `path`.
 *
 * @example
 * ```ts
 * const bound = await boundSocket(path);
 * // ... at shutdown
 * await releaseSocketPath(bound);
 * ```
 */
export async function boundSocket(path: string): Promise<BoundSocket> {
  return { path, ino: (await Deno.lstat(path)).ino };
}

/**
 * Removes the socket file if it is still the one this server bound; returns
 * whether it did.
 *
 * @example
 * ```ts
 * await releaseSocketPath(bound);
 * ```
 */
export async function releaseSocketPath(bound: BoundSocket): Promise<boolean> {
  try {
    const info = await Deno.lstat(bound.path);
    if (!info.isSocket || info.ino !== bound.ino) return false;
    await Deno.remove(bound.path);
    return true;
  } catch (e) {
    // Already gone (an operator removed it): nothing to release.
    if (e instanceof Deno.errors.NotFound) return false;
    throw e;
  }
}
