/**
 * Copy-path policy: which libpegaflow path a batch takes, chosen per batch
 * from the batch's mean segment size and the engine's calibration table
 * (measured at start-up, or read from the calibration cache:
 * `lib/copy_calibration.ts`). The C library is mechanism only: it runs the
 * path a batch carries and never picks one.
 *
 * Rule: the copy engines use no SMs (the kernel takes them from the model),
 * so a DMA path (dma_batch, else dma) wins whenever it reaches
 * {@link DMA_TOLERANCE} of the fastest path measured at that size; otherwise
 * that fastest path wins. The same bar for saves and loads: either one runs
 * beside a forward whose SMs a kernel copy would take. `mixed` is a candidate for saves (d2h) only: its
 * copy-engine half reports the first layer late (measured 7-22 ms into a
 * 25 ms batch against ~1-2 ms for kernel and dma_batch), which would waste
 * layer-wise load. A forced path (`--transfer-path kernel|dma`) overrides
 * everything. The host backend has one path (memcpy): the policy answers
 * `host` there.
 *
 * @module
 */
import type { CalibrationTable, CopyPath, Direction, GpuPath } from "../ffi/mod.ts";

/** Segment sizes calibrated by default: 8 KB .. 2 MB, powers of two. */
export const CALIBRATION_SIZES: readonly number[] = [8, 16, 32, 64, 128, 256, 512, 1024, 2048].map((
  k,
) => k * 1024);
/**
 * Fraction of the fastest path's rate at which the SM-free DMA paths are good
 * enough: a copy takes SMs only where DMA is less than half as fast (8-16 KB
 * segments). Measured on the H100:
 * - A load runs beside the forward that consumes it layer by layer: a
 *   10K-token warm request with its fragmented 32 KB ranges on the kernel
 *   (48 GB/s alone) reached its first token in 56.5 ms (p50), against
 *   32.6 ms on DMA at 33 GB/s; the two ran nearly one after the other.
 * - A save runs beside the next steps: with saves of 2 MB segments on the
 *   kernel (a few % faster than DMA in that start's calibration), decoding at
 *   0 % hits ran 2.0-2.6 % slower than with PegaFlow off; with DMA, no slower
 *   (`bench/results/ttft-cuda-dec-{auto,dma}.json`).
 */
export const DMA_TOLERANCE = 0.5;
/**
 * The path when a table has no usable figure for a size: plain DMA
 * (`cuMemcpyAsync`) exists on every driver and takes no SMs.
 */
export const FALLBACK_PATH: GpuPath = "dma";

/** What `--transfer-path` accepts. */
export type TransferPathFlag = "auto" | "kernel" | "dma";
/** The values of {@link TransferPathFlag}, for the CLI. */
export const TRANSFER_PATH_FLAGS: readonly TransferPathFlag[] = ["auto", "kernel", "dma"];

/** Options of {@link PathPolicy}. */
export interface PathPolicyOptions {
  /** The backend the batches run on (default `cuda`); `host` answers `host`. */
  backend?: "cuda" | "host";
  /** Force one GPU path for every batch (cuda only). */
  force?: GpuPath;
  /** See {@link DMA_TOLERANCE}. */
  dmaTolerance?: number;
}

/**
 * The forced path a `--transfer-path` value means on an engine: `auto`
 * forces nothing, `dma` is batch DMA where the driver has it.
 */
export function forcedPath(
  flag: TransferPathFlag,
  features: { dmaBatch: boolean },
): GpuPath | undefined {
  if (flag === "kernel") return "kernel";
  if (flag === "dma") return features.dmaBatch ? "dma_batch" : "dma";
  return undefined;
}

/**
 * Chooses a copy path per batch from calibration tables (one per direction).
 *
 * @example
 * ```ts
 * const policy = new PathPolicy({ d2h: table, h2d: table2 });
 * batch.setPath(policy.choose("d2h", batch.bytes / batch.numSegs));
 * ```
 */
export class PathPolicy {
  readonly #tables: Partial<Record<Direction, CalibrationTable>>;
  readonly #backend: "cuda" | "host";
  readonly #force: GpuPath | undefined;
  readonly #tol: number;

  constructor(tables: Partial<Record<Direction, CalibrationTable>>, opts: PathPolicyOptions = {}) {
    this.#tables = tables;
    this.#backend = opts.backend ?? "cuda";
    this.#force = opts.force;
    this.#tol = opts.dmaTolerance ?? DMA_TOLERANCE;
  }

  /** The calibration tables in use. */
  get tables(): Partial<Record<Direction, CalibrationTable>> {
    return this.#tables;
  }

  /** The forced path, if any. */
  get forced(): GpuPath | undefined {
    return this.#force;
  }

  /** The path for a batch in `direction` whose segments average `segBytes`. */
  choose(direction: Direction, segBytes: number): CopyPath {
    if (this.#backend === "host") return "host";
    if (this.#force) return this.#force;
    const t = this.#tables[direction];
    if (!t || t.sizes.length === 0) return FALLBACK_PATH;
    // Nearest calibrated size on a log scale.
    let i = 0;
    for (let k = 1; k < t.sizes.length; k++) {
      if (Math.abs(Math.log(t.sizes[k] / segBytes)) < Math.abs(Math.log(t.sizes[i] / segBytes))) {
        i = k;
      }
    }
    // A figure that is not a finite positive rate (NaN, Infinity, a missing
    // entry) is no throughput: it must neither win nor hide the others.
    const rate = (p: GpuPath): number => {
      const v = t.gbps[p]?.[i];
      return typeof v === "number" && Number.isFinite(v) && v > 0 ? v : 0;
    };
    const dma: GpuPath = rate("dma_batch") >= rate("dma") ? "dma_batch" : "dma";
    const candidates: GpuPath[] = direction === "d2h"
      ? ["kernel", "mixed", "dma_batch", "dma"]
      : ["kernel", "dma_batch", "dma"];
    let best: GpuPath = candidates[0];
    for (const p of candidates) if (rate(p) > rate(best)) best = p;
    if (rate(best) <= 0) return FALLBACK_PATH;
    // SMs are taken from the model only for a real gain over the copy engines.
    return rate(dma) >= this.#tol * rate(best) ? dma : best;
  }

  /**
   * The choice at each calibrated size, per direction (for the start-up
   * log line: an operator sees which path each segment size takes).
   */
  summary(): Record<string, string> {
    const out: Record<string, string> = {};
    for (const dir of ["d2h", "h2d"] as const) {
      const t = this.#tables[dir];
      if (!t) continue;
      out[dir] = t.sizes.map((s) => `${s >> 10}K:${this.choose(dir, s)}`).join(",");
    }
    return out;
  }
}
