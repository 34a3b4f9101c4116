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
  LOAD_STATE_BYTES,
  readLoadState,
  STATE_OK,
  STATE_PENDING,
} from "../engine/load_state.ts";

let counter = 0;

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

async function pollUntil(done: () => boolean, what: string, timeoutMs: number): Promise<void> {
  if (done()) return;
  const start = performance.now();
  const deadline = start + timeoutMs;
  const turns = new Turns();
  try {
    while (!done()) {
      const now = performance.now();
      if (now > deadline) throw new Error(`${what} after ${timeoutMs} ms`);
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

  private constructor(name: string) {
    this.name = name;
    this.#shm = SharedMemory.open(name, LOAD_STATE_BYTES, { create: true, unlink: true });
    const u8 = this.#shm.view();
    this.#view = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
    initLoadState(this.#view);
  }

  /** Creates a fresh block with a unique name. */
  static create(): LoadState {
    return new LoadState(`/pegaflow-ls-${Deno.pid}-${Date.now().toString(36)}-${counter++}`);
  }

  /** Resets progress for reuse by another Load. */
  rearm(): void {
    initLoadState(this.#view);
  }

  snapshot(): { numLayers: number; layersReady: number; state: number } {
    return readLoadState(this.#view);
  }

  /** Resolves once layer `i` has landed (or the load ended); returns the state then. */
  async waitLayer(i: number, timeoutMs = 120_000): Promise<number> {
    await pollUntil(
      () => {
        const s = readLoadState(this.#view);
        return s.state !== STATE_PENDING || s.layersReady > i;
      },
      `load state ${this.name}: layer ${i} not ready`,
      timeoutMs,
    );
    return readLoadState(this.#view).state;
  }

  /** Resolves with the final state (1 ok, < 0 failed). */
  async waitAll(timeoutMs = 120_000): Promise<number> {
    await pollUntil(
      () => readLoadState(this.#view).state !== STATE_PENDING,
      `load state ${this.name}: not done`,
      timeoutMs,
    );
    return readLoadState(this.#view).state;
  }

  close(): void {
    this.#shm.close();
  }
}

export { STATE_OK };
