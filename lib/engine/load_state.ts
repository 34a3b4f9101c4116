/**
 * The load-state block an engine polls instead of waiting on an RPC: the
 * byte layout documented in proto/pegaflow.proto. The engine creates and
 * initialises it ({@link initLoadState}); the server validates it, writes
 * num_layers and resets the progress words before a load; the native copy
 * engine then writes layers_ready and state directly (batch progress words).
 *
 * @module
 */
import { invalid } from "./errors.ts";

/** "PFLS" read as a little-endian u32. */
export const LOAD_STATE_MAGIC = 0x534c4650;
export const LOAD_STATE_VERSION = 1;
/** Size of the block; engines create at least this many bytes. */
export const LOAD_STATE_BYTES = 64;
export const OFF_MAGIC = 0;
export const OFF_VERSION = 4;
export const OFF_NUM_LAYERS = 8;
/** Where the batch progress words start: u32 layers_ready, then i32 state. */
export const OFF_PROGRESS = 16;
export const OFF_LAYERS_READY = 16;
export const OFF_STATE = 20;
/** State values. */
export const STATE_PENDING = 0;
export const STATE_OK = 1;
/** Written by the server when a load is refused before any copy was submitted. */
export const STATE_REJECTED = -1000;

/** Writes a fresh header into `view` (engine side). */
export function initLoadState(view: DataView): void {
  for (let i = 0; i < LOAD_STATE_BYTES; i += 4) view.setUint32(i, 0, true);
  view.setUint32(OFF_MAGIC, LOAD_STATE_MAGIC, true);
  view.setUint32(OFF_VERSION, LOAD_STATE_VERSION, true);
}

/** Throws INVALID_ARGUMENT unless `view` holds a load-state header (server side). */
export function checkLoadState(view: DataView, name: string): void {
  const magic = view.getUint32(OFF_MAGIC, true);
  const version = view.getUint32(OFF_VERSION, true);
  if (magic !== LOAD_STATE_MAGIC) {
    throw invalid(
      `load state "${name}": magic 0x${magic.toString(16)} is not 0x${
        LOAD_STATE_MAGIC.toString(16)
      } ("PFLS")`,
    );
  }
  if (version !== LOAD_STATE_VERSION) {
    throw invalid(`load state "${name}": version ${version}, expected ${LOAD_STATE_VERSION}`);
  }
}

/** Server side: announces the layer count and resets progress before submitting. */
export function armLoadState(view: DataView, numLayers: number): void {
  view.setUint32(OFF_NUM_LAYERS, numLayers, true);
  view.setUint32(OFF_LAYERS_READY, 0, true);
  view.setInt32(OFF_STATE, STATE_PENDING, true);
}

/** num_layers / layers_ready written on a failure when the rank's layer count is unknown. */
export const LAYERS_UNKNOWN = 0xffffffff;

/**
 * Server side: marks a load failed (before or instead of the native layer
 * doing so). State first, then layers_ready = num_layers, so a waiter that
 * watches only layers_ready wakes up and then finds the failure in state.
 * `numLayers` is the rank's layer count, or undefined when the server does
 * not know the rank ({@link LAYERS_UNKNOWN} then goes into both words).
 */
export function failLoadState(
  view: DataView,
  code: number = STATE_REJECTED,
  numLayers?: number,
): void {
  view.setInt32(OFF_STATE, code, true);
  const n = numLayers ?? LAYERS_UNKNOWN;
  view.setUint32(OFF_NUM_LAYERS, n, true);
  // A DataView store is not an atomic release; the fence makes the state store
  // visible before layers_ready to a reader in another process.
  Atomics.store(new Int32Array(view.buffer, view.byteOffset + OFF_LAYERS_READY, 1), 0, n | 0);
}

/**
 * Server side: a Load with zero targets is done at once: every layer "ready",
 * state ok (the same words a finished copy leaves).
 */
export function completeLoadState(view: DataView, numLayers: number): void {
  view.setUint32(OFF_NUM_LAYERS, numLayers, true);
  view.setInt32(OFF_STATE, STATE_OK, true);
  Atomics.store(
    new Int32Array(view.buffer, view.byteOffset + OFF_LAYERS_READY, 1),
    0,
    numLayers | 0,
  );
}

/** Engine side: a snapshot of the words. */
export function readLoadState(
  view: DataView,
): { numLayers: number; layersReady: number; state: number } {
  return {
    numLayers: view.getUint32(OFF_NUM_LAYERS, true),
    layersReady: view.getUint32(OFF_LAYERS_READY, true),
    state: view.getInt32(OFF_STATE, true),
  };
}
