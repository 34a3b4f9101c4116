/**
 * The limits of what PegaFlow accepts from a client, each defined once
 * (registration, the block store, the block index and the SSD tier all
 * check against these). They are far above any real model and low enough
 * to catch garbage before it sizes an allocation.
 *
 * Sizes the C library also knows live in `csrc/pegaflow.h`; where
 * TypeScript needs one of them it mirrors it here or in `ffi/`, and
 * `tests/native/abi_mirror_test.ts` checks the mirror against the header.
 * The Python client mirrors {@link LEASE_ID_BYTES}, checked the same way.
 *
 * @module
 */
import { HANDLE_BYTES } from "../ffi/native.ts";

/** Longest content hash of a block, in bytes (engines send 8–32; sha256 fits). */
export const MAX_HASH_BYTES = 64;
/** Most layers per rank. */
export const MAX_LAYERS = 4096;
/** Largest TP size and largest PP size. */
export const MAX_PARALLEL = 1024;
/** Most segments per (block, layer) slot (K/V split uses 2; a few more allow other splits). */
export const MAX_SEGMENTS = 8;
/**
 * Most items (layer × rank slot × segment) in one block: each limit above is
 * far from any model, but their product sizes a block's slot tables (tens of
 * millions at the limits, an allocation failure mid-save). 2^20 holds 512
 * layers × TP 1024 × 2 segments.
 */
export const MAX_BLOCK_ITEMS = 1 << 20;
/** Longest namespace or instance id, in characters. */
export const MAX_NAME_CHARS = 128;
/**
 * Longest request id, in characters (Save, QueryPrefetch, Load). An engine's
 * ids are short (vLLM's "cmpl-<uuid>-0", a router's prefixes: ~40-200); the
 * limit keeps a garbage id from being kept in the tiers' maps, echoed in
 * every error and logged, and it is what a log field keeps whole.
 */
export const MAX_REQUEST_ID_CHARS = 1024;
/**
 * Longest WaitPrefetch hold, in ms: a wait is a long poll, and a caller that
 * wants longer asks again (its deadline must cover each wait).
 */
export const MAX_PREFETCH_WAIT_MS = 60_000;
/**
 * Longest layer name, in characters. vLLM's are under 100 ("model.layers.31.self_attn.attn",
 * a multimodal model's longer prefixes); a name is kept per rank, hashed into the layout's
 * identity and echoed in every error about its layer.
 */
export const MAX_LAYER_NAME_CHARS = 1024;
/** Bytes of a lease id. */
export const LEASE_ID_BYTES = 16;
/** Bytes of a region handle: the C library's `PF_HANDLE_BYTES`, as ffi/ mirrors it. */
export const REGION_HANDLE_BYTES = HANDLE_BYTES;
