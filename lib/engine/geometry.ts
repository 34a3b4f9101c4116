/**
 * Layer geometry: where block `b`, segment `s` of a layer lives in its
 * region, and the checks that make every later copy safe. One formula for
 * every layout (K/V split, MLA, cross-layer):
 *
 *   addr(b, s) = base_offset + b * block_stride + s * seg_stride,  seg_bytes long
 *
 * Registration proves that every (b, s) range lies inside the region and
 * that no two ranges overlap, so a save or load only has to check
 * `block_id < num_blocks` per block id.
 *
 * @module
 */
import { invalid } from "./errors.ts";
import { MAX_SEGMENTS } from "../limits.ts";

/** Geometry of one layer in its region (numbers are bytes unless named). */
export interface Geometry {
  numBlocks: number;
  blockStride: number;
  segStride: number;
  segBytes: number;
  numSegments: number;
  baseOffset: number;
  regionBytes: number;
}

/** Bytes of one (block, layer, rank) slot in the pool: all segments back to back. */
export function slotBytes(g: Geometry): number {
  return g.segBytes * g.numSegments;
}

/**
 * Where segment `seg` of block `block` starts in the layer's region: the one
 * address formula (registration proved it in bounds for every valid id).
 *
 * @example
 * ```ts
 * segmentAddr({ ...g, baseOffset: 0, blockStride: 65536, segStride: 32768 }, 3, 1); // 229376
 * ```
 */
export function segmentAddr(g: Geometry, block: number, seg: number): number {
  return g.baseOffset + block * g.blockStride + seg * g.segStride;
}

/**
 * Why `id` names no block of a layer of `numBlocks` blocks, for a refusal's
 * message (the caller checks `id < numBlocks && id >= 0 && Number.isInteger(id)`:
 * the wire's uint32 cannot be negative, an in-process caller's number can).
 *
 * @example
 * ```ts
 * outOf(16, 16); // ">= num_blocks 16"
 * outOf(-1, 16); // "is not a block index 0..15"
 * ```
 */
export function outOf(id: number, numBlocks: number): string {
  return id >= numBlocks
    ? `>= num_blocks ${numBlocks}`
    : `is not a block index 0..${numBlocks - 1}`;
}

/** [first byte, end) of everything this layer's geometry can address. */
export function footprint(g: Geometry): [number, number] {
  const end = segmentAddr(g, g.numBlocks - 1, g.numSegments - 1) + g.segBytes;
  return [g.baseOffset, end];
}

/**
 * Throws INVALID_ARGUMENT (naming `where`, e.g. `instance "a" rank 0 layer "l3"`)
 * unless the geometry is in bounds and its segments cannot overlap.
 *
 * Accepted overlap-free shapes: one segment per block with
 * seg_bytes <= block_stride; several segments either inside the block
 * (seg_bytes <= seg_stride, num_segments * seg_stride <= block_stride) or
 * segment-major (K planes then V planes: seg_stride >= num_blocks * block_stride,
 * seg_bytes <= block_stride).
 */
export function validateGeometry(g: Geometry, where: string): void {
  const ints: [string, number][] = [
    ["num_blocks", g.numBlocks],
    ["block_stride", g.blockStride],
    ["seg_stride", g.segStride],
    ["seg_bytes", g.segBytes],
    ["num_segments", g.numSegments],
    ["base_offset", g.baseOffset],
    ["region_bytes", g.regionBytes],
  ];
  for (const [name, v] of ints) {
    if (!Number.isSafeInteger(v) || v < 0) {
      throw invalid(`${where}: ${name} ${v} is not a valid size`);
    }
  }
  if (g.numBlocks < 1) throw invalid(`${where}: num_blocks must be >= 1, got ${g.numBlocks}`);
  if (g.segBytes < 1) throw invalid(`${where}: seg_bytes must be >= 1, got ${g.segBytes}`);
  if (g.numSegments < 1 || g.numSegments > MAX_SEGMENTS) {
    throw invalid(`${where}: num_segments must be 1..${MAX_SEGMENTS}, got ${g.numSegments}`);
  }
  if (g.regionBytes < 1) throw invalid(`${where}: region_bytes must be >= 1`);
  if (g.numBlocks > 1 && g.segBytes > g.blockStride) {
    throw invalid(
      `${where}: blocks overlap: seg_bytes ${g.segBytes} > block_stride ${g.blockStride}`,
    );
  }
  if (g.numSegments > 1) {
    const inside = g.segBytes <= g.segStride && g.numSegments * g.segStride <= g.blockStride;
    const planes = g.segStride >= g.numBlocks * g.blockStride && g.segBytes <= g.blockStride;
    if (!inside && !planes) {
      throw invalid(
        `${where}: segments overlap or interleave: seg_stride ${g.segStride}, seg_bytes ${g.segBytes}, ` +
          `block_stride ${g.blockStride}, num_blocks ${g.numBlocks}, num_segments ${g.numSegments}`,
      );
    }
  }
  const [, end] = footprint(g);
  if (!Number.isSafeInteger(end) || end > g.regionBytes) {
    throw invalid(
      `${where}: geometry reaches byte ${end} but the region holds ${g.regionBytes} bytes`,
    );
  }
}
