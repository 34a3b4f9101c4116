// Shared fixtures for the storage tests: a fake clock, hash names and a
// one-call save that plans, "copies" and completes.
import { ok as assert } from "node:assert/strict";
import type { BlockLayout } from "../../lib/storage/block.ts";
import {
  KvStore,
  type KvStoreOptions,
  type SaveCompletion,
  type SavePlan,
} from "../../lib/storage/store.ts";

export const NS = "0123456789abcdef";
/** Two layers, K/V split, 4 KiB segments: 16 KiB of pool per block. */
export const SMALL: BlockLayout = {
  layers: 2,
  tpSize: 1,
  collapseTp: false,
  segments: 2,
  segmentBytes: 4096,
};
export const BLOCK_BYTES = 2 * 2 * 4096;

/** A controllable millisecond clock. */
export class FakeClock {
  now = 1_000_000;
  read = (): number => this.now;
  tick(ms: number): void {
    this.now += ms;
  }
}

/** Hash of block i, as the hex the engine's bytes become. */
export function h(i: number): string {
  return i.toString(16).padStart(16, "0");
}

/** Hashes of blocks [from, to). */
export function hs(from: number, to: number): string[] {
  return Array.from({ length: to - from }, (_, k) => h(from + k));
}

/** A store with one namespace defined. */
export function makeStore(
  blocks: number,
  opts: Partial<KvStoreOptions> = {},
  layout: BlockLayout = SMALL,
): { store: KvStore; clock: FakeClock } {
  const clock = new FakeClock();
  const perBlock = layout.layers * (layout.collapseTp ? 1 : layout.tpSize) * layout.segments *
    Math.ceil(layout.segmentBytes / 4096) * 4096;
  const store = new KvStore({ capacityBytes: blocks * perBlock, clock: clock.read, ...opts });
  store.defineNamespace(NS, layout);
  return { store, clock };
}

/** Plans and completes a save; returns the plan and what completion did. */
export function save(
  store: KvStore,
  hashes: string[],
  o: { rank?: number; instance?: string; layers?: number[]; ok?: boolean } = {},
): { plan: SavePlan; done: SaveCompletion } {
  const b = store.beginSave({
    namespace: NS,
    instance: o.instance ?? "eng",
    rank: o.rank ?? 0,
    hashes,
    layers: o.layers,
  });
  assert(b.ok, b.ok ? "" : b.error.message);
  return { plan: b.plan, done: store.completeSave(b.plan, o.ok ?? true) };
}
