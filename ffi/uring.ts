/**
 * The io_uring section of `libpegaflow.so` (SSD tier): its `Deno.dlopen`
 * symbol table and thin typed wrappers. No policy lives here: which blocks
 * go where, record formats and retries are decided in `lib/ssd/`.
 *
 * The library is opened with its own symbol table; `dlopen` of the same path
 * returns the same loaded object, so handles (pool, ring) created through
 * `ffi/symbols.ts` are valid here too.
 *
 * @module
 */
import { statusName } from "./native.ts";
import { libraryPath, loadLibrary } from "./symbols.ts";
import {
  decodeFileProps,
  decodeFsUsage,
  decodeUringStats,
  FILE_PROPS_BYTES,
  type FileInfo,
  FS_USAGE_BYTES,
  type FsSpace,
  isU53,
  notU53,
  URING_STATS_BYTES,
  type UringInfo,
} from "./structs.ts";

/** FFI declarations of the io_uring + CRC32C entry points (csrc/pegaflow.h). */
export const URING_SYMBOLS = {
  pf_last_error: { parameters: ["buffer", "u32"], result: "i32" },
  pf_uring_open: { parameters: ["u32", "u32", "u32", "u32", "buffer"], result: "i32" },
  pf_uring_hdr_ptr: { parameters: ["u32"], result: "pointer" },
  pf_uring_info: { parameters: ["u32", "buffer"], result: "i32" },
  // Waits for ops in flight: off the JS thread.
  // Off the JS thread: a failure's text comes back in the buffer, not pf_last_error.
  pf_uring_close: { parameters: ["u32", "buffer", "u32"], result: "i32", nonblocking: true },
  pf_file_open: { parameters: ["u32", "buffer", "u32", "buffer"], result: "i32" },
  pf_file_info: { parameters: ["u32", "buffer"], result: "i32" },
  pf_file_truncate: { parameters: ["u32", "u64"], result: "i32" },
  pf_file_allocate: { parameters: ["u32", "u64"], result: "i32" },
  pf_file_sync: { parameters: ["u32", "buffer", "u32"], result: "i32", nonblocking: true },
  pf_file_drop_cache: { parameters: ["u32"], result: "i32" },
  pf_file_close: { parameters: ["u32"], result: "i32" },
  pf_fs_space: { parameters: ["buffer", "buffer"], result: "i32" },
  // The file calls of an open that must not stall the JS thread (a hung disk,
  // a dead mount): the same four functions, off it. A failure's text stays in
  // the pf_last_error of the thread that ran the call.
  pf_file_open_off_thread: {
    name: "pf_file_open",
    parameters: ["u32", "buffer", "u32", "buffer"],
    result: "i32",
    nonblocking: true,
  },
  pf_file_info_off_thread: {
    name: "pf_file_info",
    parameters: ["u32", "buffer"],
    result: "i32",
    nonblocking: true,
  },
  pf_file_close_off_thread: {
    name: "pf_file_close",
    parameters: ["u32"],
    result: "i32",
    nonblocking: true,
  },
  pf_fs_space_off_thread: {
    name: "pf_fs_space",
    parameters: ["buffer", "buffer"],
    result: "i32",
    nonblocking: true,
  },
  pf_errno_text: { parameters: ["i32", "buffer", "u32"], result: "i32" },
  pf_io_submit: { parameters: ["u32", "buffer", "u64", "u64"], result: "i32" },
  // Checksums a whole batch (MBs): off the JS thread.
  pf_pool_crc32c: {
    parameters: ["u32", "buffer", "u64", "buffer"],
    result: "i32",
    nonblocking: true,
  },
  // Checksums a batch of blocks (MBs): off the JS thread.
  pf_pool_checksums: {
    parameters: ["u32", "buffer", "u64", "buffer", "u32", "buffer"],
    result: "i32",
    nonblocking: true,
  },
  // The same two calls on the JS thread, only to read a failure's text: they
  // fail in validation, before any work, and pf_last_error is thread-local.
  pf_pool_crc32c_here: {
    name: "pf_pool_crc32c",
    parameters: ["u32", "buffer", "u64", "buffer"],
    result: "i32",
  },
  pf_pool_checksums_here: {
    name: "pf_pool_checksums",
    parameters: ["u32", "buffer", "u64", "buffer", "u32", "buffer"],
    result: "i32",
  },
} as const satisfies Deno.ForeignLibraryInterface;

