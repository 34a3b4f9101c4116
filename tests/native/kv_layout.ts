/**
 * Test helper: KV-cache layouts described by the DESIGN formula
 * `addr(block, seg) = base + block*block_stride + seg*seg_stride`, content
 * derived from (block, layer, seg) so every byte is checkable, and batch
 * builders for gather (region → pool) and scatter (pool → region).
 * Shared by tests/native and tests/gpu.
 */
import {
  CopyBatch,
  type CopyEngine,
  type CopyPath,
  type Engine,
  type Region,
} from "../../ffi/mod.ts";

/** The layout kinds the engines we serve use. */
export type LayoutKind = "kv_split" | "kv_interleaved" | "mla" | "cross_layer";

/** One layer's geometry inside its region. */
export interface LayerGeometry {
  /** Index into the regions array. */
  regionIndex: number;
  base: number;
  blockStride: number;
  segStride: number;
}

/** A whole model's KV geometry. */
export interface Geometry {
  kind: LayoutKind;
  numBlocks: number;
  numLayers: number;
  numSegs: number;
  segBytes: number;
  /** Bytes of each region to allocate. */
  regionBytes: number[];
  layers: LayerGeometry[];
}

/** Builds a geometry of `kind`. */
export function makeGeometry(
  kind: LayoutKind,
  numBlocks: number,
  numLayers: number,
  segBytes: number,
  numSegsCross = 2,
): Geometry {
  const layers: LayerGeometry[] = [];
  const regionBytes: number[] = [];
  let numSegs: number;
  switch (kind) {
    case "kv_split": // vLLM flash-attn: per layer [2][num_blocks][seg]
      numSegs = 2;
      for (let l = 0; l < numLayers; l++) {
        regionBytes.push(2 * numBlocks * segBytes);
        layers.push({
          regionIndex: l,
          base: 0,
          blockStride: segBytes,
          segStride: numBlocks * segBytes,
        });
      }
      break;
    case "kv_interleaved": // per layer [num_blocks][2][seg]: K and V adjacent
      numSegs = 2;
      for (let l = 0; l < numLayers; l++) {
        regionBytes.push(2 * numBlocks * segBytes);
        layers.push({ regionIndex: l, base: 0, blockStride: 2 * segBytes, segStride: segBytes });
      }
      break;
    case "mla": // one latent segment per block per layer
      numSegs = 1;
      for (let l = 0; l < numLayers; l++) {
        regionBytes.push(numBlocks * segBytes);
        layers.push({ regionIndex: l, base: 0, blockStride: segBytes, segStride: 0 });
      }
      break;
    case "cross_layer": // one region [num_blocks][num_layers][segs][seg]
      numSegs = numSegsCross;
      regionBytes.push(numBlocks * numLayers * numSegs * segBytes);
      for (let l = 0; l < numLayers; l++) {
        layers.push({
          regionIndex: 0,
          base: l * numSegs * segBytes,
          blockStride: numLayers * numSegs * segBytes,
          segStride: segBytes,
        });
      }
      break;
  }
  return { kind, numBlocks, numLayers, numSegs, segBytes, regionBytes, layers };
}

/** Byte offset of (block, layer, seg) in its region. */
export function addr(g: Geometry, block: number, layer: number, seg: number): number {
  const L = g.layers[layer];
  return L.base + block * L.blockStride + seg * L.segStride;
}

/** Pool offset of batch slot `slot` (the i-th block of a batch). */
export function poolOff(g: Geometry, slot: number, layer: number, seg: number): number {
  return ((slot * g.numLayers + layer) * g.numSegs + seg) * g.segBytes;
}

/** Pool bytes a batch of `n` blocks needs. */
export function poolBytesFor(g: Geometry, n: number): number {
  return n * g.numLayers * g.numSegs * g.segBytes;
}

