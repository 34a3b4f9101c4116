/**
 * What the engine's modules (register.ts, save.ts, load.ts) share: the
 * ports they run over and the engine's two registries. `KvEngine`
 * (engine.ts) builds one and hands it to each module.
 *
 * @module
 */
import type { Logger } from "../log.ts";
import type { StageMetrics } from "../pipeline/stage.ts";
import type { LayoutIdentity } from "../storage/layout.ts";
import type { KvStore } from "../storage/store.ts";
import type { Instance } from "./instances.ts";
import type { NamespaceLayout } from "./namespaces.ts";
import type { NativePort, RegionPort } from "./ports.ts";

/** Hooks the engine reports through (prom-client implements them in lib/server/metrics.ts). */
export interface EngineMetrics {
  /** `device`: the saving (loading) rank's device, so one failing device shows alone. */
  saveDone(bytes: number, seconds: number, blocks: number, device: number): void;
  saveFailed(reason: string, device: number): void;
  loadDone(bytes: number, seconds: number, ok: boolean, device: number): void;
  queryDone(requested: number, hits: number): void;
  stage(name: string): StageMetrics;
}

/**
 * The tiers below RAM (implemented by lib/storage/lower_tiers.ts over the
 * `Tier` port): sealed blocks are handed over for write-behind; a query whose
 * prefix continues in a tier starts (or polls) a fetch and is answered
 * "loading"; a registration is checked against the layouts the tiers hold
 * for its namespace (they outlive a restart, RAM does not).
 */
export interface TiersPort {
  /** Blocks a save just sealed (the engine's hash bytes). Never waits. */
  sealed(namespace: string, hashes: readonly Uint8Array[]): unknown;
  /** Discarded blocks: every tier forgets them (in memory, never waits); returns how many. */
  drop(namespace: string, hashes: readonly Uint8Array[]): number;
  /** Layouts the tiers hold blocks of under `namespace`, with block counts and where. */
  storedLayouts(namespace: string): readonly (LayoutIdentity & { blocks: number; where: string })[];
  /** True: answer "loading" (a fetch for this request id is running). */
  beforeQuery(
    namespace: string,
    instance: string,
    hashes: Uint8Array[],
    requestId: string,
  ): boolean;
  /** Resolves once no fetch of `requestId` of `instance` runs; undefined when none runs now. */
  settled(instance: string, requestId: string): Promise<void> | undefined;
}

/** The engine's ports and registries, shared by its modules. */
export interface EngineContext {
  readonly native: NativePort;
  readonly store: KvStore;
  readonly log: Logger;
  readonly metrics: EngineMetrics | undefined;
  readonly tiers: TiersPort | undefined;
  /** Registered instances by id. */
  readonly instances: Map<string, Instance>;
  /** namespace → its agreed layout and the instances using it (namespaces.ts owns the rule). */
  readonly layouts: Map<string, NamespaceLayout>;
  /** The pool part (NUMA node, lib/numa.ts) a device's saves allocate in; undefined = any. */
  readonly poolPartOf?: (device: number) => number | undefined;
}

/** Closes regions best effort (nothing targets them), logging a native failure. */
export function closeRegions(ctx: EngineContext, regions: RegionPort[], who: string): void {
  for (const r of regions) {
    try {
      r.close();
    } catch (e) {
      // A region with no copies failing to close is a native bug worth logging.
      ctx.log.error("closing region failed", { who, error: (e as Error).message });
    }
  }
}

/** Rounds milliseconds to microseconds, for log fields. */
export function round3(ms: number): number {
  return Math.round(ms * 1e3) / 1e3;
}
