/**
 * The identity of a namespace's block layout: how a block's bytes are cut
 * into (layer, rank slot, segment) pieces. Two layouts with the same bytes
 * per block (TP 1 and TP 2, 8 layers × 2 segments and 16 × 1, ...) read each
 * other's blocks as garbage, so whatever keeps blocks beyond one process's
 * memory (the SSD tier) stores this identity with them and serves a block
 * only to the layout that wrote it.
 *
 * This module is the one owner of the rule: callers describe the layout
 * ({@link LayoutDescription}, layers in slot order) and everything that
 * compares layouts compares {@link layoutIdentity}'s fingerprint. A change of
 * how slots are ordered (e.g. layer ids in registration order instead of
 * sorted names) changes only the description the engine builds.
 *
 * @module
 */

import { createHash } from "node:crypto";
import type { BlockLayout } from "./block.ts";

/** Version of the canonical text below; bump it if the text changes (old records then miss). */
const FINGERPRINT_TEXT_VERSION = 1;
/** Hex characters of a fingerprint: 128 bits of SHA-256 (stored as 16 bytes in SSD records). */
export const LAYOUT_FINGERPRINT_HEX = 32;

/** One layer of a block, as the engine registered it. */
export interface LayerDescription {
  name: string;
  /** Bytes of one segment (K or V, or the whole slot for MLA / cross-layer) on one rank. */
  segBytes: number;
  numSegments: number;
}

/** Everything that decides how a block's bytes are cut. */
export interface LayoutDescription {
  tpSize: number;
  ppSize: number;
  /** MLA: one rank slot for every TP rank. */
  collapseTp: boolean;
  /** Every layer of the block (all PP stages), in slot order (layer id 0 first). */
  layers: readonly LayerDescription[];
}

/** A layout's fingerprint and a short human description of it (for logs and errors). */
export interface LayoutIdentity {
  /** {@link LAYOUT_FINGERPRINT_HEX} lowercase hex characters. */
  fingerprint: string;
  /** E.g. `tp_size 1, pp_size 1, 32 layers × 2 segments × 32768 B`. */
  summary: string;
}

/**
 * The identity of a layout: a SHA-256 over a fixed-order text of TP and PP
 * size, TP collapse, layer count and, per layer in slot order, its name,
 * segment bytes and segment count.
 *
 * @example
 * ```ts
 * const id = layoutIdentity({ tpSize: 1, ppSize: 1, collapseTp: false,
 *   layers: [{ name: "l0", segBytes: 32768, numSegments: 2 }] });
 * id.fingerprint; // 32 hex chars, the same in every process and after restarts
 * ```
 */
export function layoutIdentity(d: LayoutDescription): LayoutIdentity {
  let text = `pegaflow-layout/${FINGERPRINT_TEXT_VERSION}\ntp=${d.tpSize}\npp=${d.ppSize}\n` +
    `collapse_tp=${d.collapseTp ? 1 : 0}\nlayers=${d.layers.length}\n`;
  for (let i = 0; i < d.layers.length; i++) {
    const l = d.layers[i];
    // JSON-quoted names: a name holding a tab or newline cannot forge another layer's line.
    text += `${i}\t${JSON.stringify(l.name)}\t${l.segBytes}\t${l.numSegments}\n`;
  }
  const fingerprint = createHash("sha256").update(text).digest("hex").slice(
    0,
    LAYOUT_FINGERPRINT_HEX,
  );
  return { fingerprint, summary: summarize(d) };
}

function summarize(d: LayoutDescription): string {
  const head = `tp_size ${d.tpSize}, pp_size ${d.ppSize}${d.collapseTp ? " (TP collapsed)" : ""}`;
  const shapes = new Set(d.layers.map((l) => `${l.numSegments} segments × ${l.segBytes} B`));
  if (shapes.size === 1) return `${head}, ${d.layers.length} layers × ${[...shapes][0]}`;
  return `${head}, ${d.layers.length} layers of ${shapes.size} shapes (${[...shapes].join(", ")})`;
}

/**
 * The identity of a store namespace: the one the engine defined it with, or
 * (a store used without an engine: tests, tools) one derived from the block
 * geometry alone, layers named by their ids.
 */
export function blockLayoutIdentity(layout: BlockLayout): LayoutIdentity {
  if (layout.identity) return layout.identity;
  const layers = Array.from({ length: layout.layers }, (_, i) => ({
    name: String(i),
    segBytes: layout.segmentBytes,
    numSegments: layout.segments,
  }));
  return layoutIdentity({
    tpSize: layout.tpSize,
    ppSize: 1,
    collapseTp: layout.collapseTp,
    layers,
  });
}