/** `enum pf_io_op`. */
export const IoOp = { READ: 0, WRITE: 1 } as const;
/** `enum pf_io_flags`. */
export const IoFlag = { CRC: 1 } as const;
/** `enum pf_file_flags`. */
export const FileFlag = { DIRECT: 1, CREATE: 2, RDONLY: 4 } as const;
/** `PF_IO_HDR_BYTES`: one header staging page, and the on-disk header size. */
export const IO_HDR_BYTES = 4096;
/** `sizeof(pf_io_batch_header)`. */
export const IO_BATCH_HEADER_BYTES = 16;
/** `sizeof(pf_io_desc)`. */
export const IO_DESC_BYTES = 32;
/** `sizeof(pf_io_ext)`. */
export const IO_EXT_BYTES = 16;
/** `PF_DONE_IO` / `PF_DONE_IO_BATCH` completion kinds. */
export const DONE_IO = 3;
/** @see DONE_IO */
export const DONE_IO_BATCH = 4;
/** `PF_EIO`. */
export const PF_EIO = -8;

/** A libpegaflow call failed; `code` is the PF_E* status. */
export class PegaflowIoError extends Error {
  constructor(readonly call: string, readonly code: number, detail: string) {
    super(`${call} failed (${code}): ${detail}`);
    this.name = "PegaflowIoError";
  }
}

type UringLib = Deno.DynamicLibrary<typeof URING_SYMBOLS>;
let lib: UringLib | undefined;

/** Opens (once) the library's io_uring symbols. Throws naming the path when it cannot. */
export function uringLib(): UringLib["symbols"] {
  if (!lib) {
    loadLibrary(); // checks the path and the ABI version first, with clear errors
    const path = libraryPath();
    try {
      lib = Deno.dlopen(path, URING_SYMBOLS);
    } catch (e) {
      throw new Error(
        `cannot load ${path} with the io_uring symbols: ${(e as Error).message}; run 'make native'`,
      );
    }
  }
  return lib.symbols;
}

/** Bytes of a library error text read back (the calling thread's, or a buffer's). */
const ERROR_TEXT_BYTES = 1024;
const errBuf = new Uint8Array(ERROR_TEXT_BYTES);
/** The calling thread's last libpegaflow error message. */
export function lastError(): string {
  const n = uringLib().pf_last_error(errBuf, errBuf.length);
  return new TextDecoder().decode(errBuf.subarray(0, Math.min(n, errBuf.length - 1)));
}

/** The NUL-terminated text a call wrote into `buf` ("" when it wrote none). */
function cText(buf: Uint8Array): string {
  const end = buf.indexOf(0);
  return new TextDecoder().decode(buf.subarray(0, end < 0 ? buf.length : end));
}

function check(call: string, rc: number): void {
  if (rc < 0) throw new PegaflowIoError(call, rc, lastError());
}

const textBuf = new Uint8Array(256);
const errnoNames = new Map<number, string>();
/** `strerror(errno)`, cached per value (errno values come from PF_DONE_IO records). */
export function errnoText(errno: number): string {
  let s = errnoNames.get(errno);
  if (s === undefined) {
    const n = uringLib().pf_errno_text(errno, textBuf, textBuf.length);
    s = new TextDecoder().decode(textBuf.subarray(0, Math.min(n, textBuf.length - 1)));
    errnoNames.set(errno, s);
  }
  return s;
}

function cstr(s: string): Uint8Array {
  const b = new TextEncoder().encode(s + "\0");
  if (b.indexOf(0) !== b.length - 1) throw new TypeError(`path contains a NUL byte: ${s}`);
  return b;
}

/** `pf_fs_space`: total and available bytes of the filesystem holding `path`. */
export function fsSpace(path: string): FsSpace {
  const out = new Uint8Array(FS_USAGE_BYTES);
  check(`pf_fs_space(${path})`, uringLib().pf_fs_space(cstr(path), out));
  return decodeFsUsage(out);
}

/**
 * A failure of a call run off the JS thread: its status by name, without the
 * library's text (that stays in the pf_last_error of the thread that ran it).
 */
function offThreadError(call: string, rc: number): PegaflowIoError {
  return new PegaflowIoError(
    call,
    rc,
    `${statusName(rc)} (run off the JS thread: the library's text of it is not kept)`,
  );
}

/** `call` naming `path` when one is given. */
function naming(call: string, path: string | undefined): string {
  return path === undefined ? call : `${call}(${path})`;
}

/**
 * `pf_file_open` off the JS thread ({@link Uring.openFile}, for a path whose
 * filesystem may hang): opens and registers `path` on the io_uring `uring`.
 *
 * @returns the file's handle.
 * @throws PegaflowIoError with the status's name, not the library's text.
 * @example
 * ```ts
 * const f = await openFileOffThread(u.handle, "/mnt/nvme/pf.cache", FileFlag.CREATE);
 * ```
 */
