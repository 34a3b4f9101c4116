/**
 * A hung disk (a dead NVMe, a network mount gone) never completes an io
 * batch, and nothing may end that wait early: the kernel may still read or
 * fill the pool pages of the batch, so its pins and pool space stay held
 * until it completes. What the tier can do is stop adding to it. This
 * module watches for a batch outstanding past the stall deadline
 * (`ioStallMs`, io.ts) and then marks the tier **degraded**: logged once
 * per episode, loudly, with the path, offset and age of the oldest
 * outstanding op; new writes are dropped (counted) and prefetches answer a
 * miss. Once every stalled batch completed the tier recovers by itself
 * (logged): a disk that came back serves again, one that did not stays
 * degraded.
 *
 * It also gives `flush()` and `close()` their deadline: they give up when
 * the io stalls or `closeTimeoutMs` passes, whichever is first, naming what
 * is still outstanding; the close of the engine's files and their locks has
 * one too ({@link SsdStallWatch.shutWithin}: a close waits on the
 * filesystem, which may hang); and `SsdTier.open` its own ({@link openWithin}): an
 * open whose io stalls, or one of whose filesystem calls does not return
 * (open_fs.ts), gives up, and the server starts without the tier.
 *
 * @module
 */

import type { IoOutstanding, SsdIo } from "./io.ts";
import { type CacheFile, SsdOpenError } from "./cache_files.ts";
import { SsdFsHung } from "./open_fs.ts";
import { LATE, within } from "../timer_limit.ts";
import { errorText, type LogFields, type Logger } from "../log.ts";

/** How long `flush()` and `close()` wait for accepted work while the io is not stalled. */
export const DEFAULT_CLOSE_TIMEOUT_MS = 60_000;

/** Work the tier holds now (what a give-up names). */
export interface SsdWorkLeft {
  writeQueued: number;
  writeInflight: number;
  prefetchQueued: number;
  prefetchInflight: number;
  /** Files whose fdatasync after a drop's pads (pads.ts) has not returned. */
  padSyncs?: readonly string[];
}

/** The call a close is in, and the files it is on: what a close past its deadline names. */
export interface ClosingCall {
  op: string;
  /** Its files (those not closed yet: the closer may take them out as they close). */
  paths: Iterable<string>;
}

/** Thrown by a `flush()` that gave up: the writes are still outstanding. */
export class SsdStalledError extends Error {
  override name = "SsdStalledError";
}

/**
 * The stall watch of one tier.
 *
 * @example
 * ```ts
 * const watch = new SsdStallWatch(io, files, log, DEFAULT_CLOSE_TIMEOUT_MS, () => workLeft());
 * if (watch.degraded) return "dropped";
 * const gaveUp = await watch.giveUp(writer.flush(), "flush"); // a sentence, or undefined
 * ```
 */
export class SsdStallWatch {
  readonly #io: SsdIo;
  readonly #files: readonly CacheFile[];
  readonly #log: Logger;
  readonly #timeoutMs: number;
  readonly #work: () => SsdWorkLeft;
  #since = 0;
  /** The fdatasync {@link syncEach} waits on (a call, not an io op in the kernel). */
  #syncing: ClosingCall | undefined;
  #stalled!: Promise<"stalled">;
  #onStalled!: () => void;

