/**
 * The SSD tier's index: block key → where its record lies. Lives in memory,
 * rebuilt from the record headers at start (see recovery.ts); the segment
 * ring drops a segment's keys when it reuses the segment.
 *
 * @module
 */

import type { Segment } from "./space.ts";

/** Where one block's record lies on disk. */
export interface SsdLocation {
  segment: Segment;
  /** Absolute offset of the record's header page in its file. */
  fileOffset: number;
  payloadBytes: number;
  payloadCrc: number;
  seq: number;
}

/**
 * Key → location, newest sequence number wins.
 *
 * @example
 * ```ts
 * const index = new SsdIndex();
 * index.put("ns/ab12", loc);
 * index.prefixLength(["ns/ab12", "ns/cd34"]); // 1
 * ```
 */
export class SsdIndex {
  readonly #map = new Map<string, SsdLocation>();
  #bytes = 0;

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

  /** Indexes `key` at `loc` unless a newer record of it is indexed. Returns whether it took. */
  put(key: string, loc: SsdLocation): boolean {
    const old = this.#map.get(key);
    if (old) {
      if (old.seq >= loc.seq) return false;
      old.segment.keys.delete(key);
      this.#bytes -= old.payloadBytes;
    }
    this.#map.set(key, loc);
    loc.segment.keys.add(key);
    this.#bytes += loc.payloadBytes;
    return true;
  }

  /** Forgets `key` if it is still at `loc` (a read found the record bad or overwritten). */
  remove(key: string, loc?: SsdLocation): void {
    const cur = this.#map.get(key);
    if (!cur || (loc && cur !== loc)) return;
    this.#map.delete(key);
    cur.segment.keys.delete(key);
    this.#bytes -= cur.payloadBytes;
  }

  /** Drops every key whose record is in `seg` (the ring is about to overwrite it). */
  dropSegment(seg: Segment): number {
    let n = 0;
    for (const key of seg.keys) {
      const cur = this.#map.get(key);
      if (cur && cur.segment === seg) {
        this.#map.delete(key);
        this.#bytes -= cur.payloadBytes;
        n++;
      }
    }
    seg.keys.clear();
    return n;
  }

  /** How many of `keys`, from the first, are held (the longest contiguous prefix). */
  prefixLength(keys: readonly string[]): number {
    let n = 0;
    while (n < keys.length && this.#map.has(keys[n])) n++;
    return n;
  }
}
