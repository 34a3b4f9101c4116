/**
 * Thin typed wrappers over libpegaflow's transfer layer (`csrc/pf_xfer.h`):
 * {@link XferEndpoint} (this node's pool registered with a transport),
 * {@link XferPeer} (a connection to one remote endpoint), {@link XferBatch}
 * (a preallocated batch descriptor: no allocation and no FFI call per
 * segment). Completions arrive on the existing {@link CompletionRing}: one
 * `PF_DONE_XFER` record per batch, one `PF_DONE_XFER_IMM` per immediate
 * received. Which transport to use, and falling back, is decided in
 * `lib/transfer/`.
 *
 * @module
 */
import { filter, map, type Observable, type Subscription } from "rxjs";
import { libraryPath, loadLibrary } from "./symbols.ts";
import { NativeError, PF_STATUS, type Pool, statusName } from "./native.ts";
import type { CompletionRing } from "./ring.ts";
import {
  decodeXferPeerStatus,
  decodeXferStats,
  isU53,
  notU53,
  type PeerState,
  XFER_PEER_STATUS_BYTES,
  XFER_STATS_BYTES,
  type XferInfo,
} from "./structs.ts";
// The counters' shapes are decoded in structs.ts; callers of this module name them from here.
export type { PeerState, XferInfo } from "./structs.ts";

/** FFI declarations of the transfer entry points (csrc/pf_xfer.h). */
export const XFER_SYMBOLS = {
  pf_last_error: { parameters: ["buffer", "u32"], result: "i32" },
  pf_xfer_open: { parameters: ["u32", "u32", "buffer", "u64", "buffer"], result: "i32" },
  pf_xfer_info: { parameters: ["u32", "buffer"], result: "i32" },
  // Joins the listener and serving threads: off the JS thread.
  pf_xfer_close: { parameters: ["u32"], result: "i32", nonblocking: true },
  pf_xfer_peer_create: { parameters: ["u32", "buffer"], result: "i32" },
  pf_xfer_peer_info: { parameters: ["u32", "buffer", "u32"], result: "i32" },
  // Connects N sockets / moves QPs, waiting up to its timeout.
  pf_xfer_peer_connect: {
    parameters: ["u32", "buffer", "u32", "i32"],
    result: "i32",
    nonblocking: true,
  },
  pf_xfer_peer_state: { parameters: ["u32", "buffer"], result: "i32" },
  pf_xfer_peer_error: { parameters: ["u32", "buffer", "u32"], result: "i32" },
  // Posts the records of batches it cancels: may wait for ring room, which
  // only the JS thread frees.
  pf_xfer_peer_close: { parameters: ["u32"], result: "i32", nonblocking: true },
  // The 5th argument (checksums out) is written from a transport thread
  // until the batch's record: always an ArrayBuffer-backed array (off V8's
  // heap, never moved), kept alive by the pending entry.
  pf_xfer_submit: { parameters: ["u32", "buffer", "u64", "u64", "buffer"], result: "i32" },
  // Waits up to its timeout; its failure text comes back in the last buffer.
  pf_tcp_blast: {
    parameters: ["buffer", "u32", "u64", "u32", "u32", "u32", "buffer", "buffer", "u32"],
    result: "i32",
    nonblocking: true,
  },
  pf_rdma_devices: { parameters: ["buffer", "u32"], result: "i32" },
} as const satisfies Deno.ForeignLibraryInterface;

type XferLib = Deno.DynamicLibrary<typeof XFER_SYMBOLS>;
let lib: XferLib | undefined;

/** Opens (once) the library's transfer symbols. */
export function xferLib(): XferLib["symbols"] {
  if (!lib) {
    loadLibrary(); // checks the path and the ABI version first, with clear errors
    const path = libraryPath();
    try {
      lib = Deno.dlopen(path, XFER_SYMBOLS);
    } catch (e) {
      throw new Error(
        `cannot load ${path} with the transfer symbols: ${(e as Error).message}; run 'make native'`,
      );
    }
  }
  return lib.symbols;
}