/** Deterministic content of segment (block, layer, seg): xorshift32 stream. */
export function fillSegment(out: Uint8Array, block: number, layer: number, seg: number): void {
  let x = (Math.imul(block + 1, 0x9e3779b1) ^ Math.imul(layer + 7, 0x85ebca6b) ^
    Math.imul(seg + 3, 0xc2b2ae35)) | 1;
  let i = 0;
  const n = out.length;
  for (; i + 4 <= n; i += 4) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    out[i] = x;
    out[i + 1] = x >>> 8;
    out[i + 2] = x >>> 16;
    out[i + 3] = x >>> 24;
  }
  for (; i < n; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    out[i] = x;
  }
}

/** Fills every block of every layer of `regions` with its content. */
export function fillRegions(g: Geometry, regions: Region[]): void {
  const images = g.regionBytes.map((b) => new Uint8Array(b));
  const seg = new Uint8Array(g.segBytes);
  for (let l = 0; l < g.numLayers; l++) {
    const img = images[g.layers[l].regionIndex];
    for (let b = 0; b < g.numBlocks; b++) {
      for (let s = 0; s < g.numSegs; s++) {
        fillSegment(seg, b, l, s);
        img.set(seg, addr(g, b, l, s));
      }
    }
  }
  images.forEach((img, i) => regions[i].write(0, img));
}

/** Allocates (zeroed) regions for `g` on `engine`. */
export function allocRegions(engine: Engine, g: Geometry): Region[] {
  return g.regionBytes.map((b) => engine.allocRegion(b));
}

/** Writes a gather (d2h) or scatter (h2d) of `blocks` (slot i = blocks[i]). */
export function buildBatch(
  batch: CopyBatch,
  g: Geometry,
  regions: Region[],
  blocks: number[],
  direction: "d2h" | "h2d",
): CopyBatch {
  batch.reset(direction);
  for (let l = 0; l < g.numLayers; l++) {
    batch.group(regions[g.layers[l].regionIndex], l);
    for (let i = 0; i < blocks.length; i++) {
      for (let s = 0; s < g.numSegs; s++) {
        batch.seg(addr(g, blocks[i], l, s), poolOff(g, i, l, s), g.segBytes);
      }
    }
  }
  return batch;
}

/** Expected pool bytes after gathering `blocks`. */
export function expectedPool(g: Geometry, blocks: number[]): Uint8Array {
  const out = new Uint8Array(poolBytesFor(g, blocks.length));
  const seg = new Uint8Array(g.segBytes);
  for (let i = 0; i < blocks.length; i++) {
    for (let l = 0; l < g.numLayers; l++) {
      for (let s = 0; s < g.numSegs; s++) {
        fillSegment(seg, blocks[i], l, s);
        out.set(seg, poolOff(g, i, l, s));
      }
    }
  }
  return out;
}

/**
 * Expected image of each destination region after scattering the content of
 * `srcBlocks[i]` into `dstBlocks[i]` (everything else zero).
 */
export function expectedRegions(
  g: Geometry,
  srcBlocks: number[],
  dstBlocks: number[],
): Uint8Array[] {
  const images = g.regionBytes.map((b) => new Uint8Array(b));
  const seg = new Uint8Array(g.segBytes);
  for (let i = 0; i < srcBlocks.length; i++) {
    for (let l = 0; l < g.numLayers; l++) {
      for (let s = 0; s < g.numSegs; s++) {
        fillSegment(seg, srcBlocks[i], l, s);
        images[g.layers[l].regionIndex].set(seg, addr(g, dstBlocks[i], l, s));
      }
    }
  }
  return images;
}

/** Index of the first differing byte, or -1. */
export function firstDiff(a: Uint8Array, b: Uint8Array): number {
  if (a.length !== b.length) return Math.min(a.length, b.length);
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return i;
  return -1;
}

