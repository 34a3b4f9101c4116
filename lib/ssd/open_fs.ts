/**
 * The filesystem calls of the SSD tier's open, each off the JS thread and
 * bounded by a deadline. On a hung disk or a dead network mount a stat, an
 * open, a statvfs or an ftruncate of the cache path never returns; made on
 * the server's only JS thread (`Deno.statSync`, a plain FFI call), it froze
 * the server's start for good, saying nothing. Here every such call runs
 * where a hang cannot stop the thread (Deno's async fs ops; the library's
 * file calls off the JS thread, ffi/uring.ts) and is raced against
 * the deadline (`ioStallMs`, the one the open's io batches have). The first
 * call past it gives up the open ({@link SsdFsHung}, naming the call, the
 * path and the deadline) and every later call is refused at once: nothing
 * of the open goes on. So does an open that gave up for another reason (its
 * io stalled: {@link OpenFs.abandon}). A call that returns after the open
 * gave up acts on nothing: what it opened is closed ({@link OpenFs.settled}
 * says when).
 *
 * @module
 */

import type { FileInfo, FsSpace } from "../../ffi/structs.ts";
import {
  closeFileOffThread,
  fileInfoOffThread,
  fsSpaceOffThread,
  openFileOffThread,
} from "../../ffi/uring.ts";
import { DEFAULT_IO_STALL_MS } from "./io.ts";
import { type LockFile, type LockFileInfo, LockThread } from "./lock_thread.ts";
import { errorText, type Logger } from "../log.ts";
import { LATE, within } from "../timer_limit.ts";

/**
 * The open gave up (a call past its deadline, or its io stalled): every
 * later call of it is refused with this, and nothing of it goes on.
 */
export class SsdOpenAbandoned extends Error {
  override name = "SsdOpenAbandoned";
}

/** A filesystem call of the open did not return by its deadline: the open gives up. */
export class SsdFsHung extends SsdOpenAbandoned {
  override name = "SsdFsHung";
  constructor(readonly op: string, readonly path: string, readonly deadlineMs: number) {
    super(`${op} of ${path} did not return within ${deadlineMs} ms`);
  }
}

/** Rethrows `e` when it is a give-up: a per-path catch must not take it for an unusable path. */
export function passHung(e: unknown): void {
  if (e instanceof SsdOpenAbandoned) throw e;
}

/** What {@link within} answers when the deadline passed first. */
/**
 * The bounded filesystem calls of one open.
 *
 * @example
 * ```ts
 * const fs = new OpenFs(opts.ioStallMs, log);
 * const info = await fs.stat(path); // SsdFsHung past the deadline
 * // after a give-up: await fs.settled() before closing what the calls used
 * ```
 */
export class OpenFs {
  readonly deadlineMs: number;
  readonly #log: Logger | undefined;
  readonly #running = new Set<Promise<void>>();
  readonly #closeAfter: LockFile[] = [];
  /** Where the lock files' calls run (lock_thread.ts: none of them on the JS thread). */
  readonly #locks = new LockThread();
  #hung: SsdOpenAbandoned | undefined;

  constructor(deadlineMs = DEFAULT_IO_STALL_MS, log?: Logger) {
    this.deadlineMs = deadlineMs;
    this.#log = log;
  }

  /**
   * Gives the open up for `why` (its io stalled, stall.ts): every later call
   * is refused at once ({@link SsdOpenAbandoned}), and a call running now
   * acts on nothing once it returns (what it opened is closed). Before, the
   * io stall's give-up refused only the io: the open went on with statvfs,
   * ftruncate and opens, built the tier and logged it recovered.
   */
  abandon(why: string): void {
    this.#hung ??= new SsdOpenAbandoned(`the SSD open gave up: ${why}`);
  }

