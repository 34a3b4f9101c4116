/**
 * The store's side of the block index: turns seal and evict events into
 * batched advertise / withdraw calls, and keeps the set of blocks this node
 * holds so the index can re-advertise them after an outage (`listSealed`).
 *
 * Events of one tick are coalesced per namespace and sent in a microtask:
 * a save's seal is one advertise; an eviction that frees 625 blocks one by
 * one (the store calls `onEvict` per block) is one withdraw. A block evicted
 * and sealed again within the tick cancels out instead of racing. Calls are
 * issued in event order on one connection, so Redis applies them in order.
 *
 * It listens through the hooks the server already has — `KvEngine.onSealed`
 * and `KvStore`'s `onEvict` option — and never calls back into the store.
 *
 * @module
 */

import type { SealedBlock } from "./block_index.ts";
import { hexBytes } from "./keys.ts";
import { hashHex } from "../storage/keys.ts";

/** What the advertiser needs from the index (a {@link RedisBlockIndex}). */
export interface AdvertisePort {
  advertise(namespace: string, hashes: readonly Uint8Array[]): Promise<boolean>;
  withdraw(namespace: string, hashes: readonly Uint8Array[]): Promise<boolean>;
}

/** Splits a store key `namespace:hex`. */
function hexOf(key: string): string {
  return key.slice(key.lastIndexOf(":") + 1);
}

/**
 * Store events → index calls.
 *
 * @example
 * ```ts
 * const adv = new IndexAdvertiser();
 * const index = new RedisBlockIndex({ ...opts, listSealed: () => adv.listSealed() });
 * adv.connect(index);
 * engine.onSealed((ns, keys) => adv.onSealed(ns, keys));
 * // KvStore({ onEvict: (ns, hash) => adv.onEvicted(ns, hash) })
 * ```
 */
export class IndexAdvertiser {
  /**
   * Called once per namespace with the first call the index refused as bad
   * input (e.g. an engine whose hashes are longer than 64 bytes): a
   * configuration problem to log, not an outage, and never an exception in
   * the store's or the engine's path.
   */
  readonly #onRefused: (namespace: string, e: Error) => void;
  readonly #refusedNamespaces = new Set<string>();
  /** namespace → hex → hash bytes, of every sealed block held now. */
  readonly #held = new Map<string, Map<string, Uint8Array>>();
  readonly #toAdvertise = new Map<string, Set<string>>();
  readonly #toWithdraw = new Map<string, Set<string>>();
  #port: AdvertisePort | undefined;
  #scheduled = false;

  constructor(onRefused: (namespace: string, e: Error) => void = () => {}) {
    this.#onRefused = onRefused;
  }

  /** Starts sending to `port` (events before this only update the held set). */
  connect(port: AdvertisePort): void {
    this.#port = port;
  }

  /** Blocks a save (or fill) just sealed; keys are the store's `namespace:hex`. */
  onSealed(namespace: string, keys: readonly string[]): void {
    if (keys.length === 0) return;
    let held = this.#held.get(namespace);
    if (!held) this.#held.set(namespace, held = new Map());
    for (const key of keys) {
      const hex = hexOf(key);
      if (!held.has(hex)) held.set(hex, hexBytes(hex));
      if (!this.#toWithdraw.get(namespace)?.delete(hex)) add(this.#toAdvertise, namespace, hex);
    }
    this.#schedule();
  }

  /** One evicted block (the store's `onEvict`: namespace and hash hex). */
  onEvicted(namespace: string, hashHex: string): void {
    const held = this.#held.get(namespace);
    if (!held?.delete(hashHex)) return;
    if (held.size === 0) this.#held.delete(namespace);
    if (!this.#toAdvertise.get(namespace)?.delete(hashHex)) {
      add(this.#toWithdraw, namespace, hashHex);
    }
    this.#schedule();
  }

  /** Every block held now (the index's `listSealed`). */
  *listSealed(): Iterable<SealedBlock> {
    for (const [namespace, held] of this.#held) {
      for (const hash of held.values()) yield { namespace, hash };
    }
  }

  /** Whether `hash` of `namespace` is held now (the index's `isHeld`). */
  holds(namespace: string, hash: Uint8Array): boolean {
    return this.#held.get(namespace)?.has(hashHex(hash)) ?? false;
  }

  /** Blocks held now. */
  get held(): number {
    let n = 0;
    for (const m of this.#held.values()) n += m.size;
    return n;
  }

  #schedule(): void {
    if (this.#scheduled) return;
    this.#scheduled = true;
    queueMicrotask(() => this.#flush());
  }

  #flush(): void {
    this.#scheduled = false;
    const port = this.#port;
    const wd = [...this.#toWithdraw];
    const adv = [...this.#toAdvertise];
    this.#toWithdraw.clear();
    this.#toAdvertise.clear();
    // Unconnected: nothing to send; the first connection re-advertises the held set.
    if (!port) return;
    // Outcomes need no handling here: the index counts failures and re-advertises on recovery.
    for (const [ns, hexes] of wd) {
      // Array.from, not `[...hexes].map`: optimized `.map` returns a HOLEY array, and
      // packHashes, shared with every fetch's lookup, then turns the fetch's packed hash
      // arrays holey in place: each function on the fetch path deopts (docs/server.md).
      if (hexes.size > 0) this.#send(ns, () => port.withdraw(ns, Array.from(hexes, hexBytes)));
    }
    for (const [ns, hexes] of adv) {
      const held = this.#held.get(ns);
      const list: Uint8Array[] = [];
      for (const hex of hexes) {
        const h = held?.get(hex);
        if (h) list.push(h);
      }
      if (list.length > 0) this.#send(ns, () => port.advertise(ns, list));
    }
  }

  /** Runs one index call; an outage resolves false inside the index, only bad input rejects. */
  #send(ns: string, call: () => Promise<boolean>): void {
    const refused = (e: unknown) => {
      if (this.#refusedNamespaces.has(ns)) return;
      this.#refusedNamespaces.add(ns);
      this.#onRefused(ns, e as Error);
    };
    try {
      call().catch(refused);
    } catch (e) {
      refused(e);
    }
  }
}

function add(m: Map<string, Set<string>>, ns: string, hex: string): void {
  let s = m.get(ns);
  if (!s) m.set(ns, s = new Set());
  s.add(hex);
}
