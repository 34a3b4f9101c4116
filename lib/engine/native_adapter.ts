/**
 * Binds the engine's {@link NativePort} to ffi/: one CopyEngine (engine +
 * pinned pool + completion ring) per server process, region imports, shm
 * control blocks, and a reusable CopyBatch that grows to the largest batch
 * seen (so steady state allocates nothing per request).
 *
 * @module
 */
import { CopyBatch, CopyEngine, type CopyPath, SharedMemory } from "../../ffi/mod.ts";
import type { Logger } from "../log.ts";
import type {
  BatchWriter,
  CopyDirection,
  CopyDone,
  NativePort,
  RegionPort,
  ShmPort,
} from "./ports.ts";

/** Options of {@link openNative}. */
export interface NativeOptions {
  backend: "auto" | "cuda" | "host";
  device: number;
  poolBytes: number;
  useHugepages: boolean;
  transferPath: "auto" | "kernel" | "dma";
}

/** First descriptor capacity; grows by doubling. */
const INITIAL_GROUPS = 64;
const INITIAL_SEGS = 4096;

/**
 * The engine's batch writer: grows its CopyBatch to the largest batch seen,
 * and merges a segment into the previous one when both continue it in the
 * region AND in the pool (consecutive blocks of one K or V plane saved into
 * consecutive pool items). A 10K-token Llama-3.1-8B prefix goes from 40,000
 * 32 KiB segments to 64 long ranges: less to write here and to parse in C,
 * and ranges long enough for the copy engines.
 */
class GrowingBatch implements BatchWriter {
  batch: CopyBatch;
  readonly #path: CopyPath;
  #r = 0;
  #p = 0;
  #n = 0;
  constructor(path: CopyPath) {
    this.#path = path;
    this.batch = new CopyBatch(INITIAL_GROUPS, INITIAL_SEGS);
  }
  ensure(groups: number, segs: number): void {
    if (groups <= this.batch.maxGroups && segs <= this.batch.maxSegs) return;
    let g = this.batch.maxGroups;
    let s = this.batch.maxSegs;
    while (g < groups) g *= 2;
    while (s < segs) s *= 2;
    this.batch = new CopyBatch(g, s);
  }
  reset(direction: CopyDirection, progress?: { shm: ShmPort; offset: number }): void {
    this.#n = 0;
    this.batch.reset(
      direction === "gather" ? "d2h" : "h2d",
      this.#path,
      progress ? { shm: progress.shm.handle, offset: progress.offset } : undefined,
    );
  }
  group(region: RegionPort, layerId: number): void {
    this.flush();
    this.batch.group(region.handle, layerId);
  }
  seg(regionOff: number, poolOff: number, bytes: number): void {
    if (this.#n > 0 && regionOff === this.#r + this.#n && poolOff === this.#p + this.#n) {
      this.#n += bytes;
      return;
    }
    this.flush();
    this.#r = regionOff;
    this.#p = poolOff;
    this.#n = bytes;
  }
  /** Writes the pending merged segment (before a new group and before submit). */
  flush(): void {
    if (this.#n > 0) this.batch.seg(this.#r, this.#p, this.#n);
    this.#n = 0;
  }
}

/**
 * Opens the native side for the server.
 *
 * @example
 * ```ts
 * const native = openNative({ backend: "host", device: 0, poolBytes: 1 << 30,
 *   useHugepages: false, transferPath: "auto" }, log);
 * ```
 */
export function openNative(
  opts: NativeOptions,
  log: Logger,
): NativePort & { copyEngine: CopyEngine } {
  const ce = CopyEngine.open({
    backend: opts.backend,
    device: opts.device,
    poolBytes: opts.poolBytes,
    hugepages: opts.useHugepages,
    pretouch: true,
  });
  const path: CopyPath = opts.transferPath === "kernel"
    ? "kernel"
    : opts.transferPath === "dma"
    ? (ce.engine.features.dmaBatch ? "dma_batch" : "dma")
    : "auto";
  const info = ce.pool.info();
  log.info("native engine open", {
    backend: ce.engine.backend,
    device: ce.engine.device,
    transfer_path: path,
    kernel: ce.engine.features.kernel,
    dma_batch: ce.engine.features.dmaBatch,
    pool_bytes: info.bytes,
    hugepages: info.hugepages,
    locked: info.locked,
    pool_alloc_ms: Math.round(info.allocNs / 1e6),
  });
  return {
    copyEngine: ce,
    backend: ce.engine.backend,
    poolBytes: ce.pool.bytes,
    importRegion(handle: Uint8Array, bytes: number): RegionPort {
      const r = ce.engine.importRegion(handle, bytes);
      return { handle: r.id, close: () => r.close() };
    },
    openShm(name: string, bytes: number): ShmPort {
      const shm = SharedMemory.open(name, bytes);
      const u8 = shm.view();
      return {
        handle: shm.handle,
        view: new DataView(u8.buffer, u8.byteOffset, u8.byteLength),
        close: () => shm.close(),
      };
    },
    batch(): BatchWriter {
      return new GrowingBatch(path);
    },
    async submit(b: BatchWriter): Promise<CopyDone> {
      const gb = b as GrowingBatch;
      gb.flush();
      const sub = ce.submit(gb.batch);
      const r = await sub.done;
      if (r.status !== 0) throw new Error(`copy batch failed with native status ${r.status}`);
      return { bytes: r.bytes, ns: r.ns };
    },
    close(): Promise<void> {
      return ce.close();
    },
  };
}