/** `n` distinct block ids out of [0, numBlocks), shuffled or sorted. */
export function pickBlocks(
  rand: () => number,
  numBlocks: number,
  n: number,
  sorted: boolean,
): number[] {
  const ids = Array.from({ length: numBlocks }, (_, i) => i);
  for (let i = ids.length - 1; i > 0; i--) {
    const j = Math.floor(rand() * (i + 1));
    [ids[i], ids[j]] = [ids[j], ids[i]];
  }
  const out = ids.slice(0, n);
  return sorted ? out.sort((a, b) => a - b) : out;
}

/** Options of {@link runRoundTrip}. */
export interface RoundTripOptions {
  /** Copy path for both batches (default: `host` on host, `dma` on cuda). */
  path?: CopyPath;
  /** Pool offset where the batch's slots start (default 0). */
  poolBase?: number;
}

/**
 * Gathers `srcBlocks` of `src` into the pool, checks every pool byte, then
 * scatters them into `dstBlocks` of `dst` and checks every byte of every
 * destination region (untouched blocks must stay zero). `dst` must start
 * zeroed. Throws an Error naming the first differing byte.
 */
export async function runRoundTrip(
  ce: CopyEngine,
  g: Geometry,
  src: Region[],
  dst: Region[],
  srcBlocks: number[],
  dstBlocks: number[],
  opts: RoundTripOptions = {},
): Promise<void> {
  const base = opts.poolBase ?? 0;
  const path = opts.path ?? (ce.engine.backend === "host" ? "host" : "dma");
  const nseg = srcBlocks.length * g.numLayers * g.numSegs;
  const batch = new CopyBatch(g.numLayers, Math.max(1, nseg));
  const build = (regions: Region[], blocks: number[], dir: "d2h" | "h2d") => {
    batch.reset(dir, path);
    for (let l = 0; l < g.numLayers; l++) {
      batch.group(regions[g.layers[l].regionIndex], l);
      for (let i = 0; i < blocks.length; i++) {
        for (let s = 0; s < g.numSegs; s++) {
          batch.seg(addr(g, blocks[i], l, s), base + poolOff(g, i, l, s), g.segBytes);
        }
      }
    }
    return batch;
  };
  const total = nseg * g.segBytes;

  const gather = ce.submit(build(src, srcBlocks, "d2h"));
  const layers: number[] = [];
  gather.layers$.subscribe((l) => layers.push(l));
  const r1 = await gather.done;
  if (r1.status !== 0) throw new Error(`gather failed with status ${r1.status}`);
  if (r1.bytes !== total) throw new Error(`gather moved ${r1.bytes} bytes; expected ${total}`);
  if (r1.path !== path) throw new Error(`gather reported path ${r1.path}; it carried ${path}`);
  const wantLayers = Array.from({ length: g.numLayers }, (_, i) => i);
  if (layers.join() !== wantLayers.join()) {
    throw new Error(`gather reported layers [${layers}]; expected [${wantLayers}]`);
  }
  const pool = ce.pool.view(base, total);
  const want = expectedPool(g, srcBlocks);
  const d = firstDiff(pool, want);
  if (d >= 0) throw new Error(`${g.kind}: pool byte ${d} is ${pool[d]}; expected ${want[d]}`);

  const scatter = ce.submit(build(dst, dstBlocks, "h2d"));
  const r2 = await scatter.done;
  if (r2.status !== 0) throw new Error(`scatter failed with status ${r2.status}`);
  if (r2.bytes !== total) throw new Error(`scatter moved ${r2.bytes} bytes; expected ${total}`);
  if (r2.path !== path) throw new Error(`scatter reported path ${r2.path}; it carried ${path}`);
  const images = expectedRegions(g, srcBlocks, dstBlocks);
  for (let r = 0; r < dst.length; r++) {
    const got = dst[r].read(0, g.regionBytes[r]);
    const e = firstDiff(got, images[r]);
    if (e >= 0) {
      throw new Error(
        `${g.kind}: destination region ${r} byte ${e} is ${got[e]}; expected ${images[r][e]}`,
      );
    }
  }
}