export async function openFileOffThread(
  uring: number,
  path: string,
  flags: number,
): Promise<number> {
  const name = cstr(path);
  const out = new Uint32Array(1);
  const rc = await uringLib().pf_file_open_off_thread(uring, name, flags, out);
  void name; // kept alive until the call returned
  if (rc < 0) throw offThreadError(`pf_file_open(${path})`, rc);
  return out[0];
}

/**
 * `pf_file_info` (an fstat) off the JS thread: {@link Uring.fileInfo}.
 * `path` only names the file in a failure.
 */
export async function fileInfoOffThread(file: number, path?: string): Promise<FileInfo> {
  const out = new Uint8Array(FILE_PROPS_BYTES);
  const rc = await uringLib().pf_file_info_off_thread(file, out);
  if (rc < 0) throw offThreadError(naming("pf_file_info", path), rc);
  return decodeFileProps(out);
}

/**
 * `pf_file_close` off the JS thread: {@link Uring.closeFile}. `path` only
 * names the file in a failure.
 */
export async function closeFileOffThread(file: number, path?: string): Promise<void> {
  const rc = await uringLib().pf_file_close_off_thread(file);
  if (rc < 0) throw offThreadError(naming("pf_file_close", path), rc);
}

/** `pf_fs_space` (a statvfs) off the JS thread: {@link fsSpace}. */
export async function fsSpaceOffThread(path: string): Promise<FsSpace> {
  const name = cstr(path);
  const out = new Uint8Array(FS_USAGE_BYTES);
  const rc = await uringLib().pf_fs_space_off_thread(name, out);
  void name; // kept alive until the call returned
  if (rc < 0) throw offThreadError(`pf_fs_space(${path})`, rc);
  return decodeFsUsage(out);
}

/**
 * One io_uring instance over a pool, posting to a completion ring.
 *
 * @example
 * ```ts
 * const u = Uring.open(pool, ring, 128, 1024);
 * const f = u.openFile("/mnt/nvme/pf.cache", FileFlag.DIRECT | FileFlag.CREATE);
 * u.submit(desc, descBytes, 7n); // completions arrive on the ring with tag 7
 * ```
 */
export class Uring {
  readonly #headers: Uint8Array;
  #closed = false;

  private constructor(readonly handle: number, readonly depth: number, readonly hdrPages: number) {
    const ptr = uringLib().pf_uring_hdr_ptr(handle);
    this.#headers = hdrPages > 0 && ptr
      ? new Uint8Array(Deno.UnsafePointerView.getArrayBuffer(ptr, hdrPages * IO_HDR_BYTES))
      : new Uint8Array(0);
  }

  /**
   * The header staging arena (hdrPages × IO_HDR_BYTES), shared with C.
   * @throws PegaflowIoError PF_EHANDLE once {@link Uring.close} began: the
   *   library frees the arena.
   */
  get headers(): Uint8Array {
    if (this.#closed) {
      throw new PegaflowIoError(
        "Uring.headers",
        -2,
        `uring ${this.handle} is closed: its header arena is freed`,
      );
    }
    return this.#headers;
  }

  /** `pf_uring_open`. `depth` is a power of two ≤ 4096. */
  static open(pool: number, ring: number, depth: number, hdrPages: number): Uring {
    const out = new Uint32Array(1);
    check(
      `pf_uring_open(depth ${depth}, hdrPages ${hdrPages})`,
      uringLib().pf_uring_open(pool, ring, depth, hdrPages, out),
    );
    return new Uring(out[0], depth, hdrPages);
  }

  /** Opens and registers a file; returns its handle. */
  openFile(path: string, flags: number): number {
    const out = new Uint32Array(1);
    check(`pf_file_open(${path})`, uringLib().pf_file_open(this.handle, cstr(path), flags, out));
    return out[0];
  }

  /** Size and O_DIRECT alignment of an open file. */
  fileInfo(file: number): FileInfo {
    const out = new Uint8Array(FILE_PROPS_BYTES);
    check("pf_file_info", uringLib().pf_file_info(file, out));
    return decodeFileProps(out);
  }

  /** `ftruncate`. */
  truncate(file: number, bytes: number): void {
    check(`pf_file_truncate(${bytes})`, uringLib().pf_file_truncate(file, BigInt(bytes)));
  }

  /** `fallocate`; returns false where the filesystem has none. */
  allocate(file: number, bytes: number): boolean {
    const rc = uringLib().pf_file_allocate(file, BigInt(bytes));
    if (rc === -11 /* PF_EUNSUPPORTED */) return false;
    check(`pf_file_allocate(${bytes})`, rc);
    return true;
  }

  /** `fdatasync`, off the JS thread. */
  async sync(file: number): Promise<void> {
    const err = new Uint8Array(ERROR_TEXT_BYTES);
    const rc = await uringLib().pf_file_sync(file, err, err.length);
    if (rc < 0) throw new PegaflowIoError("pf_file_sync", rc, cText(err) || `file handle ${file}`);
  }