const ERR_BUF = new Uint8Array(1024);
const DECODER = new TextDecoder();
const ENCODER = new TextEncoder();

function lastError(): string {
  const n = xferLib().pf_last_error(ERR_BUF, ERR_BUF.length);
  return DECODER.decode(ERR_BUF.subarray(0, Math.min(n, ERR_BUF.length - 1)));
}

function check(fn: string, rc: number): number {
  if (rc < 0) throw new NativeError(fn, rc, lastError());
  return rc;
}

/** A transport name. */
export type TransportName = "tcp" | "rdma";
/** `enum pf_xfer_transport`. */
export const TRANSPORT_CODES: Record<TransportName, number> = { tcp: 1, rdma: 2 };
/** A one-sided operation. */
export type XferOp = "read" | "write" | "write_imm";
/** `enum pf_xfer_op`. */
export const XFER_OP_CODES: Record<XferOp, number> = { read: 0, write: 1, write_imm: 2 };
const OP_NAMES: readonly XferOp[] = ["read", "write", "write_imm"];
/** `PF_DONE_XFER` / `PF_DONE_XFER_IMM` completion kinds. */
export const XFER_KIND = { DONE: 8, IMM: 9 } as const;
/** `PF_XFER_MAX_SEGS`. */
export const XFER_MAX_SEGS = 1 << 20;
/** `PF_XFER_MAX_INFLIGHT`: batches in flight per peer. */
export const XFER_MAX_INFLIGHT = 256;

const CONFIG_BYTES = 352; // sizeof(pf_xfer_config)
const HEADER_BYTES = 24; // sizeof(pf_xfer_header)
const SEG_BYTES = 24; // sizeof(pf_xfer_seg)
const GROUP_BYTES = 8; // a checksum group's u64 byte count
const TWO32 = 4294967296;

/** Options of {@link XferEndpoint.open}. */
export interface XferEndpointOptions {
  transport: TransportName;
  /** The pool to register (its bytes are what peers read and write). */
  pool: Pool;
  /** Where completions go. */
  ring: CompletionRing;
  /** TCP sockets per peer, or RDMA QPs per NIC per peer (1..64). */
  streams: number;
  /** TCP: SO_SNDBUF/SO_RCVBUF; 0 / absent = the kernel's autotuning. */
  sockBuf?: number;
  /** Segments longer than this are striped over the streams (≥ 4096; default 1 MiB). */
  stripeBytes?: number;
  /** Tag of incoming-immediate records. Default 0. */
  immTag?: number;
  /** TCP listen port (0 / absent = any free port). */
  port?: number;
  /** TCP listen address, an IP literal (default 0.0.0.0). */
  bindAddr?: string;
  /** RDMA devices, `name[:port]`, (default: every device found). */
  nics?: string[];
}

/** How a transfer batch ended. */
export interface XferResult {
  /** 0, or the negative `PF_E*` code. */
  status: number;
  /** `PF_E*` name of `status` ("PF_OK" when 0). */
  statusName: string;
  op: XferOp;
  /** Wire parts (TCP frames / RDMA chains) the batch was split into. */
  parts: number;
  /** ns from submit to end. */
  ns: number;
  /**
   * A READ with checksum groups that ended OK: the CRC32C of each group's
   * bytes as they landed in the local pool (see {@link XferBatch.group}).
   */
  crcs?: Uint32Array;
}

/** An immediate received from a peer's WRITE_IMM (after its data landed). */
export interface XferImm {
  /** The 32-bit immediate. */
  imm: number;
  /** Serving connection id (TCP) or peer handle (RDMA). */
  source: number;
  /** The batch's bytes as the sender declared them (TCP), else 0. */
  bytes: number;
}

