/**
 * Engines' load states, kept mapped between loads. An engine reuses its load
 * states (the connector keeps a free list), and mapping one (shm_open, fstat,
 * mmap, and munmap at the end) cost ~0.1 ms of a warm request's path before
 * its copy starts, per rank: a TP-8 query-and-load opens eight. A kept
 * mapping is reused only while its name still names the same object, as long
 * as it was (one stat, `ShmPort.same`); an instance's kept mappings are closed
 * when it goes.
 *
 * It also knows which loads hold a load state now (accepted, not yet ended),
 * by the owner tag the server writes into the block's header: a Load of
 * another instance naming a block held so is refused without a byte written
 * (load.ts), since its refusal or progress would land in that engine's load.
 *
 * @module
 */
import type { Logger } from "../log.ts";
import type { ShmPort } from "./ports.ts";

/** Idle mappings kept per instance (its ranks' free load states); beyond, the oldest is closed. */
export const KEPT_LOAD_STATES_PER_INSTANCE = 128;

interface Kept {
  shm: ShmPort;
  bytes: number;
}

/** The load states loads map, by instance; one per engine (the load runner's). */
export class LoadStateMaps {
  /** instance → name → an idle mapping (a Map keeps insertion order: the first is the oldest). */
  readonly #kept = new Map<string, Map<string, Kept>>();
  /** `${owner tag}:${name}` → accepted loads of that owner holding that load state now. */
  readonly #busy = new Map<string, number>();

  constructor(
    readonly open: (name: string, bytes: number) => ShmPort,
    /** True while `instance` is registered: a load that ends after it went closes its mapping. */
    readonly live: (instance: string) => boolean,
    readonly log: Logger,
  ) {}

  /** A mapping of `name` for one load of `instance`: a kept one that still maps it, else a new one. */
  acquire(instance: string, name: string, bytes: number): ShmPort {
    const kept = this.#kept.get(instance);
    const k = kept?.get(name);
    if (k) {
      kept!.delete(name);
      if (k.bytes === bytes && k.shm.same()) return k.shm;
      this.#close(k.shm, name);
    }
    return this.open(name, bytes);
  }

  /** The load is done with `shm`: kept for the instance's next load, or closed. */
  release(instance: string, name: string, bytes: number, shm: ShmPort): void {
    if (!this.live(instance)) {
      this.forget(instance);
      this.#close(shm, name);
      return;
    }
    let kept = this.#kept.get(instance);
    if (!kept) this.#kept.set(instance, kept = new Map());
    if (kept.has(name)) {
      this.#close(shm, name); // two loads mapped it at once: one mapping is enough
      return;
    }
    kept.set(name, { shm, bytes });
    if (kept.size > KEPT_LOAD_STATES_PER_INSTANCE) {
      const [oldest, k] = kept.entries().next().value!;
      kept.delete(oldest);
      this.#close(k.shm, oldest);
    }
  }

  /** An accepted load of `owner` (its tag, load_state.ts) holds `name` until {@link end}. */
  begin(owner: number, name: string): void {
    const k = `${owner}:${name}`;
    this.#busy.set(k, (this.#busy.get(k) ?? 0) + 1);
  }

  /** That load ended (refused, abandoned or its copy completed): it no longer holds `name`. */
  end(owner: number, name: string): void {
    const k = `${owner}:${name}`;
    const n = (this.#busy.get(k) ?? 0) - 1;
    if (n > 0) this.#busy.set(k, n);
    else this.#busy.delete(k);
  }

  /** True while a load of `owner` holds `name`. */
  busy(owner: number, name: string): boolean {
    return this.#busy.has(`${owner}:${name}`);
  }

  /** Closes every mapping kept for `instance` (it unregistered or was cleaned up). */
  forget(instance: string): void {
    const kept = this.#kept.get(instance);
    if (!kept) return;
    this.#kept.delete(instance);
    for (const [name, k] of kept) this.#close(k.shm, name);
  }

  /** Mappings kept now, over every instance (tests, debugging). */
  get size(): number {
    let n = 0;
    for (const kept of this.#kept.values()) n += kept.size;
    return n;
  }

  #close(shm: ShmPort, name: string): void {
    try {
      shm.close();
    } catch (e) {
      // Only after the batch's completion record, when the native layer has
      // dropped its reference: a failure here is a bug worth a log line.
      this.log.error("closing load state failed", { shm: name, error: (e as Error).message });
    }
  }
}
