/**
 * The cache files' lock files live on a thread of their own (a worker):
 * their open, flock, fstat, ftruncate and close are plain sync calls there,
 * so a hung filesystem stops that thread, never the server's JS thread.
 *
 * Not Deno's async calls on an open file: `FsFile.tryLock`, `.stat` and
 * `.truncate` run the call itself off the JS thread, but on a duplicate of
 * the fd made on the JS thread and closed there once the call returned. A
 * close waits on the filesystem (a FUSE mount's FLUSH, sent on every close;
 * a network mount's flush): on one that hangs there, each of those calls
 * froze the server's JS thread without a deadline, and the open then gave
 * up naming a call that had returned. (A file only ever opened here is never
 * closed on the JS thread either: {@link LockFile.close} runs here too.)
 *
 * @module
 */

/** What the open reads of a lock's file (`fstat`). */
export interface LockFileInfo {
  dev: number;
  ino: number | null;
  isFile: boolean;
  isBlockDevice: boolean;
}

/** A request to the worker, and its answer. */
type Request =
  | { op: "open"; path: string }
  | { op: "tryLock" | "stat" | "close"; id: number }
  | { op: "truncate"; id: number; bytes: number };
type Answer = { seq: number; value?: unknown; error?: { name: string; message: string } };

/**
 * The worker's code: self-contained (it runs from a blob URL, so a compiled
 * server needs no extra module) and sync, one call at a time.
 */
function lockWorker(): void {
  const scope = globalThis as unknown as {
    onmessage: (e: MessageEvent) => void;
    postMessage(m: unknown): void;
  };
  const files = new Map<number, Deno.FsFile>();
  let next = 1;
  const run = (r: Request): unknown => {
    if (r.op === "open") {
      files.set(next, Deno.openSync(r.path, { read: true, write: true, create: true }));
      return next++;
    }
    const f = files.get(r.id);
    if (!f) throw new Error(`lock file ${r.id} is not open`);
    if (r.op === "tryLock") return f.tryLockSync(true);
    if (r.op === "truncate") return f.truncateSync(r.bytes);
    if (r.op === "close") return (files.delete(r.id), f.close());
    const s = f.statSync();
    return { dev: s.dev, ino: s.ino, isFile: s.isFile, isBlockDevice: s.isBlockDevice };
  };
  scope.onmessage = (e: MessageEvent<Request & { seq: number }>) => {
    try {
      scope.postMessage({ seq: e.data.seq, value: run(e.data) });
    } catch (err) {
      const { name, message } = err as Error;
      scope.postMessage({ seq: e.data.seq, error: { name, message } });
    }
  };
  scope.postMessage({ seq: 0 });
}

let workerUrl: string | undefined;

/** The worker's error as this thread's: Deno's own classes kept (`instanceof Deno.errors.NotFound`). */
function rebuilt(e: { name: string; message: string }): Error {
  const known = (Deno.errors as unknown as Record<string, new (m: string) => Error>)[e.name];
  if (known) return new known(e.message);
  const err = new Error(e.message);
  err.name = e.name;
  return err;
}

/** A request waiting for its answer. */
interface Waiting {
  op: Request["op"] | "start";
  resolve(v: unknown): void;
  reject(e: Error): void;
}

/**
 * One worker holding lock files (one per SSD open). It starts with the first
 * call and ends once every file it opened is closed and nothing is asked.
 *
 * @example
 * ```ts
 * const thread = new LockThread();
 * const f = await thread.open("/mnt/nvme/pegaflow-ssd.cache");
 * if (await f.tryLock()) { ... }
 * await f.close();
 * ```
 */
export class LockThread {
  #worker: Worker | undefined;
  #ready: Promise<unknown> | undefined;
  #seq = 0;
  /** Files open on the worker (counted as the answers come: it never ends under one). */
  #open = 0;
  readonly #waiting = new Map<number, Waiting>();

  /**
   * Resolves once the worker runs. Its start touches no filesystem of the
   * caller's: a call's deadline need not count it.
   */
  async ready(): Promise<void> {
    if (!this.#ready) {
      workerUrl ??= URL.createObjectURL(
        new Blob([`(${lockWorker.toString()})();`], { type: "text/javascript" }),
      );
      const w = new Worker(workerUrl, { type: "module", name: "pegaflow-ssd-locks" });
      this.#worker = w;
      this.#ready = new Promise((resolve, reject) =>
        this.#waiting.set(0, { op: "start", resolve, reject })
      );
      w.onmessage = (e: MessageEvent<Answer>) => this.#answer(e.data);
      w.onerror = (e: ErrorEvent) => {
        e.preventDefault();
        const err = new Error(`the SSD lock thread failed: ${e.message}`);
        for (const x of this.#waiting.values()) x.reject(err);
        this.#waiting.clear();
      };
    }
    await this.#ready;
  }

  /** Opens (creating it) `path` read-write on the worker. */
  async open(path: string): Promise<LockFile> {
    return new LockFile(this, await this.call({ op: "open", path }) as number, path);
  }

  /** @internal Runs `r` on the worker (started if it is not). */
  async call(r: Request): Promise<unknown> {
    await this.ready();
    const seq = ++this.#seq;
    return await new Promise((resolve, reject) => {
      this.#waiting.set(seq, { op: r.op, resolve, reject });
      this.#worker!.postMessage({ ...r, seq });
    });
  }

  #answer(a: Answer): void {
    const w = this.#waiting.get(a.seq);
    this.#waiting.delete(a.seq);
    if (w?.op === "open" && !a.error) this.#open++;
    if (w?.op === "close") this.#open--; // a close that failed ends the file too (dropped first)
    if (a.error) w?.reject(rebuilt(a.error));
    else w?.resolve(a.value);
    if (a.seq === 0 || this.#open > 0 || this.#waiting.size > 0 || !this.#worker) return;
    this.#worker.terminate();
    this.#worker = this.#ready = undefined;
  }
}

/**
 * A lock file open on a {@link LockThread}: every call runs there. Closing
 * it (which drops its flock) is idempotent and resolves once it is closed.
 */
export class LockFile {
  #closing: Promise<void> | undefined;

  constructor(readonly thread: LockThread, readonly id: number, readonly path: string) {}

  /** `flock(LOCK_EX | LOCK_NB)`: true when taken. */
  tryLock(): Promise<boolean> {
    return this.thread.call({ op: "tryLock", id: this.id }) as Promise<boolean>;
  }

  /** `fstat`. */
  stat(): Promise<LockFileInfo> {
    return this.thread.call({ op: "stat", id: this.id }) as Promise<LockFileInfo>;
  }

  /** `ftruncate`. */
  async truncate(bytes: number): Promise<void> {
    await this.thread.call({ op: "truncate", id: this.id, bytes });
  }

  /** Closes the file (its lock goes with it), once. */
  close(): Promise<void> {
    this.#closing ??= this.thread.call({ op: "close", id: this.id }).then(() => {});
    return this.#closing;
  }
}