function cfgBytes(o: XferEndpointOptions): Uint8Array {
  const b = new Uint8Array(CONFIG_BYTES);
  const dv = new DataView(b.buffer);
  dv.setUint32(0, TRANSPORT_CODES[o.transport], true);
  dv.setUint32(4, o.streams, true);
  dv.setUint32(8, o.sockBuf ?? 0, true);
  dv.setUint32(12, o.stripeBytes ?? 0, true);
  dv.setBigUint64(16, BigInt(o.immTag ?? 0), true);
  dv.setUint32(24, o.port ?? 0, true);
  dv.setUint32(28, 0, true);
  const bind = ENCODER.encode(o.bindAddr ?? "");
  const nics = ENCODER.encode((o.nics ?? []).join(","));
  if (bind.length > 63) throw new RangeError(`bindAddr "${o.bindAddr}" is over 63 bytes`);
  if (nics.length > 255) throw new RangeError(`nics list "${o.nics}" is over 255 bytes`);
  b.set(bind, 32);
  b.set(nics, 96);
  return b;
}

interface Pending {
  resolve: (r: XferResult) => void;
  /** Where the native side writes the group checksums (undefined: no groups). */
  crcs?: Uint32Array;
}

/**
 * This node's pool registered with one transport. TCP: listens and serves
 * peers' READs and WRITEs from/into the pool.
 *
 * @example
 * ```ts
 * const ep = XferEndpoint.open({ transport: "tcp", pool, ring, streams: 4 });
 * const peer = ep.createPeer();
 * await peer.connect("10.0.0.2:7010", 5000);
 * const batch = new XferBatch(1024).reset("read", 2000).seg(0, 0, 1 << 20);
 * const result = await peer.submit(batch); // {status: 0, ...}
 * await peer.close(); await ep.close();
 * ```
 */
export class XferEndpoint {
  /** The u32 endpoint handle. */
  readonly handle: number;
  readonly transport: TransportName;
  /** Immediates received (WRITE_IMM targets this endpoint). */
  readonly imm$: Observable<XferImm>;
  readonly #pending = new Map<number, Pending>();
  readonly #sub: Subscription;
  readonly #peers = new Set<XferPeer>();
  readonly #immTag: number;
  #nextTag: number;
  #closing: Promise<void> | undefined;
  #closedDone = false;

