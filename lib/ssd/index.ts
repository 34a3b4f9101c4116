/**
 * The SSD tier's index: block key → where its record lies. Lives in memory,
 * rebuilt from the record headers at start (see recovery.ts); the segment
 * ring drops a segment's keys when it reuses the segment.
 *
 * @module
 */

import type { Segment } from "./space.ts";
import type { StoredLayout } from "../storage/tier.ts";

/** Where one block's record lies on disk. */
export interface SsdLocation {
  segment: Segment;
  /** Absolute offset of the record's header page in its file. */
  fileOffset: number;
  payloadBytes: number;
  payloadCrc: number;
  seq: number;
  /** Namespace of the block. */
  namespace: string;
  /** Layout fingerprint the block was written with (lib/storage/layout.ts). */
  layout: string;
}

/**
 * Key → location, newest sequence number wins.
 *
 * @example
 * ```ts
 * const index = new SsdIndex();
 * index.put("ns/ab12", loc);
 * index.prefixLength(["ns/ab12", "ns/cd34"], loc.layout); // 1
 * ```
 */
export class SsdIndex {
  readonly #map = new Map<string, SsdLocation>();
  /** namespace → layout fingerprint → blocks held (what a restart must still refuse). */
  readonly #layouts = new Map<string, Map<string, StoredLayout>>();
  #bytes = 0;

  #count(loc: SsdLocation, delta: number, summary = ""): void {
    let byFp = this.#layouts.get(loc.namespace);
    if (!byFp) this.#layouts.set(loc.namespace, byFp = new Map());
    let l = byFp.get(loc.layout);
    if (!l) byFp.set(loc.layout, l = { fingerprint: loc.layout, summary, blocks: 0 });
    l.blocks += delta;
    if (l.blocks === 0) {
      byFp.delete(loc.layout);
      if (byFp.size === 0) this.#layouts.delete(loc.namespace);
    }
  }

  /** The layouts `namespace`'s blocks were written with, and how many blocks each holds. */
  layoutsOf(namespace: string): StoredLayout[] {
    return [...(this.#layouts.get(namespace)?.values() ?? [])].map((l) => ({ ...l }));
  }

  /** Blocks indexed. */
  get size(): number {
    return this.#map.size;
  }

  /** Payload bytes indexed. */
  get payloadBytes(): number {
    return this.#bytes;
  }

  /** The location of `key`, if held. */
  get(key: string): SsdLocation | undefined {
    return this.#map.get(key);
  }

  /** True when `key` is held. */
  has(key: string): boolean {
    return this.#map.has(key);
  }

  /**
   * Indexes `key` at `loc` unless a newer record of it is indexed. Returns
   * whether it took. `layoutSummary` describes `loc.layout` (kept once per
   * namespace and layout, for refusal messages).
   */
  put(key: string, loc: SsdLocation, layoutSummary = ""): boolean {
    const old = this.#map.get(key);
    if (old) {
      if (old.seq >= loc.seq) return false;
      old.segment.keys.delete(key);
      this.#bytes -= old.payloadBytes;
      this.#count(old, -1);
    }
    this.#map.set(key, loc);
    loc.segment.keys.add(key);
    this.#bytes += loc.payloadBytes;
    this.#count(loc, 1, layoutSummary);
    return true;
  }

  /** Forgets `key` if it is still at `loc` (a read found the record bad or overwritten). */
  remove(key: string, loc?: SsdLocation): void {
    const cur = this.#map.get(key);
    if (!cur || (loc && cur !== loc)) return;
    this.#map.delete(key);
    cur.segment.keys.delete(key);
    this.#bytes -= cur.payloadBytes;
    this.#count(cur, -1);
  }

  /** Drops every key whose record is in `seg` (the ring is about to overwrite it). */
  dropSegment(seg: Segment): number {
    let n = 0;
    for (const key of seg.keys) {
      const cur = this.#map.get(key);
      if (cur && cur.segment === seg) {
        this.#map.delete(key);
        this.#bytes -= cur.payloadBytes;
        this.#count(cur, -1);
        n++;
      }
    }
    seg.keys.clear();
    return n;
  }

  /**
   * How many of `keys`, from the first, are held with layout `layout` (the
   * longest contiguous prefix that layout may read).
   */
  prefixLength(keys: readonly string[], layout: string): number {
    let n = 0;
    while (n < keys.length && this.#map.get(keys[n])?.layout === layout) n++;
    return n;
  }
}
