/**
 * {@link CopyEngine}: an engine, its pinned pool and one completion ring,
 * with `submit(batch)` returning per-batch observables demultiplexed from the
 * shared ring by tag.
 *
 * @module
 */
import { Observable, ReplaySubject, Subject, type Subscription } from "rxjs";
import { loadLibrary, type PegaflowSymbols } from "./symbols.ts";
import {
  check,
  type CopyPath,
  Engine,
  type EngineOptions,
  NativeError,
  PATH_NAMES,
  PF_STATUS,
  type Pool,
  type PoolOptions,
  type PoolProgressOptions,
  statusName,
} from "./native.ts";
import { type Completion, COMPLETION_KIND, CompletionRing } from "./ring.ts";
import type { CopyBatch } from "./batch.ts";

/** How a finished batch went. */
export interface CopyResult {
  /** 0, or the negative `PF_E*` code of the failure. */
  status: number;
  /** Bytes moved (sum of the groups that completed). */
  bytes: number;
  /** Nanoseconds from submit to the last byte landing. */
  ns: number;
  /**
   * The path the batch carried, as the library reported it back: the cuda
   * backend ran exactly it; the host backend copied with memcpy.
   */
  path: CopyPath;
  /** On failure, what the library knows about it (group, layer, region, offset). */
  error?: string;
}

/** A submitted batch. */
export interface Submission {
  /** The ring tag of this batch. */
  tag: number;
  /**
   * Emits each group's layer id as that group lands, in group order;
   * completes after the last group, errors with a {@link NativeError} if a
   * group fails.
   */
  layers$: Observable<number>;
  /** Resolves when the whole batch has ended (never rejects). */
  done: Promise<CopyResult>;
}

/** Options of {@link CopyEngine.open}. */
export interface CopyEngineOptions extends EngineOptions, PoolOptions {
  /** Pinned pool size in bytes. */
  poolBytes: number;
  /** Completion ring capacity (power of two). Default 4096. */
  ringCapacity?: number;
  /**
   * Devices served besides `device`: one more engine (copy workers / context)
   * each, all copying through the pool of `device`'s engine and posting to
   * the one ring. Only a backend that can share a pool across devices takes
   * them (host today); the library refuses a batch otherwise.
   */
  moreDevices?: readonly number[];
}

const ERROR_BUF = new Uint8Array(512);
const DECODER = new TextDecoder();

interface Pending {
  /** The groups' layer ids as they land; none for a quiet batch (no LAYER records). */
  layers: ReplaySubject<number> | undefined;
  resolve: (r: CopyResult) => void;
  done: Promise<CopyResult>;
  /** Bytes of the groups landed so far; a quiet batch: all of them, reported only on success. */
  bytes: number;
  /** The path the batch carried (reported if the ring dies before its BATCH record). */
  path: CopyPath;
}

/**
 * An engine + pool + ring that runs copy batches.
 *
 * @example
 * ```ts
 * const ce = CopyEngine.open({ backend: "host", poolBytes: 64 << 20 });
 * const region = ce.engine.allocRegion(1 << 20);
 * const batch = new CopyBatch(1, 16).reset("d2h");
 * batch.group(region, 0).seg(0, 0, 4096);
 * const { done } = ce.submit(batch);
 * console.log(await done);
 * region.close();
 * await ce.close();
 * ```
 */
export class CopyEngine {
  /** The engine of the first device; it owns the pool. */
  readonly engine: Engine;
  /** One engine per served device (the first is {@link CopyEngine.engine}), by device id. */
  readonly engines: ReadonlyMap<number, Engine>;
  /** The pinned pool every batch copies to/from. */
  readonly pool: Pool;
  /** The completion ring (shareable: see {@link CopyEngine.other$}). */
  readonly ring: CompletionRing;
  /** Records whose tag is not a batch of this engine (e.g. io_uring ops). */
  readonly other$ = new Subject<Completion>();
  readonly #pf: PegaflowSymbols;
  readonly #pending = new Map<number, Pending>();
  readonly #sub: Subscription;
  #nextTag = 1;
  #closed = false;