  constructor(
    io: SsdIo,
    files: readonly CacheFile[],
    log: Logger,
    timeoutMs: number,
    work: () => SsdWorkLeft,
  ) {
    this.#io = io;
    this.#files = files;
    this.#log = log;
    this.#timeoutMs = timeoutMs;
    this.#work = work;
    this.#arm();
    io.onStall((oldest) => (oldest ? this.#degrade(oldest) : this.#recover()));
  }

  /** True while an io batch is outstanding past the stall deadline. */
  get degraded(): boolean {
    return this.#io.stalled;
  }

  /**
   * Waits for `p` until the io stalls or the deadline passes. Returns
   * undefined when `p` settled (a rejection is left to the caller), else
   * the sentence that says what `what` gave up on (also logged as an error).
   */
  async giveUp(p: Promise<unknown>, what: string): Promise<string | undefined> {
    const t0 = performance.now();
    let timer = 0;
    const late = new Promise<"deadline">((r) => {
      timer = Number(setTimeout(() => r("deadline"), this.#timeoutMs));
    });
    const ended = p.then(() => "ended" as const, () => "ended" as const);
    const why = await Promise.race([ended, this.#stalled, late]).finally(() => clearTimeout(timer));
    if (why === "ended") return undefined;
    const { padSyncs: _, ...w } = this.#work();
    const o = this.#io.oldestOutstanding();
    const waited = Math.round(performance.now() - t0);
    const call = o ? undefined : this.#call();
    const msg =
      `SSD ${what} gave up after ${waited} ms (${
        why === "stalled" ? "the io is stalled" : `deadline ${this.#timeoutMs} ms`
      }): ${w.writeInflight} write batches in flight, ${w.writeQueued} queued, ` +
      `${w.prefetchInflight} prefetch reads in flight, ${w.prefetchQueued} queued; ` +
      (o
        ? `oldest io op: ${this.#describe(o)}`
        : call
        ? `${this.inCall()} within ${this.#timeoutMs} ms (closeTimeoutMs: a hung disk or a ` +
          "dead mount?)"
        : "no io op in the kernel");
    this.#log.error(msg, {
      waited_ms: waited,
      why,
      ...w,
      ...(o ? this.#fields(o) : {}),
      ...(call
        ? { op: call.op, path: [...call.paths].join(","), deadline_ms: this.#timeoutMs }
        : {}),
    });
    return msg;
  }

  /**
   * fdatasync (`sync`) of every file, each even when one fails (EIO: the
   * first failure is thrown last). While one has not returned, a
   * {@link giveUp} with no io op in the kernel names it, and {@link inCall} says so.
   */
  async syncEach(sync: (f: CacheFile) => Promise<void>): Promise<void> {
    const failures: unknown[] = [];
    for (const f of this.#files) {
      this.#syncing = { op: "fdatasync", paths: [f.path] };
      await sync(f).catch((e) => failures.push(e));
    }
    this.#syncing = undefined;
    if (failures.length > 0) throw failures[0];
  }

  /**
   * The fdatasync that has not returned ({@link syncEach}'s, else one after a
   * drop's pads), in words; undefined when none.
   */
  inCall(): string | undefined {
    const c = this.#call();
    return c && `${c.op} of ${[...c.paths].join(", ")} did not return`;
  }

  #call(): ClosingCall | undefined {
    if (this.#syncing) return this.#syncing;
    const pads = this.#work().padSyncs;
    return pads?.length ? { op: "fdatasync after a drop's pads", paths: pads } : undefined;
  }

  /**
   * Runs `shut` (the close of the engine's files and their locks) up to
   * `closeTimeoutMs`: a close waits on the filesystem (FUSE sends a FLUSH on
   * every close; a network mount flushes), and on a hung one it never
   * returned, nor did the server's stop. `shut` says through `at` which call
   * it is in. Undefined once `shut` ended in time (its failure is thrown);
   * else the sentence naming the call, the path(s) and the deadline, logged
   * at error level: `shut` goes on, and how it ended is logged when it does.
   */
  async shutWithin(shut: (at: (call: ClosingCall) => void) => Promise<void>): Promise<
    string | undefined
  > {
    let call: ClosingCall = { op: "close", paths: this.#files.map((f) => f.path) };
    const t0 = performance.now();
    const done = shut((c) => (call = c));
    if (await within(done.then(() => {}, () => {}), this.#timeoutMs) !== LATE) {
      await done;
      return undefined;
    }
    const paths = [...call.paths];
    const fields: LogFields = { path: paths.join(","), op: call.op, deadline_ms: this.#timeoutMs };
    const msg = `SSD close gave up: ${call.op} of ${paths.join(", ")} did not return ` +
      `within ${this.#timeoutMs} ms (closeTimeoutMs: a hung disk or a dead mount?); the stop ` +
      "goes on without it: what it holds is left to process exit, or closes once it returns";
    this.#log.error(msg, fields);
    const returned = () => ({ ...fields, returned_after_ms: Math.round(performance.now() - t0) });
    done.then(
      () => this.#log.warn("SSD close finished: its call returned after its deadline", returned()),
      (e) =>
        this.#log.error("SSD close failed after its deadline", {
          ...returned(),
          error: errorText(e),
        }),
    );
    return msg;
  }

  /** Runs `rest` of a close that gave up once the kernel lets it; logs how it ended. */
  finishLater(rest: Promise<unknown>, what: string): void {
    rest.then(
      () => this.#log.warn(`SSD ${what} finished: the io outstanding at its deadline ended`),
      (e) => this.#log.error(`SSD ${what} failed after its deadline`, { error: errorText(e) }),
    );
  }

  #arm(): void {
    this.#stalled = new Promise((r) => (this.#onStalled = () => r("stalled")));
  }

  #degrade(o: IoOutstanding): void {
    this.#since = performance.now();
    this.#onStalled();
    this.#log.error(
      `SSD io stalled: ${this.#describe(o)}; the SSD tier is degraded: new writes are ` +
        "dropped and prefetches miss until the kernel completes it (its RAM pins stay held)",
      this.#fields(o),
    );
  }

  #recover(): void {
    this.#arm();
    this.#log.warn(
      "SSD io recovered: every stalled io batch completed; the SSD tier serves again",
      {
        degraded_ms: Math.round(performance.now() - this.#since),
      },
    );
  }

  #path(file: number): string {
    return this.#files.find((f) => f.handle === file)?.path ?? `file handle ${file}`;
  }

  #describe(o: IoOutstanding): string {
    return describeIo({ ...o, path: this.#path(o.file) });
  }

  #fields(o: IoOutstanding): LogFields {
    return {
      path: this.#path(o.file),
      offset: o.fileOffset,
      op: o.op,
      ops: o.ops,
      age_ms: o.ageMs,
      batches: o.batches,
      stalled_batches: o.stalledBatches,
    };
  }
}

/** An outstanding io op in words: op, path, offset, ops, age, batches. */
export function describeIo(o: IoOutstanding): string {
  return `${o.op} of ${o.path} at offset ${o.fileOffset} (${o.ops} ops) in the ` +
    `kernel for ${o.ageMs} ms; ${o.batches} io batches outstanding, ${o.stalledBatches} stalled`;
}

/**
 * Thrown by `SsdTier.open` when its io stalled (a disk that hangs while the
 * tier opens): an {@link SsdOpenError}, so the server starts without the
 * tier. Its engine cannot close while the kernel holds that io (its pool
 * pages may still be read or filled): the engine and the files' locks close
 * once the io completes ({@link engineClosed}).
 */
export class SsdOpenStalledError extends SsdOpenError {
  /** Resolves once the abandoned open's engine and locks are closed (or their close failed, logged). */
  readonly engineClosed: Promise<void>;
  #open = true;

