/**
 * What the engine orchestration needs from the native copy layer (regions,
 * shm, batch copies over the pinned pool), named by that need.
 * `native_adapter.ts` binds it to ffi/. The block store is lib/storage's
 * KvStore and the batch builder lib/transfer's TransferPlanner, used directly.
 *
 * @module
 */

/**
 * The client's shared memory vanished under a native access: the engine
 * shrank (ftruncate) a host region or its load-state block after the server
 * mapped it. Only the request that touched it fails; the server and every
 * other engine carry on. The message is the native layer's (region or shm
 * name, layer, offset); the engine adds instance, rank and request id.
 */
export class ClientMemoryFault extends Error {
  /** The native status (PF_EFAULT), also what a failed load state reports. */
  readonly status: number;
  constructor(status: number, message: string) {
    super(message);
    this.name = "ClientMemoryFault";
    this.status = status;
  }
}

/** A client's KV region mapped into the server (CUDA IPC or host shm). */
export interface RegionPort {
  /** Native handle (u32), for batch groups. */
  readonly handle: number;
  /** The served device it was opened on; its copies run on that device's lanes. */
  readonly device: number;
  /** Closes the mapping; throws while copies still target it. */
  close(): void;
}

/**
 * A small shared-memory control block the ENGINE owns (its load state). The
 * engine can shrink it at any time, so the server reaches it only through
 * guarded copies: a shrunk block makes these throw (native PF_EFAULT), it
 * never crashes the server.
 */
export interface ShmPort {
  readonly handle: number;
  /** Copies bytes at `offset` into `dst`. */
  read(offset: number, dst: Uint8Array): void;
  /** Copies `src` to `offset` (aligned u32 words land whole). */
  write(offset: number, src: Uint8Array): void;
  /** True while the name it was opened by still names this object, as long as it was (one stat). */
  same(): boolean;
  close(): void;
}

/** Direction of a batch copy. */
export type CopyDirection = "gather" | "scatter";

/** How a batch may be copied (`pf_batch_header.flags`). */
export interface BatchWriterOptions {
  /** Consumed only once all of it landed (an async load): an H2D copy may take several lanes. */
  whole?: boolean;
}

/**
 * A reusable batch descriptor: lib/transfer/plan.ts writes groups (one per
 * layer) and segments, already merged, into it; the engine submits it. No
 * allocation per segment, and the writer does not merge (one merger:
 * lib/transfer/ranges.ts).
 */
export interface BatchWriter {
  /** Makes room for a batch of this many groups and segments (grows; never shrinks). */
  ensure(groups: number, segs: number): void;
  /** Starts a new batch; `progress` names the shm words the copy publishes per-group progress to. */
  reset(
    direction: CopyDirection,
    progress?: { shm: ShmPort; offset: number },
    opts?: BatchWriterOptions,
  ): void;
  /** Opens a group (a layer) whose segments follow. */
  group(region: RegionPort, layerId: number): void;
  /** Adds one segment to the current group. */
  seg(regionOff: number, poolOff: number, bytes: number): void;
  /** Segments written since the last reset (ranges as merged: what the copy will issue). */
  readonly numSegs: number;
}

/** What a finished copy reports. */
export interface CopyDone {
  bytes: number;
  /** Native time from submit to end, ns. */
  ns: number;
}

/** The native copy layer as the engine sees it. */
export interface NativePort {
  readonly backend: "cuda" | "host";
  readonly poolBytes: number;
  /** Device ids this server serves (`--devices`), in the order given. */
  readonly devices: readonly number[];
  /** Maps a client region on `device` (one of {@link NativePort.devices}). */
  importRegion(handle: Uint8Array, bytes: number, device: number): RegionPort;
  openShm(name: string, bytes: number): ShmPort;
  /** A new reusable batch writer (call `ensure` before writing each batch). */
  batch(): BatchWriter;
  /**
   * Submits the batch as written, on the device of its regions (a batch is
   * one rank's, so all its groups name regions of one device). Throws synchronously when the library
   * refuses the batch (nothing was copied); otherwise resolves when the whole
   * batch has landed and rejects when it failed. Either way a fault on the
   * client's memory is a {@link ClientMemoryFault}. The writer may be reset
   * right after this returns (the descriptor is copied at submit).
   */
  submit(batch: BatchWriter): Promise<CopyDone>;
  /** Waits for in-flight copies, then frees ring, pool and engine. */
  close(): Promise<void>;
}
