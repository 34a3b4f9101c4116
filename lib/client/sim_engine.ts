/**
 * A simulated inference engine: registers a model-shaped paged KV cache with
 * the server, fills blocks with bytes derived from (hash, layer, rank,
 * segment), saves them, queries, loads them into DIFFERENT block ids and
 * verifies every byte. The KV lives where a real engine's would: host shm on
 * the host backend, GPU memory (exported by CUDA IPC) on the cuda backend.
 *
 * Layout per layer: FlashAttention's KV-first tensor
 * `[2][num_blocks][block_tokens][kv_heads / tp][head_dim]`, i.e. a K plane
 * then a V plane, so
 * `block_stride = seg_bytes`, `seg_stride = num_blocks * seg_bytes`, 2 segments.
 *
 * MLA (`mla: true`): one latent plane per layer, `[num_blocks][block_tokens]
 * [kv_heads][head_dim]`, 1 segment, NOT split by TP: every TP rank holds the
 * same bytes (the content seed ignores the rank), and the rank registers
 * with `kv_shared_across_tp` so the server stores each block once.
 *
 * @module
 */
import { Engine, type Region } from "../../ffi/mod.ts";
import type { PegaflowClient, QueryResult } from "./client.ts";
import { LoadState } from "./load_state.ts";
import { STATE_OK } from "../engine/load_state.ts";

/** The shape that sizes a KV block. */
export interface ModelShape {
  name: string;
  numLayers: number;
  kvHeads: number;
  headDim: number;
  dtypeBytes: number;
  blockTokens: number;
}

/** Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16, 16-token blocks → 32 KiB per K (or V) per layer per block. */
export const LLAMA_3_1_8B: ModelShape = {
  name: "llama-3.1-8b",
  numLayers: 32,
  kvHeads: 8,
  headDim: 128,
  dtypeBytes: 2,
  blockTokens: 16,
};

/** K and V. */
const KV_SEGMENTS = 2;
/** Odd multiplier that spreads consecutive word indexes (golden ratio, 32-bit). */
const WORD_STEP = 0x9e3779b1;

/** Options of {@link SimEngine.create}. */
export interface SimEngineOptions {
  client: PegaflowClient;
  instanceId: string;
  namespace: string;
  model?: ModelShape;
  /** Paged-KV blocks per layer on this rank. */
  numBlocks: number;
  tpRank?: number;
  tpSize?: number;
  /** Pipeline stage of this rank; a stage holds `numLayers / ppSize` consecutive layers. */
  ppRank?: number;
  ppSize?: number;
  backend?: "auto" | "cuda" | "host";
  /** The device this rank registers as its own (host backend: any id the server serves). */
  device?: number;
  /** MLA layout: one segment per block, identical on every TP rank (see the module comment). */
  mla?: boolean;
  /**
   * The engine incarnation this rank belongs to (RegisterContextRequest.engine_id): give every
   * rank of one simulated engine the same one. Its saves, queries and loads send it too (the
   * server refuses another engine's). Default "" (not checked by the server).
   */
  engineId?: string;
}

/** Seed of one segment's content: FNV-1a over the hash, mixed with layer, rank and segment. */
function segSeed(hash: Uint8Array, layer: number, rank: number, seg: number): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < hash.length; i++) h = Math.imul(h ^ hash[i], 0x01000193);
  h = Math.imul(h ^ layer, 0x01000193);
  h = Math.imul(h ^ (rank + 0x100), 0x01000193);
  h = Math.imul(h ^ (seg + 0x10000), 0x01000193);
  return h >>> 0;
}

/** The model's layer indexes pipeline stage `ppRank` of `ppSize` holds (consecutive, equal shares). */
function stageLayers(numLayers: number, ppRank: number, ppSize: number): number[] {
  if (!Number.isInteger(ppRank) || ppRank < 0 || ppRank >= ppSize) {
    // A stage past the last would name layers the model does not have.
    throw new RangeError(`pp_rank ${ppRank} is not a stage of pp_size ${ppSize}`);
  }
  if (numLayers % ppSize !== 0) {
    throw new Error(`num_layers ${numLayers} not divisible by pp_size ${ppSize}`);
  }
  const n = numLayers / ppSize;
  return Array.from({ length: n }, (_, i) => ppRank * n + i);
}