  constructor(message: string, closing: Promise<void>) {
    super(message);
    this.name = "SsdOpenStalledError";
    this.engineClosed = closing.finally(() => (this.#open = false));
  }

  /** What the engine still waits on (this error's message) while it is open; undefined after. */
  stillOpen(): string | undefined {
    return this.#open ? this.message : undefined;
  }
}

/**
 * Thrown by `SsdTier.open` when one of its filesystem calls (a stat, an
 * open, a flock, a statvfs, an ftruncate of a cache path) did not return by
 * its deadline (`ioStallMs`): a hung disk or a dead mount. An
 * {@link SsdOpenError}, so the server starts without the tier. What the open
 * holds (the engine, the files' locks, a file the late call opens) closes
 * once that call returns ({@link engineClosed}).
 */
export class SsdOpenHungError extends SsdOpenStalledError {
  /** The call that did not return, the path it was on, and its deadline. */
  readonly op: string;
  readonly path: string;
  readonly deadlineMs: number;
  readonly #engine: boolean;

  constructor(hung: SsdFsHung, closing: Promise<void>, engine: boolean) {
    super(
      `SSD open gave up: ${hung.op} of ${hung.path} did not return within ${hung.deadlineMs} ms ` +
        "(ioStallMs: a hung disk or a dead mount?); the SSD tier is not started (the server " +
        "serves from RAM); what the open holds closes once that call returns",
      closing,
    );
    this.name = "SsdOpenHungError";
    this.op = hung.op;
    this.path = hung.path;
    this.deadlineMs = hung.deadlineMs;
    this.#engine = engine;
  }

  /** While the open's io engine waits for the hung call: this error's message; else undefined. */
  override stillOpen(): string | undefined {
    return this.#engine ? super.stillOpen() : undefined;
  }
}

/**
 * `e` as the open's error: a filesystem call past its deadline
 * ({@link SsdFsHung}) becomes an {@link SsdOpenHungError}, logged, with
 * `release` run in the background (it waits for that call); anything else
 * is returned as it is (the caller releases).
 */
export function hungOpenError(
  e: unknown,
  release: () => Promise<void>,
  engine: boolean,
  log: Logger,
): unknown {
  if (!(e instanceof SsdFsHung)) return e;
  const fields: LogFields = { path: e.path, op: e.op, deadline_ms: e.deadlineMs };
  const closing = release().then(
    () => log.warn("SSD open abandoned after a filesystem call hung: it returned; closed", fields),
    (err) =>
      log.error("SSD open abandoned: closing what it held failed", {
        ...fields,
        error: errorText(err),
      }),
  );
  const err = new SsdOpenHungError(e, closing, engine);
  log.error(err.message, fields);
  return err;
}

/** What an abandoned open closes: the tier it built, or its engine and locks when it failed. */
interface Closable {
  close(): Promise<void>;
  readonly engineClosed: Promise<void>;
}

/** The open's filesystem calls (open_fs.ts `OpenFs`): refused from a give-up on. */
interface Abandonable {
  abandon(why: string): void;
}

/**
 * Waits for an open's `work` until an io batch of it passes the stall
 * deadline (`ioStallMs`, io.ts). When it stalls first, the open gives up:
 * its later io and filesystem calls (`fs`) are refused, so nothing of it
 * goes on once the io completes (before, only the io was: it went on with
 * statvfs, ftruncate and opens, built the tier and logged "SSD index
 * recovered" after the tier was disabled); an error is logged naming the
 * op, path and offset, `release` (the engine and locks, once no call of the
 * open runs) is run in the background once `work` ended, and
 * {@link SsdOpenStalledError} is thrown. When `work` fails first, `release`
 * runs before the error goes up, except for a filesystem call past its
 * deadline: then {@link SsdOpenHungError}, released in the background.
 *
 * @example
 * ```ts
 * const tier = await openWithin(io, fs, build(io), () => closeEngineAndLocks(), log);
 * ```
 */
export async function openWithin<T extends Closable>(
  io: SsdIo,
  fs: Abandonable,
  work: Promise<T>,
  release: () => Promise<void>,
  log: Logger,
): Promise<T> {
  let stop = () => {};
  const stalled = new Promise<IoOutstanding>((r) => {
    stop = io.onStall((o) => o && r(o));
  });
  const first = await Promise.race([work.then(() => undefined, () => undefined), stalled]);
  stop();
  if (first === undefined) {
    try {
      return await work;
    } catch (e) {
      if (e instanceof SsdFsHung) {
        io.refuse(`the SSD open gave up on a hung ${e.op} of ${e.path}`);
        throw hungOpenError(e, release, true, log);
      }
      await release();
      throw e;
    }
  }
  const why = `the SSD open gave up on a stalled ${first.op} of ${first.path}`;
  io.refuse(why);
  fs.abandon(why);
  const msg = `SSD open stalled: ${describeIo(first)}; the SSD tier is not started (the server ` +
    "serves from RAM); its engine and the files' locks close once the kernel completes that io";
  const fields: LogFields = {
    path: first.path,
    offset: first.fileOffset,
    op: first.op,
    ops: first.ops,
    age_ms: first.ageMs,
  };
  log.error(msg, fields);
  const closing = work.then((t) => t.close().then(() => t.engineClosed), () => release()).then(
    () =>
      log.warn("SSD open abandoned after its io stalled: the io completed; engine closed", fields),
    (e) =>
      log.error("SSD open abandoned: closing its engine failed", {
        ...fields,
        error: errorText(e),
      }),
  );
  throw new SsdOpenStalledError(msg, closing);
}