  /** Throws the give-up once the open gave up (between steps that make no call). */
  check(): void {
    if (this.#hung) throw this.#hung;
  }

  /**
   * `start()`'s result, or {@link SsdFsHung} once it did not settle within the
   * deadline (and {@link SsdOpenAbandoned} at once after a give-up). A result
   * that comes after the deadline, or after the open gave up meanwhile, is
   * handed to `dispose` (close what it opened), never to the caller.
   */
  async call<T>(
    op: string,
    path: string,
    start: () => Promise<T>,
    dispose?: (late: T) => unknown,
  ): Promise<T> {
    this.check();
    const t0 = performance.now();
    const work = start();
    this.#track(work);
    const first = await within(work, this.deadlineMs);
    if (first !== LATE && !this.#hung) return first;
    if (first !== LATE) {
      // Returned in time, but the open gave up meanwhile: nothing may use it.
      if (dispose) this.#track(Promise.resolve(first).then(dispose));
      throw this.#hung;
    }
    this.#hung ??= new SsdFsHung(op, path, this.deadlineMs);
    const returned = (outcome: string) =>
      this.#log?.warn("SSD open: a filesystem call returned after its deadline", {
        op,
        path,
        deadline_ms: this.deadlineMs,
        returned_after_ms: Math.round(performance.now() - t0),
        outcome,
      });
    this.#track(work.then(async (late) => {
      try {
        if (dispose) await dispose(late);
        returned(dispose ? "returned; what it opened is closed" : "returned");
      } catch (e) {
        returned(`returned; closing what it opened failed: ${errorText(e)}`);
      }
    }, (e) => returned(`failed: ${errorText(e)}`)));
    throw this.#hung;
  }

  /**
   * `start()`'s result, or undefined past the deadline, without giving up
   * the open (for what only improves a message, e.g. a lock holder's command).
   */
  async optional<T>(start: () => Promise<T>): Promise<T | undefined> {
    this.check();
    const work = start();
    this.#track(work);
    const first = await within(work, this.deadlineMs).catch(() => undefined);
    return first === LATE ? undefined : first;
  }

  /**
   * Resolves once no call is running off the thread (a late one returned and
   * was disposed) and what {@link closeWhenSettled} was given is closed.
   */
  async settled(): Promise<void> {
    while (this.#running.size > 0) await Promise.all(this.#running);
    await this.closeLocks(this.#closeAfter.splice(0));
  }

  /**
   * Closes lock files (their flocks go with them) on the lock thread, waiting
   * for them up to the deadline: a close past it goes on there (logged),
   * without holding up the open's answer. A failure is logged with the path.
   */
  async closeLocks(files: Iterable<LockFile | Error>): Promise<void> {
    const open = [...files].filter((f): f is LockFile => !(f instanceof Error));
    if (open.length === 0) return;
    const closed = Promise.all(
      open.map((f) =>
        f.close().catch((e) =>
          this.#log?.error("SSD open: closing a cache file's lock failed", {
            path: f.path,
            error: errorText(e),
          })
        )
      ),
    );
    if (await within(closed, this.deadlineMs) !== LATE) return;
    this.#log?.error("SSD open: a cache file's lock did not close within its deadline", {
      paths: open.map((f) => f.path).join(","),
      deadline_ms: this.deadlineMs,
    });
  }

  /** Closes a lock file (its flock goes with it), bounded like every other call. */
  closeLock(f: LockFile, path: string): Promise<void> {
    return this.call("close", path, () => f.close());
  }

  /**
   * Closes `f` once no call runs ({@link settled}): after a give-up, a close
   * (which flushes, and drops a lock) must not wait on this thread for the
   * filesystem that hung.
   */
  closeWhenSettled(f: LockFile): void {
    this.#closeAfter.push(f);
  }

  #track(p: Promise<unknown>): void {
    const done: Promise<void> = p.then(() => {}, () => {}).finally(() =>
      this.#running.delete(done)
    );
    this.#running.add(done);
  }

  // ---- Deno's fs ops --------------------------------------------------------

  /** `stat` (follows links). */
  stat(path: string): Promise<Deno.FileInfo> {
    return this.call("stat", path, () => Deno.stat(path));
  }

  /**
   * Opens `path` read-write, creating it, on the lock thread (lock_thread.ts:
   * no call on the file runs on the JS thread); a file opened past the
   * deadline is closed. The thread's start is not counted in the deadline
   * (nor made after a give-up: a thread with nothing to do would stay).
   */
  async openRw(path: string): Promise<LockFile> {
    if (!this.#hung) await this.#locks.ready();
    return await this.call("open", path, () => this.#locks.open(path), (f) => f.close());
  }

  /** `fstat` of an open lock file. */
  fstat(f: LockFile, path: string): Promise<LockFileInfo> {
    return this.call("fstat", path, () => f.stat());
  }

  /** `flock(LOCK_NB)`: true when taken. */
  tryLock(f: LockFile, path: string): Promise<boolean> {
    return this.call("flock", path, () => f.tryLock());
  }

  /** `ftruncate` through an open lock file of `path`. */
  truncate(f: LockFile, path: string, bytes: number): Promise<void> {
    return this.call(`ftruncate to ${bytes} bytes`, path, async () => {
      try {
        await f.truncate(bytes);
      } catch (e) {
        throw new Error(`ftruncate ${path} to ${bytes} bytes: ${(e as Error).message}`);
      }
    });
  }

  /** A whole (small) file's text, e.g. `/proc/locks`. */
  readText(path: string): Promise<string> {
    return this.call("read", path, () => Deno.readTextFile(path));
  }

  // ---- the library's file calls (ffi/uring.ts, off the JS thread) ------------
  // A failure's text stays on the thread that ran the call (it names the call,
  // the path and the status only); the callers check what they can with
  // Deno's own ops first, so the usual failures (a missing directory, no
  // permission, not a regular file) keep their OS text.

  /** `pf_file_open` on `uring` (opens and registers the file); its handle. */
  openFile(uring: number, path: string, flags: number): Promise<number> {
    return this.call(
      "open for io",
      path,
      () => openFileOffThread(uring, path, flags),
      (late) => closeFileOffThread(late, path),
    );
  }

  /** `pf_file_info` (an fstat): size and O_DIRECT of an open file. */
  fileInfo(handle: number, path: string): Promise<FileInfo> {
    return this.call("fstat", path, () => fileInfoOffThread(handle, path));
  }

  /** `pf_fs_space` (a statvfs) of the filesystem holding `path`. */
  fsSpace(path: string): Promise<FsSpace> {
    return this.call("statvfs", path, () => fsSpaceOffThread(path));
  }

  /** `pf_file_close`: closes a file opened with {@link openFile}. */
  closeFile(handle: number, path: string): Promise<void> {
    return this.call("close", path, () => closeFileOffThread(handle, path));
  }
}
