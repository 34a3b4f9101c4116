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

/** How long {@link LoadState.waitLayer} sleeps between polls once spinning stops paying. */
const POLL_SLEEP_MS = 0;

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
    const deadline = performance.now() + timeoutMs;
    for (;;) {
      const s = readLoadState(this.#view);
      if (s.state !== STATE_PENDING) return s.state;
      if (s.layersReady > i) return s.state;
      if (performance.now() > deadline) throw new Error(`load state ${this.name}: layer ${i} not ready after ${timeoutMs} ms`);
      await new Promise((r) => setTimeout(r, POLL_SLEEP_MS));
    }
  }

  /** Resolves with the final state (1 ok, < 0 failed). */
  async waitAll(timeoutMs = 120_000): Promise<number> {
    const deadline = performance.now() + timeoutMs;
    for (;;) {
      const s = readLoadState(this.#view).state;
      if (s !== STATE_PENDING) return s;
      if (performance.now() > deadline) throw new Error(`load state ${this.name}: not done after ${timeoutMs} ms`);
      await new Promise((r) => setTimeout(r, POLL_SLEEP_MS));
    }
  }

  close(): void {
    this.#shm.close();
  }
}

export { STATE_OK };
