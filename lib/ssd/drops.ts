/**
 * A discard's drop, made durable: which keys have a write queued or running
 * (the writer marks them), and what a drop does to a key: its index entry
 * goes at once, a pad is written over its record (pads.ts) so a restart does
 * not index it again, a write of it still queued is not written, and one in
 * flight is padded over when it lands (the writer asks {@link PendingWrite}).
 *
 * A later save of the key is a new write with its own mark and a higher seq:
 * neither the drop nor its pad touches it.
 *
 * @module
 */

import type { SsdIndex } from "./index.ts";
import type { PadSite, SsdPads } from "./pads.ts";
import type { Logger } from "../log.ts";

/**
 * One block's write, queued or running: `dropped` once a discard named it
 * (not written if still queued, padded over if it lands).
 */
export interface PendingWrite {
  dropped: boolean;
}

/**
 * The writes per key and the drops that reach them and the index.
 *
 * @example
 * ```ts
 * const drops = new SsdDrops(index, pads, log, (ended) => pending.add(ended));
 * const m = drops.mark(key); // a write of key queued
 * drops.drop([key]);         // m.dropped: not written, or padded over when it lands
 * drops.unmark([block], [m]); // the write ended
 * ```
 */
export class SsdDrops {
  /** Key → its newest write queued or running (one of a key dropped meanwhile may be older). */
  readonly #pending = new Map<string, PendingWrite>();
  readonly #index: SsdIndex;
  readonly #pads: SsdPads;
  readonly #log: Logger;
  readonly #track: (ended: Promise<unknown>) => void;
  #closed = false;

  /** `track`: hands each drop's pads to what the writer's flush and close wait for. */
  constructor(
    index: SsdIndex,
    pads: SsdPads,
    log: Logger,
    track: (ended: Promise<unknown>) => void,
  ) {
    this.#index = index;
    this.#pads = pads;
    this.#log = log;
    this.#track = track;
  }

  /** True while a write of `key` is queued or running and no drop named it since. */
  writing(key: string): boolean {
    return this.#pending.get(key)?.dropped === false;
  }

  /** Marks a new write of `key` (it replaces an older one as the key's newest). */
  mark(key: string): PendingWrite {
    const m = { dropped: false };
    this.#pending.set(key, m);
    return m;
  }

  /** Forgets the ended writes `marks` of `blocks` (a newer write of a key keeps its own). */
  unmark(blocks: readonly { key: string }[], marks: readonly PendingWrite[]): void {
    for (let i = 0; i < blocks.length; i++) {
      if (this.#pending.get(blocks[i].key) === marks[i]) this.#pending.delete(blocks[i].key);
    }
  }

  /**
   * Forgets `keys`, durably: unindexed now, and a pad written over each
   * record (its segment held from reuse until the pad and the files' sync
   * ended); a write of one queued or running is marked dropped. Never waits.
   * Returns the blocks the index held. After {@link close}, in memory only
   * (logged: those records come back at a restart).
   */
  drop(keys: readonly string[]): number {
    const sites: PadSite[] = [];
    for (const key of keys) {
      const m = this.#pending.get(key);
      if (m) m.dropped = true;
      const loc = this.#index.get(key);
      if (!loc) continue;
      this.#index.remove(key);
      const { segment: seg, fileOffset: off, payloadBytes: bytes, seq, namespace } = loc;
      sites.push({ block: { key, namespace }, seg, off, bytes, seq });
    }
    if (sites.length === 0) return 0;
    if (this.#closed) {
      this.#log.warn("SSD drop after close: not padded, indexed again at a restart", {
        ...this.#pads.site(sites[0]),
        blocks: sites.length,
      });
      return sites.length;
    }
    // A pad written into a refilled segment would land in another record.
    for (const s of sites) s.seg.inflightWrites++;
    this.#track(
      this.#pads.dropped(sites).finally(() => {
        for (const s of sites) s.seg.inflightWrites--;
      }),
    );
    return sites.length;
  }

  /** Later drops write no pad (the writer's io ended: the engine is closing). */
  close(): void {
    this.#closed = true;
  }
}