/** Fills `dst` (u32-aligned length) with the content of one segment. */
export function fillSegment(dst: Uint32Array, seed: number): void {
  let x = seed;
  for (let i = 0; i < dst.length; i++) {
    dst[i] = x;
    x = (x + WORD_STEP) >>> 0;
  }
}

function runs(ids: number[]): [number, number, number][] {
  // [first id, count, index of first id in `ids`] for runs of consecutive ids.
  const out: [number, number, number][] = [];
  for (let i = 0; i < ids.length;) {
    let j = i + 1;
    while (j < ids.length && ids[j] === ids[j - 1] + 1) j++;
    out.push([ids[i], j - i, i]);
    i = j;
  }
  return out;
}

/**
 * One rank of a simulated engine.
 *
 * @example
 * ```ts
 * const sim = SimEngine.create({ client, instanceId: "sim-0", namespace: "llama", numBlocks: 256 });
 * await sim.register();
 * sim.fill(ids, hashes); await sim.save(ids, hashes);
 * const q = await sim.query(hashes, "req-1");
 * await sim.load(q.leaseId, otherIds);
 * sim.verify(otherIds, hashes); // { badSegments: 0 } when every byte arrived
 * await sim.close();
 * ```
 */
export class SimEngine {
  readonly client: PegaflowClient;
  readonly instanceId: string;
  readonly namespace: string;
  readonly model: ModelShape;
  readonly numBlocks: number;
  readonly tpRank: number;
  readonly tpSize: number;
  readonly ppRank: number;
  readonly ppSize: number;
  /** The model's layer indexes this rank (its pipeline stage) holds, in order. */
  readonly layers: number[];
  /** MLA: one segment, the same bytes on every TP rank. */
  readonly mla: boolean;
  /** What RegisterContext sends as engine_id ("" = none). */
  readonly engineId: string;
  /** Segments per block and layer: 2 (K, V), 1 for MLA. */
  readonly segments: number;
  /** Bytes of one K (or V, or MLA latent) of one block of one layer on this rank. */
  readonly segBytes: number;
  readonly layerNames: string[];
  readonly engine: Engine;
  readonly regions: Region[];
  /** Created at the first load (an engine that never loads owns no load-state shm). */
  #loadState: LoadState | undefined;

  private constructor(o: SimEngineOptions, engine: Engine, regions: Region[], segBytes: number) {
    this.client = o.client;
    this.instanceId = o.instanceId;
    this.namespace = o.namespace;
    this.model = o.model ?? LLAMA_3_1_8B;
    this.numBlocks = o.numBlocks;
    this.tpRank = o.tpRank ?? 0;
    this.tpSize = o.tpSize ?? 1;
    this.ppRank = o.ppRank ?? 0;
    this.ppSize = o.ppSize ?? 1;
    this.layers = stageLayers(this.model.numLayers, this.ppRank, this.ppSize);
    this.mla = o.mla ?? false;
    this.engineId = o.engineId ?? "";
    this.segments = this.mla ? 1 : KV_SEGMENTS;
    this.segBytes = segBytes;
    this.engine = engine;
    this.regions = regions;
    this.layerNames = this.layers.map((i) => `model.layers.${String(i).padStart(3, "0")}.attn`);
  }

