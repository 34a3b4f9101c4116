/**
 * The load-state block an engine polls instead of waiting on an RPC: the
 * byte layout documented in proto/pegaflow.proto. The engine creates and
 * initialises it ({@link initLoadState}); the server validates it, writes
 * num_layers and resets the progress words before a load; the native copy
 * engine then writes layers_ready and state directly (batch progress words).
 *
 * The engine side reads its own block through a DataView. The server side
 * goes through {@link LoadStateAccess} (guarded native copies): the block
 * belongs to another process that may shrink it at any moment.
 *
 * @module
 */
import { fnv1a32 } from "../storage/cache.ts";
import { invalid } from "./errors.ts";

/** "PFLS" read as a little-endian u32. */
export const LOAD_STATE_MAGIC = 0x534c4650;
export const LOAD_STATE_VERSION = 1;
/** Size of the block; engines create at least this many bytes. */
export const LOAD_STATE_BYTES = 64;
export const OFF_MAGIC = 0;
export const OFF_VERSION = 4;
export const OFF_NUM_LAYERS = 8;
/**
 * The owner word (the protocol's reserved word at 12; engines zero it when
 * they (re)initialise the block): 0, or the {@link loadStateOwner} tag of the
 * instance whose Load the server accepted with this block. While that load
 * is in flight (load_state_maps.ts), a Load of another instance naming the
 * block is refused without a byte written: the block is that engine's load.
 */
export const OFF_OWNER = 12;
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

/** The server's guarded access to an engine's block (see ports.ts ShmPort). */
export interface LoadStateAccess {
  read(offset: number, dst: Uint8Array): void;
  write(offset: number, src: Uint8Array): void;
}

/**
 * The owner tag of `instance`'s loads (never 0, which means "no owner"). Server
 * side only: the server writes it and compares it, so no client computes it.
 */
export function loadStateOwner(instance: string): number {
  return fnv1a32(instance) || 1;
}

/**
 * Throws INVALID_ARGUMENT unless the block holds a load-state header (server
 * side); returns its owner word (0: none).
 */
export function checkLoadState(shm: LoadStateAccess, name: string): number {
  const head = new Uint8Array(OFF_OWNER + 4);
  shm.read(OFF_MAGIC, head);
  const view = new DataView(head.buffer);
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
  return view.getUint32(OFF_OWNER, true);
}

/** Server side: records the owner of an accepted Load ({@link loadStateOwner}). */
export function claimLoadState(shm: LoadStateAccess, owner: number): void {
  shm.write(OFF_OWNER, u32(owner));
}

/**
 * Server side: announces the layer count and resets progress before
 * submitting; the owner word keeps `owner` (the load's, see {@link OFF_OWNER}).
 */
export function armLoadState(shm: LoadStateAccess, numLayers: number, owner = 0): void {
  // num_layers, owner, layers_ready, state: four words, one guarded copy.
  const words = new Uint8Array(OFF_STATE + 4 - OFF_NUM_LAYERS);
  const view = new DataView(words.buffer);
  view.setUint32(0, numLayers, true);
  view.setUint32(OFF_OWNER - OFF_NUM_LAYERS, owner, true);
  view.setUint32(OFF_LAYERS_READY - OFF_NUM_LAYERS, 0, true);
  view.setInt32(OFF_STATE - OFF_NUM_LAYERS, STATE_PENDING, true);
  shm.write(OFF_NUM_LAYERS, words);
}

/** num_layers / layers_ready written on a failure when the rank's layer count is unknown. */
export const LAYERS_UNKNOWN = 0xffffffff;

function u32(value: number): Uint8Array {
  const word = new Uint8Array(4);
  new DataView(word.buffer).setUint32(0, value >>> 0, true);
  return word;
}

/**
 * Server side: marks a load failed (before or instead of the native layer
 * doing so). State first, then num_layers and layers_ready = num_layers, so a
 * waiter that watches only layers_ready wakes up and then finds the failure in
 * state (each write is its own guarded native copy, in program order).
 * `numLayers` is the rank's layer count, or undefined when the server does
 * not know the rank ({@link LAYERS_UNKNOWN} then goes into both words).
 */
export function failLoadState(
  shm: LoadStateAccess,
  code: number = STATE_REJECTED,
  numLayers?: number,
): void {
  shm.write(OFF_STATE, u32(code));
  const n = numLayers ?? LAYERS_UNKNOWN;
  shm.write(OFF_NUM_LAYERS, u32(n));
  shm.write(OFF_LAYERS_READY, u32(n));
}

/**
 * Server side: a Load with zero targets is done at once: every layer "ready",
 * state ok (the same words a finished copy leaves).
 */
export function completeLoadState(shm: LoadStateAccess, numLayers: number): void {
  shm.write(OFF_NUM_LAYERS, u32(numLayers));
  shm.write(OFF_STATE, u32(STATE_OK));
  shm.write(OFF_LAYERS_READY, u32(numLayers));
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
