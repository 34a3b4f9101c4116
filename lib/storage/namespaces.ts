/**
 * The store's namespace registry: each namespace's block layout (fixed by
 * its first definition, refused when another layout claims it), its pool
 * geometry (item stride, block bytes), its hash-bucket seed, and the block
 * records it recycles. The engine defines namespaces (lib/engine/register.ts)
 * from the layout it agreed with every rank; this registry only checks that
 * a namespace keeps one layout.
 *
 * @module
 */

import type { PoolAllocator } from "./allocator.ts";
import { type Block, type BlockLayout, rankSlots, validateLayout } from "./block.ts";
import { fnv1a32 } from "./cache.ts";
import { InvalidArgumentError, LayoutMismatchError } from "./errors.ts";

/**
 * Freed block records kept per namespace for reuse: enough for several
 * 625-block saves evicting as many blocks, a few MiB at most.
 */
export const SPARE_BLOCK_RECORDS = 4096;
/**
 * Block records per offset slab. A slab lives while any of its records does;
 * records are recycled, so a slab's worth is the most that can be stranded.
 */
const OFFSET_SLAB_RECORDS = 256;

/** One defined namespace. */
export interface NamespaceState {
  readonly layout: BlockLayout;
  readonly rankSlots: number;
  /** Pool bytes one item really takes (segment rounded up to the unit). */
  readonly strideBytes: number;
  readonly blockBytes: number;
  /** Seed of this namespace's hash buckets (the same content hash in two namespaces lands apart). */
  readonly seed: number;
  /** Freed block records kept for reuse (at most {@link SPARE_BLOCK_RECORDS}). */
  readonly spare: Block[];
  /** Where new block records' offsets are cut from ({@link OFFSET_SLAB_RECORDS} per slab). */
  readonly slab: { buf: Float64Array; used: number };
}

/**
 * Namespaces by name.
 *
 * @example
 * ```ts
 * const reg = new NamespaceRegistry(allocator);
 * reg.define("ns", { layers: 32, tpSize: 1, collapseTp: false, segments: 2, segmentBytes: 32768 });
 * reg.require("ns").blockBytes; // 2 MiB
 * ```
 */
export class NamespaceRegistry {
  readonly #byName = new Map<string, NamespaceState>();

  constructor(readonly allocator: PoolAllocator) {}

  /**
   * Declares a namespace's layout. Idempotent for the same layout; another
   * layout under the same name throws {@link LayoutMismatchError}.
   */
  define(namespace: string, layout: BlockLayout): void {
    if (typeof namespace !== "string" || namespace.length === 0 || namespace.includes(":")) {
      throw new InvalidArgumentError(`namespace must be a non-empty string without ':'`, {
        namespace: String(namespace),
      });
    }
    validateLayout(namespace, layout);
    const have = this.#byName.get(namespace);
    if (have) {
      for (const f of ["layers", "tpSize", "collapseTp", "segments", "segmentBytes"] as const) {
        if (have.layout[f] !== layout[f]) {
          throw new LayoutMismatchError(namespace, f, String(have.layout[f]), String(layout[f]));
        }
      }
      const a = have.layout.identity, b = layout.identity;
      if (a && b && a.fingerprint !== b.fingerprint) {
        throw new LayoutMismatchError(
          namespace,
          "layout",
          `${a.summary} (fingerprint ${a.fingerprint})`,
          `${b.summary} (fingerprint ${b.fingerprint})`,
        );
      }
      have.layout.identity ??= b;
      return;
    }
    const stride = this.allocator.strideOf(layout.segmentBytes);
    const slots = rankSlots(layout);
    this.#byName.set(namespace, {
      layout: { ...layout },
      rankSlots: slots,
      strideBytes: stride,
      blockBytes: layout.layers * slots * layout.segments * stride,
      seed: fnv1a32(namespace),
      spare: [],
      slab: { buf: new Float64Array(0), used: 0 },
    });
  }

  /** The namespace, or undefined when never defined. */
  get(namespace: string): NamespaceState | undefined {
    return this.#byName.get(namespace);
  }

  /** The namespace; throws INVALID_ARGUMENT (naming the instance) when undefined. */
  require(namespace: string, instance?: string): NamespaceState {
    const s = this.#byName.get(namespace);
    if (!s) {
      throw new InvalidArgumentError(
        `namespace ${namespace} has no layout: register the engine before saving or loading`,
        { namespace, instance },
      );
    }
    return s;
  }

  /**
   * Offset storage for a new block record, cut from the namespace's current slab:
   * the records of blocks created together sit side by side in memory, so a load
   * walking 625 of them streams through a few slabs instead of chasing 625
   * separately allocated buffers (cold after a 1.3 GB copy went through the caches).
   */
  offsetRecord(ns: NamespaceState): Float64Array {
    const len = ns.layout.layers * ns.rankSlots * ns.layout.segments;
    if (ns.slab.used + len > ns.slab.buf.length) {
      ns.slab.buf = new Float64Array(len * OFFSET_SLAB_RECORDS);
      ns.slab.used = 0;
    }
    const r = ns.slab.buf.subarray(ns.slab.used, ns.slab.used + len);
    ns.slab.used += len;
    return r;
  }

  /** Keeps a freed record (no slots, pins or links left) for the next new block. */
  recycle(b: Block): void {
    const spare = this.require(b.namespace).spare;
    if (spare.length < SPARE_BLOCK_RECORDS) spare.push(b);
  }
}
