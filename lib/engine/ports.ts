/**
 * The two things the engine orchestration stands on, named by what it needs
 * from them: the native copy layer (regions, shm, batch copies over the
 * pinned pool) and the block store (dedup, allocation, sealing, leases).
 * `native_adapter.ts` and `store_adapter.ts` bind them to ffi/ and
 * lib/storage/; tests never replace them (they run the real ones).
 *
 * @module
 */

/** A client's KV region mapped into the server (CUDA IPC or host shm). */
export interface RegionPort {
  /** Native handle (u32), for batch groups. */
  readonly handle: number;
  /** Closes the mapping; throws while copies still target it. */
  close(): void;
}

/** A small shared-memory control block (the engine's load state). */
export interface ShmPort {
  readonly handle: number;
  /** The mapped bytes (read/write). */
  readonly view: DataView;
  close(): void;
}

/** Direction of a batch copy. */
export type CopyDirection = "gather" | "scatter";

/**
 * A reusable batch descriptor: the engine writes groups (one per layer) and
 * segments into it, then submits; no allocation per segment.
 */
export interface BatchWriter {
  /** Makes room for a batch of this many groups and segments (grows; never shrinks). */
  ensure(groups: number, segs: number): void;
  /** Starts a new batch; `progress` names the shm words the copy publishes per-group progress to. */
  reset(direction: CopyDirection, progress?: { shm: ShmPort; offset: number }): void;
  /** Opens a group (a layer) whose segments follow. */
  group(region: RegionPort, layerId: number): void;
  /** Adds one segment to the current group. */
  seg(regionOff: number, poolOff: number, bytes: number): void;
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
  importRegion(handle: Uint8Array, bytes: number): RegionPort;
  openShm(name: string, bytes: number): ShmPort;
  /** A new reusable batch writer (call `ensure` before writing each batch). */
  batch(): BatchWriter;
  /**
   * Submits the batch as written. Resolves when the whole batch has landed,
   * rejects with the native error otherwise. The writer may be reset right
   * after this returns (the descriptor is copied at submit).
   */
  submit(batch: BatchWriter): Promise<CopyDone>;
  /** Waits for in-flight copies, then frees ring, pool and engine. */
  close(): Promise<void>;
}

/** One (block, slot) a save wants stored. */
export interface SlotIntent {
  hash: Uint8Array;
  /** Layer id (index in the instance's sorted layer names). */
  layer: number;
  tpRank: number;
}

/** What every block of a namespace looks like in the pool. */
export interface StoreLayout {
  /** Layers per block (all PP stages). */
  layers: number;
  tpSize: number;
  /** Segments per slot (2 = K/V split). */
  segments: number;
  /** Bytes of one segment. */
  segmentBytes: number;
}

/** The store's answer to a save: where to copy each slot, or that it is already held. */
export interface SaveTicket {
  /** Intents that need a copy. */
  readonly toCopy: number;
  /** Intents already held (dedup before copy). */
  readonly skipped: number;
  /** Pool offset of segment `seg` of intent `i`, or -1 when the slot is already held and needs no copy. */
  offset(i: number, seg: number): number;
}

/** A consumed lease: the pool offsets of each block's slots, pinned until loadDone. */
export interface LeaseView {
  readonly numBlocks: number;
  /** Pool offset of segment `seg` of `slot` of the i-th leased block. */
  offset(i: number, slot: number, seg: number): number;
}

/** Numbers for /metrics and /instances. */
export interface StoreStats {
  poolCapacityBytes: number;
  poolUsedBytes: number;
  cachedBlocks: number;
  cachedBytes: number;
  inflightBlocks: number;
  leases: number;
  hits: number;
  misses: number;
  evictions: number;
  admissionRejections: number;
  allocFailures: number;
}

/** The block store as the engine sees it. Errors are EngineErrors with gRPC codes. */
export interface StorePort {
  /** Binds a namespace to its layout; a different layout for a bound namespace fails FAILED_PRECONDITION. */
  bindLayout(namespace: string, layout: StoreLayout): void;
  /** Dedups and allocates; throws RESOURCE_EXHAUSTED when nothing evictable makes room. */
  beginSave(namespace: string, instanceId: string, intents: SlotIntent[]): SaveTicket;
  /** ok: the copied slots join their blocks (sealing complete ones); !ok: they are freed. */
  completeSave(ticket: SaveTicket, ok: boolean): void;
  /** Longest sealed prefix; a hit pins it under a lease consumable `consumers` times. */
  query(
    namespace: string,
    hashes: Uint8Array[],
    instanceId: string,
    consumers: number,
    ttlMs: number,
  ): { hits: number; leaseId: Uint8Array | null };
  /** One consume per (instance, rank); pins the blocks until loadDone. */
  consumeLease(leaseId: Uint8Array, instanceId: string, rank: number): LeaseView;
  loadDone(view: LeaseView): void;
  release(leaseId: Uint8Array): void;
  /** Releases every lease of the instance; returns how many. */
  dropInstance(instanceId: string): number;
  /** Evicts every unpinned cached block (POST /cache/memory/cleanup); returns bytes freed. */
  evictAll(): number;
  stats(): StoreStats;
  /** Stops timers (lease expiry, stale inflight collection). */
  close(): void;
}
