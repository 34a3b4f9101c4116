/**
 * Copy-path policy: which libpegaflow path a batch should take, chosen from
 * the engine's calibration table (measured once at start-up) by the
 * batch's typical segment size. Policy lives here, in TypeScript; the C
 * library only runs the path it is told.
 *
 * Rule: the copy engines use no SMs, so a DMA path (dma_batch, else dma)
 * wins whenever it reaches `dmaTolerance` of the link's peak at that size;
 * otherwise the fastest measured path wins. `mixed` is a candidate for
 * saves (d2h) only: its copy-engine half reports the first layer late
 * (measured 7-22 ms into a 25 ms batch against ~1-2 ms for kernel and
 * dma_batch), which would waste layer-wise load. A forced path
 * (`--transfer-path`) overrides everything.
 *
 * @module
 */
import type { CalibrationTable, CopyPath, Direction, Engine, Pool } from "../ffi/mod.ts";

/** Segment sizes calibrated by default: 8 KB .. 2 MB, powers of two. */
export const CALIBRATION_SIZES: readonly number[] = [8, 16, 32, 64, 128, 256, 512, 1024, 2048].map((
  k,
) => k * 1024);
/** Fraction of the peak at which the SM-free DMA paths are good enough. */
export const DMA_TOLERANCE = 0.95;

/** Options of {@link PathPolicy}. */
export interface PathPolicyOptions {
  /** Force one path for every batch (`auto` = decide by calibration). */
  force?: CopyPath;
  /** See {@link DMA_TOLERANCE}. */
  dmaTolerance?: number;
}

/**
 * Chooses a copy path per batch from calibration tables (one per direction).
 *
 * @example
 * ```ts
 * const policy = PathPolicy.calibrate(ce.engine, ce.pool, 256 << 20);
 * batch.setPath(policy.choose("d2h", batch.bytes / batch.numSegs));
 * ```
 */
export class PathPolicy {
  readonly #tables: Partial<Record<Direction, CalibrationTable>>;
  readonly #force: CopyPath;
  readonly #tol: number;

  constructor(tables: Partial<Record<Direction, CalibrationTable>>, opts: PathPolicyOptions = {}) {
    this.#tables = tables;
    this.#force = opts.force ?? "auto";
    this.#tol = opts.dmaTolerance ?? DMA_TOLERANCE;
  }

  /**
   * Calibrates both directions on `engine` (seconds on a GPU) and returns a
   * policy. On the host backend every path is memcpy; the policy then
   * answers `auto`.
   */
  static calibrate(
    engine: Engine,
    pool: Pool,
    totalBytes: number,
    opts: PathPolicyOptions = {},
  ): PathPolicy {
    if (engine.backend !== "cuda" || (opts.force && opts.force !== "auto")) {
      return new PathPolicy({}, opts);
    }
    const bytes = Math.min(totalBytes, pool.bytes);
    const sizes = CALIBRATION_SIZES.filter((s) => s <= bytes / 16);
    return new PathPolicy({
      d2h: engine.calibrate(pool, "d2h", sizes, bytes),
      h2d: engine.calibrate(pool, "h2d", sizes, bytes),
    }, opts);
  }

  /** The calibration tables in use. */
  get tables(): Partial<Record<Direction, CalibrationTable>> {
    return this.#tables;
  }

  /** The path for a batch in `direction` whose segments are ~`segBytes`. */
  choose(direction: Direction, segBytes: number): CopyPath {
    if (this.#force !== "auto") return this.#force;
    const t = this.#tables[direction];
    if (!t || t.sizes.length === 0) return "auto";
    // Nearest calibrated size on a log scale.
    let i = 0;
    for (let k = 1; k < t.sizes.length; k++) {
      if (Math.abs(Math.log(t.sizes[k] / segBytes)) < Math.abs(Math.log(t.sizes[i] / segBytes))) {
        i = k;
      }
    }
    const dma: CopyPath = t.gbps.dma_batch[i] >= t.gbps.dma[i] ? "dma_batch" : "dma";
    if (t.gbps[dma][i] >= this.#tol * t.peak) return dma;
    const candidates: Array<Exclude<CopyPath, "auto">> = direction === "d2h"
      ? ["kernel", "mixed", "dma_batch", "dma"]
      : ["kernel", "dma_batch", "dma"];
    let best: Exclude<CopyPath, "auto"> = "kernel";
    for (const p of candidates) if (t.gbps[p][i] > t.gbps[best][i]) best = p;
    return t.gbps[best][i] > 0 ? best : "auto";
  }
}