  private constructor(handle: number, opts: XferEndpointOptions) {
    this.handle = handle;
    this.transport = opts.transport;
    this.#immTag = opts.immTag ?? 0;
    // Tags of this endpoint's batches live above 2^48 so that they never
    // meet a CopyEngine's small tags on a shared ring.
    this.#nextTag = 2 ** 48 + handle * 2 ** 20;
    this.#sub = opts.ring.completions$.pipe(filter((c) => c.kind === XFER_KIND.DONE)).subscribe({
      next: (c) => {
        const p = this.#pending.get(c.tag);
        if (!p) return;
        this.#pending.delete(c.tag);
        p.resolve({
          status: c.status,
          statusName: statusName(c.status),
          op: OP_NAMES[c.index] ?? "read",
          parts: c.aux,
          ns: c.value,
          crcs: c.status === 0 ? p.crcs : undefined,
        });
      },
      complete: () => this.#failAll(PF_STATUS.PF_ESHUTDOWN),
      error: () => this.#failAll(PF_STATUS.PF_ESHUTDOWN),
    });
    this.imm$ = opts.ring.completions$.pipe(
      filter((c) => c.kind === XFER_KIND.IMM && c.tag === this.#immTag),
      map((c) => ({ imm: c.aux, source: c.index, bytes: c.value })),
    );
  }

  /**
   * Opens an endpoint. @throws NativeError: `PF_ENODEV` for RDMA without
   * libibverbs or a device (the message says which), `PF_EINVAL` for bad
   * options (named), `PF_EIO` when the TCP port cannot be bound.
   */
  static open(opts: XferEndpointOptions): XferEndpoint {
    if (!(opts.transport in TRANSPORT_CODES)) {
      throw new TypeError(`XferEndpoint.open: transport "${opts.transport}"; expected tcp or rdma`);
    }
    const cfg = cfgBytes(opts);
    const out = new Uint32Array(1);
    check(
      `pf_xfer_open(${opts.transport})`,
      xferLib().pf_xfer_open(opts.pool.handle, opts.ring.handle, cfg, BigInt(CONFIG_BYTES), out),
    );
    return new XferEndpoint(out[0], opts);
  }

  /** Counters and the listen port. */
  info(): XferInfo {
    const out = new Uint8Array(XFER_STATS_BYTES);
    check("pf_xfer_info", xferLib().pf_xfer_info(this.handle, out));
    return decodeXferStats(out);
  }

  /** A new, unconnected peer. */
  createPeer(): XferPeer {
    const out = new Uint32Array(1);
    check("pf_xfer_peer_create", xferLib().pf_xfer_peer_create(this.handle, out));
    const p = new XferPeer(out[0], this);
    this.#peers.add(p);
    return p;
  }

  /** @internal */
  track(tag: number, crcs?: Uint32Array): Promise<XferResult> {
    return new Promise((resolve) => this.#pending.set(tag, { resolve, crcs }));
  }

  /** @internal */
  nextTag(): number {
    return this.#nextTag++;
  }

  /** @internal */
  forget(p: XferPeer): void {
    this.#peers.delete(p);
  }

  #failAll(status: number): void {
    for (const [tag, p] of this.#pending) {
      p.resolve({ status, statusName: statusName(status), op: "read", parts: 0, ns: 0 });
      this.#pending.delete(tag);
    }
  }

  /**
   * Closes every peer (waiting for closes already under way), then the
   * endpoint (listener and serving threads). Idempotent; after a failure
   * (PF_EBUSY: a peer this object does not track is open) it may be retried.
   */
  close(): Promise<void> {
    this.#closing ??= this.#close().catch((e) => {
      this.#closing = undefined;
      throw e;
    });
    return this.#closing;
  }

  async #close(): Promise<void> {
    for (const p of [...this.#peers]) await p.close();
    const rc = await xferLib().pf_xfer_close(this.handle);
    if (rc < 0) {
      // The C text stays on the worker thread that ran the call: say what is known here.
      const open = rc === PF_STATUS.PF_EBUSY ? `still has ${this.info().peers} peer(s) open` : "";
      throw new NativeError("pf_xfer_close", rc, `endpoint ${this.handle} ${open}`.trimEnd());
    }
    this.#closedDone = true;
    this.#sub.unsubscribe();
  }

  /** The endpoint was closed: its handle is gone (what reads it, e.g. metrics, stops). */
  get closed(): boolean {
    return this.#closedDone;
  }
}

/** A connection from an endpoint to one remote endpoint. */
export class XferPeer {
  readonly handle: number;
  readonly #ep: XferEndpoint;
  #closed = false;
  #closing: Promise<void> | undefined;
  #connecting = false;

  /** @internal Use {@link XferEndpoint.createPeer}. */
  constructor(handle: number, ep: XferEndpoint) {
    this.handle = handle;
    this.#ep = ep;
  }

  /**
   * The bytes to hand to the remote side (TCP: this endpoint's listener as
   * "host:port" text; RDMA: QP numbers, PSNs, LIDs/GIDs, rkeys, pool address).
   */
  info(): Uint8Array {
    if (this.#closed) {
      throw new NativeError("pf_xfer_peer_info", -9, `peer ${this.handle} is closed`);
    }
    const n = check("pf_xfer_peer_info", xferLib().pf_xfer_peer_info(this.handle, null, 0));
    const buf = new Uint8Array(n);
    check("pf_xfer_peer_info", xferLib().pf_xfer_peer_info(this.handle, buf, n));
    return buf;
  }

