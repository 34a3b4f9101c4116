/**
 * What every rank of every instance sharing a namespace must agree on, and
 * who fixes it: TP/PP sizes, the block shape, and each PP stage's layer
 * names IN ORDER. The first registration of a stage fixes that stage's
 * order; later registrations of it (TP peers, other instances, the same
 * instance after a restart) must repeat it exactly.
 *
 * Why registration order and not sorted names: layer i of the load state is
 * ready once `layers_ready > i`, and the copy lands layers in id order. The
 * engine registers its layers in execution order, while a sort puts vLLM's
 * `model.layers.10` before `model.layers.2`, so layer 2 would wait for
 * layers 10–19. Ids must still agree across ranks, instances and nodes (a
 * block's slots are indexed by them): hence one order per namespace, and a
 * registration that disagrees is refused before anything is mapped.
 *
 * Global layer ids: the stages in pp_rank order, registration order within a
 * stage (each stage holds a contiguous run of the model's layers).
 *
 * **This module owns the namespace layout.** The store's block layout
 * ({@link blockLayoutOf}: layers, rank slots, segment shape) and the layout
 * fingerprint's input ({@link describeLayout}, hashed by
 * lib/storage/layout.ts) are both derived from the agreed
 * {@link NamespaceLayout}; the store's registry only checks that a
 * namespace keeps the layout it was first given.
 *
 * **TP collapse (MLA).** A registration that says `kv_shared_across_tp`
 * (every TP rank holds the same KV bytes) makes the layout store one rank
 * slot per layer instead of tp_size; every rank of the namespace must say
 * the same.
 *
 * @module
 */
import type { BlockLayout } from "../storage/block.ts";
import { type LayoutDescription, layoutIdentity } from "../storage/layout.ts";
import { invalid, precondition } from "./errors.ts";

/** The agreed layout of one namespace (engine-side; the store keeps the block shape). */
export interface NamespaceLayout {
  readonly namespace: string;
  readonly tpSize: number;
  readonly ppSize: number;
  readonly segBytes: number;
  readonly numSegments: number;
  /** Every TP rank holds the same KV (MLA): blocks keep one rank slot. */
  readonly kvSharedAcrossTp: boolean;
  /** Per PP stage: its layer names in registration order, once its first rank registered. */
  readonly stages: (readonly string[] | undefined)[];
  /** Instances registered under the namespace (sealed or not). */
  readonly users: Set<string>;
}

/** One rank's registration, as far as the namespace rule looks at it. */
export interface StageClaim {
  who: string;
  tpSize: number;
  ppSize: number;
  ppRank: number;
  layerNames: readonly string[];
  segBytes: number;
  numSegments: number;
  kvSharedAcrossTp: boolean;
}

/**
 * Throws unless `c` agrees with `layout`: FAILED_PRECONDITION for another
 * layout (sizes, block shape, or a stage's names / order), INVALID_ARGUMENT
 * for a layer another stage already holds. Pure: records nothing.
 *
 * @example
 * ```ts
 * checkStageClaim(layout, { who, tpSize: 2, ppSize: 1, ppRank: 0, layerNames, segBytes, numSegments: 2 });
 * ```
 */
