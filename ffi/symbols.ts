/**
 * The `Deno.dlopen` symbol table of `libpegaflow.so` and its loader.
 *
 * Every signature mirrors `csrc/pegaflow.h` exactly; u64 arguments are
 * passed as BigInt (V8's fast path). `pf_ring_wait` is `nonblocking`: it runs
 * on a Deno worker thread so JS never blocks waiting for completions. The
 * io_uring section (SSD tier) lives in `ffi/uring.ts`.
 *
 * @module
 */

/** FFI declarations of every libpegaflow entry point. */
export const SYMBOLS = {
  pf_last_error: { parameters: ["buffer", "u32"], result: "i32" },
  pf_abi_version: { parameters: [], result: "i32" },

  pf_engine_open: { parameters: ["i32", "i32", "u32", "buffer"], result: "i32" },
  pf_engine_info: { parameters: ["u32", "buffer"], result: "i32" },
  pf_engine_set_kernel_grid: { parameters: ["u32", "u32"], result: "i32" },
  pf_engine_set_dma_share: { parameters: ["u32", "u32"], result: "i32" },
  pf_engine_close: { parameters: ["u32"], result: "i32" },
  pf_engine_fail: { parameters: ["u32", "i32"], result: "i32" },
  pf_device_count: { parameters: ["i32", "buffer"], result: "i32" },
  pf_device_numa_node: { parameters: ["i32", "i32", "buffer"], result: "i32" },

  pf_ring_create: { parameters: ["u32", "buffer"], result: "i32" },
  pf_ring_ptr: { parameters: ["u32"], result: "pointer" },
  pf_ring_wait: { parameters: ["u32", "u64", "i32"], result: "i64", nonblocking: true },
  pf_ring_take_error: { parameters: ["u32", "u64", "buffer", "u32"], result: "i32" },
  pf_ring_shutdown: { parameters: ["u32"], result: "i32" },
  pf_ring_destroy: { parameters: ["u32"], result: "i32" },

  pf_pool_create_split: {
    parameters: ["u32", "u64", "u32", "u32", "buffer", "buffer", "u32", "buffer"],
    result: "i32",
  },
  // The same function run off the JS thread: a pool of tens of GiB takes
  // seconds to pre-touch and lock, and the caller reports progress meanwhile.
  pf_pool_create_split_nonblocking: {
    name: "pf_pool_create_split",
    parameters: ["u32", "u64", "u32", "u32", "buffer", "buffer", "u32", "buffer"],
    result: "i32",
    nonblocking: true,
  },
  pf_pool_ptr: { parameters: ["u32"], result: "pointer" },
  pf_pool_info: { parameters: ["u32", "buffer"], result: "i32" },
  pf_pool_destroy: { parameters: ["u32"], result: "i32" },

  pf_region_alloc: { parameters: ["u32", "u64", "buffer", "buffer"], result: "i32" },
  pf_region_import: { parameters: ["u32", "buffer", "u64", "buffer"], result: "i32" },
  pf_region_info: { parameters: ["u32", "buffer"], result: "i32" },
  pf_region_write: { parameters: ["u32", "u64", "buffer", "u64"], result: "i32" },
  pf_region_read: { parameters: ["u32", "u64", "buffer", "u64"], result: "i32" },
  pf_region_close: { parameters: ["u32"], result: "i32" },

  pf_copy_submit: {
    parameters: ["u32", "u32", "u32", "buffer", "u64", "u64"],
    result: "i32",
  },
  pf_calibrate: {
    parameters: ["u32", "u32", "u32", "buffer", "u32", "u64", "buffer"],
    result: "i32",
  },

  pf_shm_open: { parameters: ["buffer", "u64", "u32", "buffer"], result: "i32" },
  pf_shm_ptr: { parameters: ["u32"], result: "pointer" },
  pf_shm_same: { parameters: ["u32"], result: "i32" },
  pf_shm_read: { parameters: ["u32", "u64", "buffer", "u64"], result: "i32" },
  pf_shm_write: { parameters: ["u32", "u64", "buffer", "u64"], result: "i32" },
  pf_shm_close: { parameters: ["u32"], result: "i32" },
  // The io_uring section (SSD tier) has its own table in ffi/uring.ts.
} as const satisfies Deno.ForeignLibraryInterface;

/** The loaded library's symbols. */
export type PegaflowSymbols = Deno.DynamicLibrary<typeof SYMBOLS>["symbols"];

/** The ABI version these bindings were written for (`PF_ABI_VERSION`). */
export const EXPECTED_ABI_VERSION = 10;

let loaded: Deno.DynamicLibrary<typeof SYMBOLS> | undefined;

/**
 * Where the library is looked for: `$PEGAFLOW_LIB`, else
 * `<repo>/build/libpegaflow.so` resolved relative to this module.
 */
export function libraryPath(): string {
  const fromEnv = Deno.env.get("PEGAFLOW_LIB");
  if (fromEnv) return fromEnv;
  return decodeURIComponent(new URL("../build/libpegaflow.so", import.meta.url).pathname);
}

/**
 * Loads `libpegaflow.so` once and returns its symbols.
 *
 * @throws Error naming the path and what to do when the library is missing
 *   or its ABI version differs.
 * @example
 * ```ts
 * const pf = loadLibrary();
 * console.log(pf.pf_abi_version());
 * ```
 */
export function loadLibrary(): PegaflowSymbols {
  if (loaded) return loaded.symbols;
  const path = libraryPath();
  try {
    Deno.statSync(path);
  } catch (err) {
    if (err instanceof Deno.errors.NotFound) {
      throw new Error(
        `libpegaflow not found at ${path}: run \`make native\` in the repository root ` +
          `(or set PEGAFLOW_LIB to the library's path)`,
      );
    }
    throw err;
  }
  const lib = Deno.dlopen(path, SYMBOLS);
  const abi = lib.symbols.pf_abi_version();
  if (abi !== EXPECTED_ABI_VERSION) {
    lib.close();
    throw new Error(
      `libpegaflow at ${path} implements ABI ${abi}; these bindings expect ` +
        `${EXPECTED_ABI_VERSION}: rebuild with \`make native\``,
    );
  }
  loaded = lib;
  return lib.symbols;
}
