/**
 * The completion ring as an RxJS Observable.
 *
 * C worker threads write 32-byte records into ring memory; this module reads
 * them through typed arrays over that memory. Exactly one `nonblocking`
 * `pf_ring_wait` is pending at a time: it resolves with the new head, the
 * records up to it are emitted in order, the tail word is advanced (which
 * frees room for producers), and the next wait starts. There is no JS
 * callback per completion and no FFI call per record.
 *
 * @module
 */
import { Observable, Subject } from "rxjs";
import { loadLibrary, type PegaflowSymbols } from "./symbols.ts";
import { check, NativeError, PF_STATUS } from "./native.ts";

/** `pf_completion_kind` values. */
export const COMPLETION_KIND = {
  LAYER: 1,
  BATCH: 2,
  IO: 3,
  IO_BATCH: 4,
} as const;

/** One completion record (see `pf_completion` in pegaflow.h). */
export interface Completion {
  /** The submitter's tag. */
  tag: number;
  /** {@link COMPLETION_KIND}. */
  kind: number;
  /** Layer-group index (LAYER), group count (BATCH) or op index (IO). */
  index: number;
  /** 0 or a negative `PF_E*` code. */
  status: number;
  /** LAYER: layer id; BATCH: path used. */
  aux: number;
  /** LAYER/IO: bytes; BATCH: ns from submit to end. */
  value: number;
}

/** `PF_RING_HEADER_BYTES`: the ring's header before its records. */
export const RING_HEADER_BYTES = 64;

const RECORD_BYTES = 32;
const TWO32 = 4294967296;
/** Wait forever: `shutdown()` is what wakes the pending wait. */
const WAIT_FOREVER = -1;

/**
 * A completion ring shared by every batch and io op that posts to it.
 *
 * @example
 * ```ts
 * const ring = new CompletionRing(4096);
 * const sub = ring.completions$.subscribe((c) => console.log(c.tag, c.kind));
 * // ... submit work with ring.handle ...
 * await ring.shutdown(); sub.unsubscribe(); ring.destroy();
 * ```
 */
export class CompletionRing {
  /** The u32 ring handle. */
  readonly handle: number;
  /** Records the ring holds (power of two). */
  readonly capacity: number;
  /**
   * Every record, in ring order. Hot: the wait loop starts at the first
   * subscription and records before it are not replayed. Completes after
   * {@link CompletionRing.shutdown} once the ring is drained; errors if a
   * wait fails.
   */
  readonly completions$: Observable<Completion>;
  readonly #pf: PegaflowSymbols;
  readonly #u32: Uint32Array;
  readonly #i32: Int32Array;
  readonly #tail: BigUint64Array;
  readonly #subject = new Subject<Completion>();
  #seen = 0;
  #loop: Promise<void> | undefined;
  /** The reader loop has returned: no wait pending, no record being read. */
  #loopDone = false;
  #destroyed = false;

  /** Creates a ring of `capacity` records (power of two, 16 .. 2^24). */
  constructor(capacity = 4096) {
    this.#pf = loadLibrary();
    const out = new Uint32Array(1);
    check("pf_ring_create", this.#pf.pf_ring_create(capacity, out));
    this.handle = out[0];
    this.capacity = capacity;
    const ptr = this.#pf.pf_ring_ptr(this.handle);
    if (!ptr) throw new NativeError("pf_ring_ptr", PF_STATUS.PF_EHANDLE, "null ring memory");
    const buf = Deno.UnsafePointerView.getArrayBuffer(
      ptr,
      RING_HEADER_BYTES + capacity * RECORD_BYTES,
    );
    this.#u32 = new Uint32Array(buf);
    this.#i32 = new Int32Array(buf);
    this.#tail = new BigUint64Array(buf, 8, 1);
    this.completions$ = new Observable<Completion>((sub) => {
      const s = this.#subject.subscribe(sub);
      this.#start();
      return s;
    });
  }

  /** Records consumed so far (the tail). */
  get consumed(): number {
    return this.#seen;
  }

  #start(): void {
    if (!this.#loop) this.#loop = this.#run().finally(() => (this.#loopDone = true));
  }

  async #run(): Promise<void> {
    for (;;) {
      const r = Number(await this.#pf.pf_ring_wait(this.handle, BigInt(this.#seen), WAIT_FOREVER));
      if (r === PF_STATUS.PF_ESHUTDOWN) break;
      if (r < 0) {
        // The message lives on the wait's worker thread; the code is enough.
        this.#subject.error(new NativeError("pf_ring_wait", r, `ring ${this.handle}`));
        return;
      }
      const u = this.#u32;
      for (let i = this.#seen; i < r; i++) {
        const w = (RING_HEADER_BYTES + (i & (this.capacity - 1)) * RECORD_BYTES) >> 2;
        this.#subject.next({
          tag: u[w] + u[w + 1] * TWO32,
          kind: u[w + 2],
          index: u[w + 3],
          status: this.#i32[w + 4],
          aux: u[w + 5],
          value: u[w + 6] + u[w + 7] * TWO32,
        });
      }
      this.#seen = r;
      // One 8-byte store: producers read the tail as one u64.
      Atomics.store(this.#tail, 0, BigInt(r));
    }
    this.#subject.complete();
  }

  /**
   * Wakes every waiter and refuses new work on this ring; resolves once the
   * pending wait has returned and `completions$` has completed (records
   * already posted are still delivered first).
   */
  async shutdown(): Promise<void> {
    if (this.#destroyed) return;
    check("pf_ring_shutdown", this.#pf.pf_ring_shutdown(this.handle));
    if (this.#loop) await this.#loop;
  }

  /**
   * Frees the ring. @throws NativeError PF_EBUSY while work or a wait uses
   * it, and while the reader runs (until {@link CompletionRing.shutdown}
   * resolved): between two waits, and inside a subscriber, the library
   * counts no waiter, but the reader still reads records and the tail word.
   */
  destroy(): void {
    if (this.#destroyed) return;
    if (this.#loop && !this.#loopDone) {
      throw new NativeError(
        "pf_ring_destroy",
        PF_STATUS.PF_EBUSY,
        `ring ${this.handle}: its reader is still running (consumed ${this.#seen}); ` +
          `await shutdown() first`,
      );
    }
    check("pf_ring_destroy", this.#pf.pf_ring_destroy(this.handle));
    this.#destroyed = true;
  }
}
