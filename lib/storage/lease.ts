/**
 * Leases: a query that hits pins its blocks under a lease so they survive
 * until every rank of the engine has loaded them. A lease has a 16-byte
 * random id, a TTL, the instance it is bound to and a consume budget of
 * `consumers` (the engine's world size): each rank consumes once. It ends
 * when every rank consumed it, when it is released, when it expires, or when
 * its instance unregisters. The table only does the bookkeeping; the store
 * pins and unpins the blocks of the leases this table hands back.
 *
 * Leases all share one TTL, so insertion order is expiry order and expiry
 * scans only the old end of the Map.
 *
 * @module
 */

import { LeaseError } from "./errors.ts";
import { hashHex } from "./keys.ts";
import { LEASE_ID_BYTES } from "../limits.ts";
import { monotonicNow } from "../clock.ts";

/** Default lease lifetime: long enough for a slow engine step, short enough to bound a leak. */
export const DEFAULT_LEASE_TTL_MS = 600_000;

/** A lease over items of type B (blocks, for the store). */
export interface Lease<B> {
  /** Lower-case hex of {@link Lease.idBytes}; the Map key. */
  readonly id: string;
  /** The 16 random bytes the engine gets. */
  readonly idBytes: Uint8Array;
  readonly instance: string;
  readonly namespace: string;
  readonly blocks: readonly B[];
  /** Consumes allowed (the engine's world size). */
  readonly consumers: number;
  /** Ranks that consumed it. */
  readonly consumed: Set<number>;
  readonly expiresAt: number;
}

/** Construction options of a {@link LeaseTable}. */
export interface LeaseTableOptions {
  /** Lifetime in ms. Default {@link DEFAULT_LEASE_TTL_MS}. */
  ttlMs?: number;
  /** Milliseconds now. Default `monotonicNow` (lib/clock.ts). */
  clock?: () => number;
  /** Source of random id bytes. Default `crypto.getRandomValues`. */
  randomBytes?: (n: number) => Uint8Array;
  /** Noun used in error messages ("lease", "transfer lock"). */
  noun?: string;
}

/** A lease id as the engine sends it (bytes) or as hex. */
export type LeaseId = Uint8Array | string;

/**
 * Lease bookkeeping: create, consume per rank, release, expire, drop by instance.
 *
 * @example
 * ```ts
 * const t = new LeaseTable<string>({ ttlMs: 1000 });
 * const l = t.create("engine-a", "ns", ["k1"], 2);
 * t.consume(l.id, "engine-a", 0); // { lease, last: false }
 * t.consume(l.id, "engine-a", 1); // { lease, last: true } — gone from the table
 * ```
 */
export class LeaseTable<B> {
  readonly ttlMs: number;
  readonly #clock: () => number;
  readonly #random: (n: number) => Uint8Array;
  readonly #noun: string;
  readonly #leases = new Map<string, Lease<B>>();

  constructor(opts: LeaseTableOptions = {}) {
    this.ttlMs = opts.ttlMs ?? DEFAULT_LEASE_TTL_MS;
    if (!(this.ttlMs > 0)) throw new RangeError(`lease TTL must be > 0 ms, got ${this.ttlMs}`);
    this.#clock = opts.clock ?? monotonicNow;
    this.#random = opts.randomBytes ??
      ((n) => crypto.getRandomValues(new Uint8Array(n)));
    this.#noun = opts.noun ?? "lease";
  }

  /** Live leases (expired ones not yet swept included). */
  get size(): number {
    return this.#leases.size;
  }

