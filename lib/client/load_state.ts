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
 * them. Re-check on microtasks (µs latency) but give the event loop a turn at
 * least every SPIN_SLICE_MS; timers alone would add up to 4 ms per check
 * (nested timers are clamped), which is more than a layer's copy on a GPU.
 */
const SPIN_SLICE_MS = 1;

async function pollUntil(done: () => boolean, what: string, timeoutMs: number): Promise<void> {
  const deadline = performance.now() + timeoutMs;
  let slice = performance.now();
  while (!done()) {
    const now = performance.now();
    if (now > deadline) throw new Error(`${what} after ${timeoutMs} ms`);
    if (now - slice < SPIN_SLICE_MS) {
      await Promise.resolve();
    } else {
      await new Promise((r) => setTimeout(r, 0));
      slice = performance.now();
    }
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