  /** Allocates the KV cache (one region per layer). */
  static create(o: SimEngineOptions): SimEngine {
    const model = o.model ?? LLAMA_3_1_8B;
    const tpSize = o.tpSize ?? 1;
    // MLA's latent KV is not split across TP ranks.
    const split = o.mla ? 1 : tpSize;
    if (model.kvHeads % split !== 0) {
      throw new Error(`kv_heads ${model.kvHeads} not divisible by tp_size ${tpSize}`);
    }
    const tpRank = o.tpRank ?? 0;
    if (!Number.isInteger(tpRank) || tpRank < 0 || tpRank >= tpSize) {
      throw new RangeError(`tp_rank ${tpRank} is not a rank of tp_size ${tpSize}`);
    }
    const segBytes = model.blockTokens * (model.kvHeads / split) * model.headDim *
      model.dtypeBytes;
    if (segBytes % 4 !== 0) {
      // fill and verify work in u32 words: the bytes past the last whole word
      // would be neither written nor checked, and verify would pass unchecked bytes.
      throw new RangeError(
        `model ${model.name}: a segment of ${segBytes} bytes is not a multiple of 4 ` +
          `(block_tokens ${model.blockTokens} x kv_heads/tp ${model.kvHeads / split} x ` +
          `head_dim ${model.headDim} x dtype ${model.dtypeBytes} B)`,
      );
    }
    const segments = o.mla ? 1 : KV_SEGMENTS;
    // Checked before the engine opens: a throw after it would leak the engine.
    const numLayers = stageLayers(model.numLayers, o.ppRank ?? 0, o.ppSize ?? 1).length;
    const engine = Engine.open({ backend: o.backend ?? "auto", device: o.device ?? 0 });
    const regions: Region[] = [];
    try {
      for (let l = 0; l < numLayers; l++) {
        regions.push(engine.allocRegion(segments * o.numBlocks * segBytes));
      }
    } catch (e) {
      for (const r of regions) r.close();
      engine.close();
      throw e;
    }
    return new SimEngine(o, engine, regions, segBytes);
  }