  /** Connects to the remote described by `remote` ("host:port" for TCP). */
  async connect(remote: Uint8Array | string, timeoutMs: number): Promise<void> {
    const bytes = typeof remote === "string" ? ENCODER.encode(remote) : remote;
    // The peer keeps the text of a failed connect attempt only: the library's
    // argument checks leave theirs on the worker thread, where lastError()
    // would answer "" or an earlier attempt's text. So they are made here.
    const refuse = (code: number, why: string) => {
      throw new NativeError("pf_xfer_peer_connect", code, `peer ${this.handle}: ${why}`);
    };
    if (this.#closed) refuse(PF_STATUS.PF_EHANDLE, "is closed");
    if (bytes.length === 0) refuse(PF_STATUS.PF_EINVAL, "remote info is empty");
    if (!(Number.isInteger(timeoutMs) && timeoutMs > 0 && timeoutMs <= 0x7fffffff)) {
      refuse(PF_STATUS.PF_EINVAL, `timeoutMs ${timeoutMs} must be an integer in [1, 2^31)`);
    }
    if (this.#connecting) refuse(PF_STATUS.PF_EBUSY, "a connect is already under way");
    if (this.state().connected) refuse(PF_STATUS.PF_EINVAL, "is already connected");
    this.#connecting = true;
    let rc: number;
    try {
      // A close() meanwhile makes it give up at once with PF_ESHUTDOWN (the
      // library's close waits for it before freeing the peer).
      rc = await xferLib().pf_xfer_peer_connect(this.handle, bytes, bytes.length, timeoutMs);
    } finally {
      this.#connecting = false;
    }
    // pf_last_error belongs to the worker thread that ran the call; the peer
    // keeps its own copy (gone once close() began: lastError() says so).
    if (rc < 0) throw new NativeError("pf_xfer_peer_connect", rc, this.lastError());
  }

  /** Why the last connect failed, or what broke the peer ("" if nothing). */
  lastError(): string {
    // Once close() began, the library frees the peer on another thread: never read it then.
    if (this.#closed) return `peer ${this.handle} is closed`;
    const n = xferLib().pf_xfer_peer_error(this.handle, ERR_BUF, ERR_BUF.length);
    return n > 0 ? DECODER.decode(ERR_BUF.subarray(0, Math.min(n, ERR_BUF.length - 1))) : "";
  }

  /**
   * Connected, remote pool size, batches in flight, failure. A peer whose
   * close() began reads as broken by PF_ESHUTDOWN, without asking the library
   * (which frees the peer on another thread meanwhile).
   */
  state(): PeerState {
    if (this.#closed) {
      return { connected: false, remoteBytes: 0, inflight: 0, broken: PF_STATUS.PF_ESHUTDOWN };
    }
    const out = new Uint8Array(XFER_PEER_STATUS_BYTES);
    check("pf_xfer_peer_state", xferLib().pf_xfer_peer_state(this.handle, out));
    return decodeXferPeerStatus(out);
  }

  /**
   * Submits `batch` (one FFI call); resolves when its record arrives (never
   * rejects: read `status`). @throws NativeError when the batch is refused
   * before anything moved (bad segment: `PF_ERANGE` naming it; not
   * connected; broken peer, also one that broke as the batch was queued:
   * `PF_EIO` with the reason; too many in flight: `PF_EOVERFLOW`; the
   * transport could not queue it). A refused batch has no record.
   */
  submit(batch: XferBatch): Promise<XferResult> {
    if (this.#closed) throw new NativeError("pf_xfer_submit", -9, `peer ${this.handle} is closed`);
    const desc = batch.finish();
    const tag = this.#ep.nextTag();
    // One array per batch (not per block): the native side writes it after
    // this call returns, so it cannot be the reusable batch's own.
    const groups = batch.numGroups;
    const crcs = groups > 0 ? new Uint32Array(new ArrayBuffer(4 * groups)) : null;
    check(
      "pf_xfer_submit",
      xferLib().pf_xfer_submit(this.handle, desc, BigInt(desc.length), BigInt(tag), crcs),
    );
    return this.#ep.track(tag, crcs ?? undefined);
  }

  /**
   * Cancels what is in flight (records say PF_ESHUTDOWN) and disconnects.
   * Idempotent: every call resolves when the one close has finished, and the
   * endpoint's close waits for it too.
   */
  close(): Promise<void> {
    this.#closed = true;
    this.#closing ??= this.#close();
    return this.#closing;
  }

  async #close(): Promise<void> {
    try {
      const rc = await xferLib().pf_xfer_peer_close(this.handle);
      // The C text stays on the worker thread that ran the call.
      if (rc < 0) throw new NativeError("pf_xfer_peer_close", rc, `peer ${this.handle}`);
    } finally {
      this.#ep.forget(this);
    }
  }
}

/**
 * A reusable transfer batch descriptor (`pf_xfer_header` + `pf_xfer_seg[]`
 * + checksum groups), written as u32 words: no allocation and no FFI call
 * per segment.
 *
 * @example
 * ```ts
 * const batch = new XferBatch(4096);
 * batch.reset("read", 5000);
 * for (const b of blocks) batch.seg(b.remoteOff, b.localOff, b.bytes);
 * const result = await peer.submit(batch);
 * ```
 */
export class XferBatch {
  /** Most segments this descriptor holds. */
  readonly maxSegs: number;
  /** Most checksum groups this descriptor holds. */
  readonly maxGroups: number;
  readonly #buf: Uint8Array;
  readonly #u32: Uint32Array;
  /** Group byte counts as u32 pairs, copied behind the segments by finish(). */
  readonly #groupWords: Uint32Array;
  #segs = 0;
  #bytes = 0;
  #groups = 0;

  constructor(maxSegs: number, maxGroups = 0) {
    if (!Number.isInteger(maxSegs) || maxSegs < 1 || maxSegs > XFER_MAX_SEGS) {
      throw new RangeError(`XferBatch: maxSegs ${maxSegs}; expected 1..${XFER_MAX_SEGS}`);
    }
    if (!Number.isInteger(maxGroups) || maxGroups < 0 || maxGroups > XFER_MAX_SEGS) {
      throw new RangeError(`XferBatch: maxGroups ${maxGroups}; expected 0..${XFER_MAX_SEGS}`);
    }
    this.maxSegs = maxSegs;
    this.maxGroups = maxGroups;
    this.#buf = new Uint8Array(HEADER_BYTES + SEG_BYTES * maxSegs + GROUP_BYTES * maxGroups);
    this.#u32 = new Uint32Array(this.#buf.buffer);
    this.#groupWords = new Uint32Array(2 * maxGroups);
  }

  /** Checksum groups written since reset. */
  get numGroups(): number {
    return this.#groups;
  }

  /** Segments written since reset. */
  get numSegs(): number {
    return this.#segs;
  }
  /** Sum of segment bytes since reset. */
  get bytes(): number {
    return this.#bytes;
  }

  /** Starts a new batch: `op`, its deadline, and (write_imm) the immediate. */
  reset(op: XferOp, timeoutMs: number, imm = 0): this {
    const code = XFER_OP_CODES[op];
    if (code === undefined) {
      throw new TypeError(`XferBatch.reset: op "${op}"; expected read, write or write_imm`);
    }
    const u = this.#u32;
    u[0] = code;
    u[1] = 0;
    u[2] = timeoutMs >>> 0;
    u[3] = imm >>> 0;
    u[4] = 0;
    u[5] = 0;
    this.#segs = 0;
    this.#bytes = 0;
    this.#groups = 0;
    return this;
  }

  /** Adds (remote offset, local offset, bytes): integers in [0, 2^53), else a RangeError. */
  seg(remoteOff: number, localOff: number, bytes: number): this {
    if (this.#segs === this.maxSegs) {
      throw new RangeError(`XferBatch.seg: batch holds at most ${this.maxSegs} segments`);
    }
    if (!(isU53(remoteOff) && isU53(localOff) && isU53(bytes))) {
      throw notU53(`XferBatch.seg: segment ${this.#segs}`, ["remoteOff", "localOff", "bytes"], [
        remoteOff,
        localOff,
        bytes,
      ]);
    }
    const u = this.#u32;
    const w = (HEADER_BYTES >> 2) + this.#segs * (SEG_BYTES >> 2);
    u[w] = remoteOff >>> 0;
    u[w + 1] = (remoteOff / TWO32) >>> 0;
    u[w + 2] = localOff >>> 0;
    u[w + 3] = (localOff / TWO32) >>> 0;
    u[w + 4] = bytes >>> 0;
    u[w + 5] = (bytes / TWO32) >>> 0;
    this.#segs++;
    this.#bytes += bytes;
    return this;
  }

  /**
   * Adds a checksum group (READ only): the next `bytes` of the payload in
   * segment order. The groups must cover the segments' bytes exactly; the
   * result's `crcs[g]` is then group g's CRC32C as it landed, computed by
   * the transport while receiving (no second pass over memory).
   */
  group(bytes: number): this {
    if (this.#groups === this.maxGroups) {
      throw new RangeError(`XferBatch.group: batch holds at most ${this.maxGroups} groups`);
    }
    if (!isU53(bytes)) throw notU53(`XferBatch.group: group ${this.#groups}`, ["bytes"], [bytes]);
    const w = 2 * this.#groups++;
    this.#groupWords[w] = bytes >>> 0;
    this.#groupWords[w + 1] = (bytes / TWO32) >>> 0;
    return this;
  }

  /** Writes the counts into the header; returns the bytes to submit. */
  finish(): Uint8Array {
    const u = this.#u32;
    u[1] = this.#segs;
    u[4] = this.#groups;
    const end = HEADER_BYTES + SEG_BYTES * this.#segs;
    u.set(this.#groupWords.subarray(0, 2 * this.#groups), end >> 2);
    return this.#buf.subarray(0, end + GROUP_BYTES * this.#groups);
  }
}

/** Options of {@link tcpBlast}. */
export interface BlastOptions {
  /** Receive into this pool (each stream its slice); absent: 1 MiB per stream, like iperf. */
  pool?: Pool;
  /** SO_SNDBUF/SO_RCVBUF; 0 / absent = the kernel's autotuning. */
  sockBuf?: number;
}

/**
 * Raw TCP throughput of a path (what iperf measures): `streams` plain
 * connections to the TCP endpoint at `addr`, each receiving
 * `bytesPerStream` unframed bytes — into `opts.pool` (each stream its
 * slice, the server sending from as much of its own pool), or, without one,
 * into 1 MiB per stream like iperf. Every stream must be done within
 * `timeoutMs` (1 .. 3,600,000). Returns ns from first connect to last byte.
 * @throws NativeError naming the stream and what went wrong: `PF_ETIMEDOUT`
 * with the bytes still missing at the deadline, `PF_EIO` for a refused or
 * dropped connection.
 *
 * @example
 * ```ts
 * const ns = await tcpBlast("10.0.0.2:7010", 4, 128 << 20, 60_000, { pool });
 * console.log(`${(4 * (128 << 20)) / ns} GB/s`);
 * ```
 */
export async function tcpBlast(
  addr: string,
  streams: number,
  bytesPerStream: number,
  timeoutMs: number,
  opts: BlastOptions = {},
): Promise<number> {
  if (!(Number.isInteger(timeoutMs) && timeoutMs >= 1 && timeoutMs <= 3_600_000)) {
    throw new NativeError(
      "pf_tcp_blast",
      PF_STATUS.PF_EINVAL,
      `to ${addr}: timeoutMs ${timeoutMs} must be an integer in [1, 3600000]`,
    );
  }
  const a = ENCODER.encode(addr + "\0");
  const out = new BigUint64Array(1);
  // Its own buffer: another blast may be running on another worker thread.
  const err = new Uint8Array(512);
  const rc = await xferLib().pf_tcp_blast(
    a,
    streams,
    BigInt(bytesPerStream),
    opts.pool?.handle ?? 0,
    opts.sockBuf ?? 0,
    timeoutMs,
    out,
    err,
    err.length,
  );
  if (rc < 0) {
    const text = DECODER.decode(err.subarray(0, Math.max(0, err.indexOf(0))));
    throw new NativeError("pf_tcp_blast", rc, text || `to ${addr}: ${statusName(rc)}`);
  }
  return Number(out[0]);
}

/** The RDMA devices libibverbs lists (empty when there are none). @throws NativeError PF_ENODEV without libibverbs. */
export function rdmaDevices(): string[] {
  const buf = new Uint8Array(4096);
  const n = check("pf_rdma_devices", xferLib().pf_rdma_devices(buf, buf.length));
  const s = DECODER.decode(buf.subarray(0, Math.min(n, buf.length - 1)));
  return s ? s.split(",") : [];
}