  /** Drops the file's cached pages (benchmarks of buffered I/O). */
  dropCache(file: number): void {
    check("pf_file_drop_cache", uringLib().pf_file_drop_cache(file));
  }

  /** Closes a file (fails with PF_EBUSY while its ops are in flight). */
  closeFile(file: number): void {
    check("pf_file_close", uringLib().pf_file_close(file));
  }

  /** Submits one batch descriptor (see `pf_io_submit`); completions carry `tag`. */
  submit(desc: Uint8Array, tag: bigint): void {
    check(
      "pf_io_submit",
      uringLib().pf_io_submit(this.handle, desc, BigInt(desc.byteLength), tag),
    );
  }

  /** Counters of the engine. */
  info(): UringInfo {
    const out = new Uint8Array(URING_STATS_BYTES);
    check("pf_uring_info", uringLib().pf_uring_info(this.handle, out));
    return decodeUringStats(out);
  }

  /** Waits for ops in flight, then closes the engine and its files. Idempotent. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    const err = new Uint8Array(ERROR_TEXT_BYTES);
    const rc = await uringLib().pf_uring_close(this.handle, err, err.length);
    if (rc < 0) {
      throw new PegaflowIoError("pf_uring_close", rc, cText(err) || `uring handle ${this.handle}`);
    }
  }
}

/**
 * CRC32C of every op's pool extents in a batch descriptor, computed off the
 * JS thread. `out` receives one u32 per op.
 */
export async function poolCrc32c(pool: number, desc: Uint8Array, out: Uint32Array): Promise<void> {
  const rc = await uringLib().pf_pool_crc32c(pool, desc, BigInt(desc.byteLength), out);
  if (rc < 0) {
    const again = uringLib().pf_pool_crc32c_here(pool, desc, BigInt(desc.byteLength), out);
    throw new PegaflowIoError("pf_pool_crc32c", rc, failureText(again, pool));
  }
}

/**
 * The text of a checksum call that failed off the JS thread, from the same
 * call run again here (`again`: its status). Every failure of these calls is
 * a check of the handle and the extents before any byte is read, so it fails
 * again, at once, and this thread's pf_last_error holds the library's text.
 */
function failureText(again: number, pool: number): string {
  if (again < 0) return lastError();
  return `pool ${pool}: refused off the JS thread, accepted when run again (its handle or extents changed meanwhile)`;
}

/**
 * CRC32C of each block's pool ranges (in the order given, continued across
 * them), computed off the JS thread in ONE FFI call for the whole batch —
 * never one per block. `blocks[i]` lists block i's extents in payload order;
 * the answer is index-aligned. Two nodes agree on a block's checksum when its
 * bytes in payload order agree, however their pools cut it into ranges.
 *
 * @example
 * ```ts
 * const crcs = await poolChecksums(pool.handle, [[{ offset: 0, bytes: 4096 }]]);
 * ```
 */
export async function poolChecksums(
  pool: number,
  blocks: readonly (readonly { offset: number; bytes: number }[])[],
): Promise<Uint32Array> {
  const out = new Uint32Array(blocks.length);
  if (blocks.length === 0) return out;
  let n = 0;
  for (const b of blocks) n += b.length;
  // pf_io_ext {u64 pool_off, u64 bytes} as little-endian u32 words: no BigInt per extent.
  const exts = new Uint32Array(4 * n);
  const counts = new Uint32Array(blocks.length);
  let w = 0;
  for (let i = 0; i < blocks.length; i++) {
    counts[i] = blocks[i].length;
    for (let j = 0; j < blocks[i].length; j++) {
      const x = blocks[i][j];
      if (!(isU53(x.offset) && isU53(x.bytes))) {
        throw notU53(`poolChecksums: block ${i} extent ${j}`, ["offset", "bytes"], [
          x.offset,
          x.bytes,
        ]);
      }
      exts[w++] = x.offset >>> 0;
      exts[w++] = (x.offset / 4294967296) >>> 0;
      exts[w++] = x.bytes >>> 0;
      exts[w++] = (x.bytes / 4294967296) >>> 0;
    }
  }
  const args = [
    pool,
    new Uint8Array(exts.buffer),
    BigInt(n),
    new Uint8Array(counts.buffer),
    blocks.length,
    new Uint8Array(out.buffer),
  ] as const;
  const rc = await uringLib().pf_pool_checksums(...args);
  if (rc < 0) {
    // The library's own text is on the thread that ran the call: its checks again, here.
    const again = uringLib().pf_pool_checksums_here(...args);
    throw new PegaflowIoError("pf_pool_checksums", rc, failureText(again, pool));
  }
  return out;
}
