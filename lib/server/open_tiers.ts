/**
 * The tiers below RAM as the server opens them (SSD when configured, then
 * the peer tier, behind one LowerTiers), and what an SSD io engine that
 * still holds the pinned pool means for freeing it: the pool and the
 * completion ring are then left to process exit ({@link closeNative}).
 *
 * @module
 */
import type { CopyEngine } from "../../ffi/mod.ts";
import type { NativePort } from "../engine/ports.ts";
import type { Logger } from "../log.ts";
import type { KvStore } from "../storage/store.ts";
import type { IndexAdvertiser } from "../index/advertiser.ts";
import { advertisedFills } from "../index/attach.ts";
import { SsdOpenError, SsdOpenStalledError, SsdTier } from "../ssd/tier.ts";
import { SsdStorageTier } from "../ssd/ssd_tier_port.ts";
import { registerSsdMetrics } from "../ssd/metrics.ts";
import { discardEverywhere, LowerTiers } from "../storage/lower_tiers.ts";
import { storeTierHost } from "../storage/tier_host.ts";
import type { ServeConfig } from "./config.ts";
import type { ServerMetrics } from "./metrics.ts";
import { registerTierMetrics } from "./tier_metrics.ts";
import { type CrossNode, openCrossNode } from "./cross_node.ts";

/** What openNative gives: the engine's native port and the copy engine under it. */
export type OpenedNative = NativePort & { copyEngine: CopyEngine };

/**
 * An SSD io engine that may still hold the pool and the completion ring
 * (a close that gave up, an open abandoned on a stalled disk): what it
 * waits on, or undefined once it is closed.
 */
export interface EngineHold {
  stillOpen(): string | undefined;
}

/**
 * The tiers below RAM, wired once through the Tier port: SSD when configured,
 * then the peer tier. The engine hands them sealed blocks (write-behind) and
 * asks them on a RAM miss, SSD first. A failure closes what this opened and
 * goes up (the caller frees the storage).
 *
 * @example
 * ```ts
 * const { cross, tiers } = await openLowerTiers(cfg, native, store, advertiser, metrics, log, holds);
 * ```
 */
export async function openLowerTiers(
  cfg: ServeConfig,
  native: OpenedNative,
  store: KvStore,
  advertiser: IndexAdvertiser | undefined,
  metrics: ServerMetrics,
  log: Logger,
  ssdHold: EngineHold[],
): Promise<{ cross: CrossNode; tiers: LowerTiers | undefined }> {
  // Not starting at all beats serving beside another server's cache file.
  const ssd = await openSsdTier(cfg, native, metrics, log, ssdHold);
  // Blocks the tiers bring into RAM are advertised like saved ones.
  const tierHost = advertiser
    ? advertisedFills(storeTierHost(store), advertiser)
    : storeTierHost(store);
  // A block a peer read damaged and that fails its checksum here leaves RAM and every tier below
  // (opened after the cross-node pieces: the peer tier is one of them).
  const below: { tiers?: LowerTiers } = {};
  const condemn = (namespace: string, hashes: readonly Uint8Array[]) =>
    void discardEverywhere(store, below.tiers, {
      namespace,
      instance: "peer-report",
      rank: 0,
      hashes,
    });
  let cross: CrossNode;
  try {
    cross = openCrossNode(cfg, native, { store, tierHost, condemn }, advertiser, metrics, log);
  } catch (e) {
    // An explicit transport that cannot open, or a bad --nics: refuse to start.
    await ssd?.close();
    throw e;
  }
  const lower = [
    ...(ssd ? [new SsdStorageTier(ssd, tierHost, log.child({ tier: "ssd" }))] : []),
    ...(cross.peerTier ? [cross.peerTier] : []),
  ];
  const tiers = below.tiers = lower.length > 0
    ? new LowerTiers({
      ram: store,
      tiers: lower,
      stageMetrics: (stage) => metrics.stage(stage),
      log: log.child({ component: "tier.admit" }),
    })
    : undefined;
  if (tiers) registerTierMetrics(metrics.registry, tiers);
  return { cross, tiers };
}

/**
 * Frees the pool, the completion ring and the engines, unless an SSD io
 * engine is still open: the kernel may still read or fill pool pages of its
 * io and it posts to the ring, so both are left to process exit then
 * (pf_ring_destroy and pf_pool_destroy would refuse with PF_EBUSY anyway,
 * and the stop threw that instead of ending), logged with what it waits on.
 *
 * @example
 * ```ts
 * await closeNative(native, holds, log); // at stop, or unwinding a failed start
 * ```
 */
export async function closeNative(
  native: OpenedNative,
  holds: readonly EngineHold[],
  log: Logger,
): Promise<void> {
  const open = holds.map((h) => h.stillOpen()).filter((w) => w !== undefined);
  if (open.length === 0) return await native.close();
  log.error(
    "pinned pool and completion ring left to process exit: the SSD tier has not finished " +
      `closing, and while its engine is open they may still be in use (${open.join("; ")})`,
    { ssd_engines_open: open.length },
  );
}

/**
 * The SSD tier when `--ssd-cache-path` names files; undefined without, or
 * when it cannot open for a reason the RAM tier can serve without (logged,
 * naming the path). Throws for one it must not serve beside (another server
 * holds the cache file).
 */
async function openSsdTier(
  cfg: ServeConfig,
  native: { copyEngine: CopyEngine },
  metrics: ServerMetrics,
  log: Logger,
  holds: EngineHold[],
): Promise<SsdTier | undefined> {
  if (cfg.ssd.paths.length === 0) return undefined;
  try {
    const ssd = await SsdTier.open({
      ...cfg.ssd,
      pool: native.copyEngine.pool.handle,
      ring: native.copyEngine.ring,
      log: log.child({ tier: "ssd" }),
      stageMetrics: (stage) => metrics.stage(stage),
    });
    holds.push(ssd);
    registerSsdMetrics(metrics.registry, () => ssd.stats());
    log.info("SSD tier ready", {
      paths: ssd.files.map((f) => f.path).join(","),
      capacity_bytes: ssd.stats().capacityBytes,
      recovered_blocks: ssd.recovery.blocks,
    });
    return ssd;
  } catch (e) {
    if (!(e instanceof SsdOpenError)) throw e; // e.g. SsdLockedError
    // A stalled open's engine closes once the kernel completes its io: until then it holds the pool.
    if (e instanceof SsdOpenStalledError) holds.push(e);
    log.error("SSD tier disabled", { error: e.message });
    return undefined;
  }
}