  /** One hash per block id: a shorter list would leave blocks without content to compare. */
  #checkPairs(what: string, ids: number[], hashes: Uint8Array[]): void {
    if (ids.length !== hashes.length) {
      throw new RangeError(
        `${this.instanceId} rank ${this.tpRank}/${this.ppRank}: ${what} of ${ids.length} block ids ` +
          `with ${hashes.length} hashes (one hash per block)`,
      );
    }
  }

  /** The rank the content seed uses: MLA content is the same on every rank. */
  get #contentRank(): number {
    return this.mla ? 0 : this.tpRank;
  }

  /** Bytes of one block across all layers and segments on this rank. */
  get blockBytes(): number {
    return this.segBytes * this.segments * this.layers.length;
  }

  /** Registers all layers of this rank with the server. */
  register(overrides: Partial<Parameters<PegaflowClient["registerContext"]>[0]> = {}) {
    return this.client.registerContext({ ...this.registration(), ...overrides });
  }

  /**
   * What this rank registers (every layer's region and geometry), as the
   * RegisterContext request without its client version: for the server, or
   * for a `KvEngine` driven in-process (benches, pipeline tests).
   */
  registration() {
    const planeBytes = this.numBlocks * this.segBytes;
    return {
      instanceId: this.instanceId,
      namespace: this.namespace,
      tpRank: this.tpRank,
      tpSize: this.tpSize,
      ppRank: this.ppRank,
      ppSize: this.ppSize,
      worldSize: this.tpSize * this.ppSize,
      deviceId: this.engine.device,
      layerNames: this.layerNames,
      regionHandles: this.regions.map((r) => r.handle),
      geometry: this.regions.map(() => ({
        numBlocks: this.numBlocks,
        blockStride: this.segBytes,
        segStride: planeBytes,
        segBytes: this.segBytes,
        numSegments: this.segments,
        baseOffset: 0,
        regionBytes: this.segments * planeBytes,
      })),
      kvSharedAcrossTp: this.mla,
      engineId: this.engineId,
    };
  }

  /** Writes the expected content of `hashes[i]` into block `ids[i]` of every layer. */
  fill(ids: number[], hashes: Uint8Array[]): void {
    this.#checkPairs("fill", ids, hashes);
    const words = this.segBytes / 4;
    for (let l = 0; l < this.layers.length; l++) {
      for (let s = 0; s < this.segments; s++) {
        for (const [first, count, at] of runs(ids)) {
          const buf = new Uint32Array(words * count);
          for (let k = 0; k < count; k++) {
            fillSegment(
              buf.subarray(k * words, (k + 1) * words),
              segSeed(hashes[at + k], this.layers[l], this.#contentRank, s),
            );
          }
          this.regions[l].write(
            s * this.numBlocks * this.segBytes + first * this.segBytes,
            new Uint8Array(buf.buffer),
          );
        }
      }
    }
  }

  /** Zeroes the given blocks in every layer (so a verify after load proves the load wrote them). */
  clear(ids: number[]): void {
    for (let l = 0; l < this.layers.length; l++) {
      for (let s = 0; s < this.segments; s++) {
        for (const [first, count] of runs(ids)) {
          this.regions[l].write(
            s * this.numBlocks * this.segBytes + first * this.segBytes,
            new Uint8Array(count * this.segBytes),
          );
        }
      }
    }
  }

  /**
   * Checks every byte of blocks `ids` against the content of `hashes`.
   * Returns the number of wrong segments and a description of the first.
   */
  verify(ids: number[], hashes: Uint8Array[]): { badSegments: number; first?: string } {
    this.#checkPairs("verify", ids, hashes);
    const words = this.segBytes / 4;
    const want = new Uint32Array(words);
    let bad = 0;
    let first: string | undefined;
    for (let l = 0; l < this.layers.length; l++) {
      for (let s = 0; s < this.segments; s++) {
        for (const [firstId, count, at] of runs(ids)) {
          const got = this.regions[l].read(
            s * this.numBlocks * this.segBytes + firstId * this.segBytes,
            count * this.segBytes,
          );
          const got32 = new Uint32Array(got.buffer, got.byteOffset, got.byteLength / 4);
          for (let k = 0; k < count; k++) {
            fillSegment(want, segSeed(hashes[at + k], this.layers[l], this.#contentRank, s));
            const g = got32.subarray(k * words, (k + 1) * words);
            for (let w = 0; w < words; w++) {
              if (g[w] !== want[w]) {
                bad++;
                first ??= `layer ${this.layers[l]} segment ${s} block ${
                  firstId + k
                } word ${w}: got 0x${g[w].toString(16)}, want 0x${want[w].toString(16)}`;
                break;
              }
            }
          }
        }
      }
    }
    return { badSegments: bad, first };
  }

  /**
   * One Save of every layer for these blocks: the all-layers shorthand by
   * default, or one list per layer with `perLayer`.
   */
  save(ids: number[], hashes: Uint8Array[], opts: { perLayer?: boolean } = {}) {
    if (opts.perLayer) {
      return this.client.save({
        instanceId: this.instanceId,
        tpRank: this.tpRank,
        ppRank: this.ppRank,
        layers: this.layerNames.map((layerName) => ({
          layerName,
          blockIds: ids,
          blockHashes: hashes,
        })),
        engineId: this.engineId,
      });
    }
    return this.client.save({
      instanceId: this.instanceId,
      tpRank: this.tpRank,
      ppRank: this.ppRank,
      blockIds: ids,
      blockHashes: hashes,
      engineId: this.engineId,
    });
  }

  query(hashes: Uint8Array[], requestId: string): Promise<QueryResult> {
    return this.client.queryPrefetch({
      instanceId: this.instanceId,
      blockHashes: hashes,
      requestId,
      engineId: this.engineId,
    });
  }

  /**
   * Loads the lease into `ids` and waits through the load state. Returns the
   * time until layer 0 was usable and until every layer was (ms, measured here).
   */
  async load(
    leaseId: Uint8Array,
    ids: number[],
    requestId = "",
  ): Promise<{ firstLayerMs: number; allMs: number; state: number }> {
    const st = this.#loadState ??= LoadState.create();
    st.rearm();
    const t0 = performance.now();
    await this.client.load({
      instanceId: this.instanceId,
      tpRank: this.tpRank,
      ppRank: this.ppRank,
      leaseId,
      blockIds: ids,
      loadStateShm: st.name,
      requestId,
      engineId: this.engineId,
    });
    await st.waitLayer(0);
    const firstLayerMs = performance.now() - t0;
    const state = await st.waitAll();
    const allMs = performance.now() - t0;
    if (state !== STATE_OK) {
      throw new Error(`load of ${ids.length} blocks ended with state ${state}`);
    }
    return { firstLayerMs, allMs, state };
  }

  /** Name of the load-state block this engine uses (after its first load). */
  get loadStateName(): string | undefined {
    return this.#loadState?.name;
  }

  /** Frees the KV cache (unregister first: the server must unmap before the memory goes). */
  close(): void {
    this.#loadState?.close();
    for (const r of this.regions) r.close();
    this.engine.close();
  }
}