  private constructor(engines: Engine[], pool: Pool, ring: CompletionRing) {
    this.#pf = loadLibrary();
    this.engine = engines[0];
    this.engines = new Map(engines.map((e) => [e.device, e]));
    this.pool = pool;
    this.ring = ring;
    this.#sub = ring.completions$.subscribe({
      next: (c) => this.#route(c),
      error: (e) => this.#failAll(e),
      complete: () => this.#failAll(new NativeError("pf_ring_wait", -9, "ring shut down")),
    });
  }

  /** Opens engine, pool and ring; on failure releases what was opened. */
  static open(opts: CopyEngineOptions): CopyEngine {
    const engines = openEngines(opts);
    let pool: Pool | undefined;
    try {
      pool = engines[0].createPool(opts.poolBytes, opts);
      const ring = new CompletionRing(opts.ringCapacity ?? 4096);
      return new CopyEngine(engines, pool, ring);
    } catch (e) {
      pool?.close();
      for (const en of engines) en.close();
      throw e;
    }
  }

  /**
   * Like {@link CopyEngine.open}, but the pool is created off the JS thread
   * with `watch.onProgress` called on a timer meanwhile (a large pre-touched
   * pool takes seconds).
   */
  static async openAsync(
    opts: CopyEngineOptions,
    watch: PoolProgressOptions = {},
  ): Promise<CopyEngine> {
    const engines = openEngines(opts);
    let pool: Pool | undefined;
    try {
      pool = await engines[0].createPoolAsync(opts.poolBytes, opts, watch);
      const ring = new CompletionRing(opts.ringCapacity ?? 4096);
      return new CopyEngine(engines, pool, ring);
    } catch (e) {
      pool?.close();
      for (const en of engines) en.close();
      throw e;
    }
  }

  /** Batches submitted and not yet ended. */
  get inflight(): number {
    return this.#pending.size;
  }

  /** A fresh tag for other work posting to {@link CopyEngine.ring}. */
  nextTag(): number {
    return this.#nextTag++;
  }

  /**
   * Submits `batch` (finishing its header) and returns its observables.
   * The descriptor buffer can be reused as soon as this returns.
   *
   * @throws NativeError when the batch is refused (nothing was copied).
   */
  submit(batch: CopyBatch, device?: number): Submission {
    const layers = new ReplaySubject<number>();
    const { tag, done } = this.#submit(batch.setQuiet(false), device, layers);
    return { tag, layers$: layers.asObservable(), done };
  }

  /**
   * Submits `batch` as a quiet one (`PF_BATCH_QUIET`): the library posts its
   * BATCH record only, none per group, so the ring and this reader see one
   * record a batch. For a caller that awaits only the end (a server's save;
   * a load whose engine watches the progress words). Resolves like
   * {@link Submission.done}; `bytes` is the batch's on success, 0 on failure
   * (which groups landed is not reported).
   *
   * @throws NativeError when the batch is refused (nothing was copied).
   */
  submitQuiet(batch: CopyBatch, device?: number): Promise<CopyResult> {
    return this.#submit(batch.setQuiet(true), device, undefined).done;
  }

  #submit(
    batch: CopyBatch,
    device: number | undefined,
    layers: ReplaySubject<number> | undefined,
  ): { tag: number; done: Promise<CopyResult> } {
    if (this.#closed) throw new NativeError("pf_copy_submit", -9, "CopyEngine is closed");
    const engine = device === undefined ? this.engine : this.engines.get(device);
    if (!engine) {
      throw new NativeError(
        "pf_copy_submit",
        PF_EINVAL,
        `device ${device} is not served (served: ${[...this.engines.keys()].join(",")})`,
      );
    }
    const desc = batch.finish();
    const tag = this.#nextTag++;
    check(
      "pf_copy_submit",
      this.#pf.pf_copy_submit(
        engine.handle,
        this.pool.handle,
        this.ring.handle,
        desc,
        BigInt(desc.length),
        BigInt(tag),
      ),
    );
    let resolve!: (r: CopyResult) => void;
    const done = new Promise<CopyResult>((r) => (resolve = r));
    const bytes = layers ? 0 : batch.bytes;
    this.#pending.set(tag, { layers, resolve, done, bytes, path: batch.path });
    return { tag, done };
  }

  #route(c: Completion): void {
    const p = this.#pending.get(c.tag);
    if (!p) {
      this.other$.next(c);
      return;
    }
    if (c.kind === COMPLETION_KIND.LAYER) {
      if (c.status === 0 && p.layers) {
        p.bytes += c.value;
        p.layers.next(c.aux);
      }
    } else if (c.kind === COMPLETION_KIND.BATCH) {
      this.#pending.delete(c.tag);
      let error: string | undefined;
      if (c.status === 0) {
        p.layers?.complete();
      } else {
        error = this.#takeError(c.tag) || `batch ${c.tag} failed with ${statusName(c.status)}`;
        p.layers?.error(new NativeError("pf_copy_submit", c.status, error));
      }
      p.resolve({
        status: c.status,
        bytes: p.layers || c.status === 0 ? p.bytes : 0,
        ns: c.value,
        path: PATH_NAMES[c.aux] ?? "host",
        error,
      });
    }
  }

  /** The library's text for a failed batch ("" when it kept none). */
  #takeError(tag: number): string {
    const n = this.#pf.pf_ring_take_error(
      this.ring.handle,
      BigInt(tag),
      ERROR_BUF,
      ERROR_BUF.length,
    );
    if (n <= 0) return "";
    return DECODER.decode(ERROR_BUF.subarray(0, Math.min(n, ERROR_BUF.length - 1)));
  }

  #failAll(e: unknown): void {
    const err = e instanceof Error ? e : new Error(String(e));
    for (const [tag, p] of this.#pending) {
      p.layers?.error(err);
      p.resolve({
        status: err instanceof NativeError ? err.code : -9,
        bytes: p.layers ? p.bytes : 0,
        ns: 0,
        path: p.path,
      });
      this.#pending.delete(tag);
    }
    this.other$.complete();
  }

  /**
   * Waits for in-flight batches, shuts the ring down, and frees pool, ring
   * and engine (regions are the caller's to close first).
   */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await Promise.all([...this.#pending.values()].map((p) => p.done));
    await this.ring.shutdown();
    this.#sub.unsubscribe();
    this.ring.destroy();
    this.pool.close();
    for (const en of this.engines.values()) en.close();
  }
}

const PF_EINVAL = PF_STATUS.PF_EINVAL;

/** Opens the engine of `opts.device`, then one per `opts.moreDevices` (closing all on failure). */
function openEngines(opts: CopyEngineOptions): Engine[] {
  const ids = [opts.device ?? 0, ...(opts.moreDevices ?? [])];
  if (new Set(ids).size !== ids.length) {
    throw new NativeError("pf_engine_open", PF_EINVAL, `devices ${ids.join(",")} repeat an id`);
  }
  const engines: Engine[] = [];
  try {
    for (const device of ids) engines.push(Engine.open({ ...opts, device }));
  } catch (e) {
    for (const en of engines) en.close();
    throw e;
  }
  return engines;
}
