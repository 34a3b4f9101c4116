/**
 * The engine side of the load state (layout in proto/pegaflow.proto): a
 * 64-byte shm block this process creates, passes by name in Load, and polls
 * for per-layer progress and the final state.
 *
 * @module
 */
import { SharedMemory } from "../../ffi/mod.ts";
import {
  initLoadState,
  LAYERS_UNKNOWN,
  LOAD_STATE_BYTES,
  readLoadState,
  STATE_OK,
  STATE_PENDING,
} from "../engine/load_state.ts";

let counter = 0;

/**
 * A wait on a load state that ran past its timeout with the load still
 * pending (python/pegaflow/errors.py's PegaflowLoadTimeout): not a failed
 * load, whose state the wait returns instead.
 */
export class LoadStateTimeout extends Error {
  constructor(
    /** The load state's shm name. */
    readonly stateName: string,
    /** What the wait was for: "the load" or "layer N". */
    readonly waitingFor: string,
    readonly timeoutMs: number,
  ) {
    super(`load state ${stateName}: ${waitingFor} not ready after ${timeoutMs} ms`);
    this.name = "LoadStateTimeout";
  }
}

/**
 * Polling: the words are written by native threads, so no JS event announces
 * them. For the first SPIN_MS of a wait (a whole GPU load of a long prefix)
 * re-check after every event-loop turn, taken through a MessageChannel: a few
 * µs, and I/O and FFI completions still run. A timer instead (what this did
 * before) sleeps 1-2 ms per check, so a layer that landed meanwhile was seen
 * up to that much later: time a real engine polling its load state would not
 * lose. Past SPIN_MS (a slow load: host backend, a huge prefix) checks are
 * spaced by timers so a waiting engine does not hold a core for seconds.
 */
const SPIN_MS = 50;

/** Resolves on the next event-loop turn (a message to ourselves, not a ≥1 ms timer). */
class Turns {
  readonly #ch = new MessageChannel();
  #wake: (() => void) | null = null;
  constructor() {
    this.#ch.port1.onmessage = () => {
      const w = this.#wake;
      this.#wake = null;
      w?.();
    };
  }
  next(): Promise<void> {
    return new Promise((r) => {
      this.#wake = r;
      this.#ch.port2.postMessage(0);
    });
  }
  /** Closes both ports (an open port keeps the process alive). */
  close(): void {
    this.#ch.port1.close();
    this.#ch.port2.close();
  }
}

async function pollUntil(
  done: () => boolean,
  stateName: string,
  what: string,
  timeoutMs: number,
): Promise<void> {
  if (Number.isNaN(timeoutMs)) {
    // NaN compares false against every deadline: the wait would never time out.
    throw new RangeError(
      `load state ${stateName}: ${what}: timeout ${timeoutMs} is not a number of milliseconds`,
    );
  }
  if (done()) return;
  const start = performance.now();
  const deadline = start + timeoutMs;
  const turns = new Turns();
  try {
    while (!done()) {
      const now = performance.now();
      if (now > deadline) throw new LoadStateTimeout(stateName, what, timeoutMs);
      if (now - start < SPIN_MS) await turns.next();
      else await new Promise((r) => setTimeout(r, 1));
    }
  } finally {
    turns.close();
  }
}

/**
 * A load-state block owned by this process.
 *
 * @example
 * ```ts
 * const st = LoadState.create();
 * await client.load({ ..., loadStateShm: st.name });
 * await st.waitLayer(0);   // layer 0 may run now
 * await st.waitAll();
 * st.close();
 * ```
 */
export class LoadState {
  readonly name: string;
  readonly #shm: SharedMemory;
  readonly #view: DataView;
  /** The mapping is gone after close(): touching #view then would crash the process. */
  #closed = false;

  private constructor(name: string) {
    this.name = name;
    this.#shm = SharedMemory.open(name, LOAD_STATE_BYTES, { create: true, unlink: true });
    const u8 = this.#shm.view();
    this.#view = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
    initLoadState(this.#view);
  }

  /**
   * Creates a fresh block with a unique name: pid, time and counter, plus
   * random bits, since Workers of one process each have their own counter.
   */
  static create(): LoadState {
    const rnd = crypto.getRandomValues(new Uint32Array(2));
    const tag = [...rnd].map((w) => w.toString(36)).join("");
    return new LoadState(
      `/pegaflow-ls-${Deno.pid}-${Date.now().toString(36)}-${counter++}-${tag}`,
    );
  }

  /**
   * Resets progress for reuse by another Load, and the owner word: the server
   * refuses another instance's Load naming a block its last load still holds.
   */
  rearm(): void {
    initLoadState(this.#words());
  }

  snapshot(): { numLayers: number; layersReady: number; state: number } {
    return readLoadState(this.#words());
  }

  /**
   * Resolves once layer `i` (an index into this rank's layers, in registration
   * order) has landed, or the load ended; returns the state then. A layer that
   * is not an index, or not below the layer count the server armed, is a
   * RangeError: no progress word could ever say it landed.
   */
  async waitLayer(i: number, timeoutMs = 120_000): Promise<number> {
    if (!Number.isInteger(i) || i < 0) {
      // A negative index is below any layers_ready: it would read as landed at once.
      throw new RangeError(`load state ${this.name}: layer ${i} is not a layer index (>= 0)`);
    }
    await pollUntil(
      () => {
        const s = readLoadState(this.#words(`layer ${i}`));
        if (s.state !== STATE_PENDING || s.layersReady > i) return true;
        if (s.numLayers !== 0 && s.numLayers !== LAYERS_UNKNOWN && i >= s.numLayers) {
          throw new RangeError(
            `load state ${this.name}: layer ${i} is out of range (the load has ${s.numLayers} layers)`,
          );
        }
        return false;
      },
      this.name,
      `layer ${i}`,
      timeoutMs,
    );
    return readLoadState(this.#words(`layer ${i}`)).state;
  }

  /** Resolves with the final state (1 ok, < 0 failed). */
  async waitAll(timeoutMs = 120_000): Promise<number> {
    await pollUntil(
      () => readLoadState(this.#words("the load")).state !== STATE_PENDING,
      this.name,
      "the load",
      timeoutMs,
    );
    return readLoadState(this.#words("the load")).state;
  }

  /** Unmaps (and unlinks) the block; a wait still polling it rejects. */
  close(): void {
    this.#closed = true;
    this.#shm.close();
  }

  /** The words, or an Error naming the block once it was closed (`waiting`: what a wait was for). */
  #words(waiting?: string): DataView {
    if (this.#closed) {
      throw new Error(
        waiting === undefined
          ? `load state ${this.name} is closed`
          : `load state ${this.name} was closed while waiting for ${waiting}`,
      );
    }
    return this.#view;
  }
}

export { STATE_OK };