export function checkStageClaim(layout: NamespaceLayout, c: StageClaim): void {
  const ns = layout.namespace;
  const other = "; use a namespace per layout";
  if (layout.tpSize !== c.tpSize || layout.ppSize !== c.ppSize) {
    throw precondition(
      `${c.who}: namespace "${ns}" already holds a layout with tp_size ${layout.tpSize} pp_size ${layout.ppSize}, got ${c.tpSize}/${c.ppSize}${other}`,
    );
  }
  if (layout.segBytes !== c.segBytes || layout.numSegments !== c.numSegments) {
    throw precondition(
      `${c.who}: namespace "${ns}" already holds a different layout: ${layout.numSegments} x ${layout.segBytes}-byte segments per layer and block there, got ${c.numSegments} x ${c.segBytes}${other}`,
    );
  }
  if (layout.kvSharedAcrossTp !== c.kvSharedAcrossTp) {
    const say = (v: boolean) => (v ? "true (KV stored once across TP)" : "false");
    throw precondition(
      `${c.who}: namespace "${ns}" already holds a layout with kv_shared_across_tp ${
        say(layout.kvSharedAcrossTp)
      }, got ${say(c.kvSharedAcrossTp)}${other}`,
    );
  }
  const fixed = layout.stages[c.ppRank];
  if (fixed) {
    const got = c.layerNames;
    const n = Math.max(fixed.length, got.length);
    for (let i = 0; i < n; i++) {
      if (fixed[i] === got[i]) continue;
      const show = (v: string | undefined) => (v === undefined ? "(none)" : `"${v}"`);
      throw precondition(
        `${c.who}: namespace "${ns}" already holds a different layout: pp stage ${c.ppRank} ` +
          `layer ${i} is ${show(fixed[i])} there, got ${show(got[i])} ` +
          `(${fixed.length} layers there, ${got.length} here); every rank and instance of a ` +
          `namespace lists layer_names in one order (the first registration fixed it)${other}`,
      );
    }
    return;
  }
  // A stage not seen yet: its layers must not belong to another stage.
  for (let pp = 0; pp < layout.stages.length; pp++) {
    const names = layout.stages[pp];
    if (!names || pp === c.ppRank) continue;
    const shared = c.layerNames.find((n) => names.includes(n));
    if (shared !== undefined) {
      throw invalid(`${c.who}: layer "${shared}" is also registered by pp_rank ${pp}`);
    }
  }
}

/** A fresh layout fixed by its first registration. */
export function newLayout(namespace: string, c: StageClaim): NamespaceLayout {
  const layout: NamespaceLayout = {
    namespace,
    tpSize: c.tpSize,
    ppSize: c.ppSize,
    segBytes: c.segBytes,
    numSegments: c.numSegments,
    kvSharedAcrossTp: c.kvSharedAcrossTp,
    stages: [],
    users: new Set(),
  };
  return layout;
}

/**
 * Fixes the stage's order if this is its first registration; returns true
 * when it did (so a registration rolled back later can unfix it).
 */
export function claimStage(layout: NamespaceLayout, c: StageClaim): boolean {
  if (layout.stages[c.ppRank]) return false;
  layout.stages[c.ppRank] = [...c.layerNames];
  return true;
}

/**
 * The namespace's global layer order (stages in pp_rank order), or null while
 * a stage has not registered yet.
 */
export function globalOrder(layout: NamespaceLayout): string[] | null {
  const out: string[] = [];
  for (let pp = 0; pp < layout.ppSize; pp++) {
    const names = layout.stages[pp];
    if (!names) return null;
    out.push(...names);
  }
  return out;
}

/**
 * How a namespace's blocks are cut, layers in slot (layer id) order: the
 * input of the layout fingerprint. Null while a stage has not registered.
 */
export function describeLayout(layout: NamespaceLayout): LayoutDescription | null {
  const order = globalOrder(layout);
  if (!order) return null;
  return {
    tpSize: layout.tpSize,
    ppSize: layout.ppSize,
    collapseTp: layout.kvSharedAcrossTp,
    layers: order.map((name) => ({
      name,
      segBytes: layout.segBytes,
      numSegments: layout.numSegments,
    })),
  };
}

/**
 * The store's block layout of a complete namespace layout (every stage
 * registered), with its identity (fingerprint) attached.
 *
 * @example
 * ```ts
 * store.defineNamespace(ns, blockLayoutOf(layout));
 * ```
 */
export function blockLayoutOf(layout: NamespaceLayout): BlockLayout {
  const d = describeLayout(layout);
  if (!d) throw new Error(`namespace "${layout.namespace}": a PP stage has not registered yet`);
  return {
    layers: d.layers.length,
    tpSize: layout.tpSize,
    collapseTp: layout.kvSharedAcrossTp,
    segments: layout.numSegments,
    segmentBytes: layout.segBytes,
    identity: layoutIdentity(d),
  };
}