  /** Creates a lease with a fresh random id. */
  create(instance: string, namespace: string, blocks: readonly B[], consumers: number): Lease<B> {
    if (!Number.isSafeInteger(consumers) || consumers < 1) {
      throw new RangeError(`${this.#noun} consumers must be an integer ≥ 1, got ${consumers}`);
    }
    let idBytes: Uint8Array;
    let id: string;
    do {
      idBytes = this.#random(LEASE_ID_BYTES);
      id = hashHex(idBytes);
    } while (this.#leases.has(id));
    const lease: Lease<B> = {
      id,
      idBytes,
      instance,
      namespace,
      blocks,
      consumers,
      consumed: new Set(),
      expiresAt: this.#clock() + this.ttlMs,
    };
    this.#leases.set(id, lease);
    return lease;
  }

  /**
   * Consumes the lease for `rank`. Returns it with `last: true` when this was
   * the final consume (the lease is then removed; the caller unpins).
   * Throws {@link LeaseError}: unknown or expired, another instance's, rank
   * out of range, or this rank already consumed it. `validate`, when given,
   * runs after those checks and before the consume is recorded.
   */
  consume(
    id: LeaseId,
    instance: string,
    rank: number,
    validate?: (lease: Lease<B>) => void,
  ): { lease: Lease<B>; last: boolean } {
    const lease = this.#live(id, instance, rank);
    if (lease.instance !== instance) {
      throw new LeaseError(
        "wrong-instance",
        `${this.#noun} ${lease.id} belongs to instance ${lease.instance}, not ${instance}`,
        { lease: lease.id, instance, rank, expected: lease.instance, got: instance },
      );
    }
    if (!Number.isSafeInteger(rank) || rank < 0 || rank >= lease.consumers) {
      throw new LeaseError(
        "rank-out-of-range",
        `${this.#noun} ${lease.id}: rank ${rank} is outside 0..${
          lease.consumers - 1
        } (world size ${lease.consumers})`,
        { lease: lease.id, instance, rank, expected: `0..${lease.consumers - 1}`, got: rank },
      );
    }
    if (lease.consumed.has(rank)) {
      throw new LeaseError(
        "rank-already-consumed",
        `${this.#noun} ${lease.id} was already consumed by rank ${rank} of instance ${instance}`,
        { lease: lease.id, instance, rank },
      );
    }
    validate?.(lease); // a caller's check that throws leaves the consume unspent
    lease.consumed.add(rank);
    const last = lease.consumed.size === lease.consumers;
    if (last) this.#leases.delete(lease.id);
    return { lease, last };
  }

  /** Removes a live lease and returns it; throws {@link LeaseError} when unknown or expired. */
  release(id: LeaseId): Lease<B> {
    const lease = this.#live(id);
    this.#leases.delete(lease.id);
    return lease;
  }

  /** Removes and returns every lease past its expiry. */
  expire(): Lease<B>[] {
    const now = this.#clock();
    const out: Lease<B>[] = [];
    for (const lease of this.#leases.values()) {
      if (lease.expiresAt > now) break; // one TTL for all: the rest are younger
      out.push(lease);
    }
    for (const l of out) this.#leases.delete(l.id);
    return out;
  }

  /** Removes and returns every lease bound to `instance`. */
  dropInstance(instance: string): Lease<B>[] {
    const out: Lease<B>[] = [];
    for (const lease of this.#leases.values()) if (lease.instance === instance) out.push(lease);
    for (const l of out) this.#leases.delete(l.id);
    return out;
  }

  /** Every live lease (for teardown and tests). */
  all(): IterableIterator<Lease<B>> {
    return this.#leases.values();
  }

  #live(id: LeaseId, instance?: string, rank?: number): Lease<B> {
    // A malformed id (wrong length, not hex) is simply unknown: no lookup, same error.
    const hex = typeof id === "string"
      ? id.toLowerCase()
      : id.length === LEASE_ID_BYTES
      ? hashHex(id)
      : "";
    const lease = hex.length === 2 * LEASE_ID_BYTES ? this.#leases.get(hex) : undefined;
    if (!lease || lease.expiresAt <= this.#clock()) {
      throw new LeaseError(
        "unknown-or-expired",
        `${this.#noun} ${hex || "(malformed id)"} is unknown or expired; query again`,
        { lease: hex, instance, rank },
      );
    }
    return lease;
  }
}
