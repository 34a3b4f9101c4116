/**
 * Composition of the block index for the server: builds the index from the
 * flags, its metrics, and the advertiser that the server's seal and evict
 * hooks feed. lib/server/server.ts calls {@link openBlockIndex} only when
 * `--index-redis` is given; nothing here touches the store or the engine.
 *
 * @module
 */

import type { Registry } from "prom-client";
import type { Logger } from "../log.ts";
import { IndexAdvertiser } from "./advertiser.ts";
import { RedisBlockIndex } from "./block_index.ts";
import { type IndexConfig, nodeIdentity } from "./flags.ts";
import { registerIndexMetrics } from "./metrics.ts";
import type { TierHost } from "../storage/tier.ts";
import { blockKey } from "../storage/keys.ts";

/**
 * The advertiser the server's seal and evict hooks feed (made before the
 * store, which takes the evict hook at construction). A namespace whose
 * blocks the index refuses is logged once.
 */
export function indexAdvertiser(log: Logger): IndexAdvertiser {
  return new IndexAdvertiser((namespace, e) =>
    log.error("block index refused this namespace's blocks; they stay local", {
      component: "index",
      namespace,
      error: e.message,
    })
  );
}

/** A started index and the advertiser the server's hooks call. */
export interface BlockIndexHandle {
  index: RedisBlockIndex;
  advertiser: IndexAdvertiser;
  close(): Promise<void>;
}

/**
 * Starts the index for this node (connects in the background; never throws
 * for an unreachable Redis — it logs once and keeps trying).
 *
 * @example
 * ```ts
 * const idx = cfg.index.redisUrl ? openBlockIndex(cfg.index, grpcAddr, log, metrics.registry) : undefined;
 * ```
 */
export function openBlockIndex(
  cfg: IndexConfig & { redisUrl: string },
  grpcAddr: string,
  log: Logger,
  registry: Registry,
  advertiser?: IndexAdvertiser,
): BlockIndexHandle {
  const { nodeId, advertiseAddr } = nodeIdentity(cfg, grpcAddr);
  const ilog = log.child({ component: "index" });
  advertiser ??= indexAdvertiser(log);
  const index = new RedisBlockIndex({
    url: cfg.redisUrl,
    cluster: cfg.redisCluster,
    tlsCa: cfg.tlsCa,
    nodeId,
    advertiseAddr,
    timeoutMs: cfg.timeoutMs,
    nodeTtlMs: cfg.nodeTtlMs,
    listSealed: () => advertiser.listSealed(),
    isHeld: (ns, hash) => advertiser.holds(ns, hash),
    log: ilog,
    metrics: registerIndexMetrics(registry),
  });
  advertiser.connect(index);
  index.start();
  ilog.info("block index started", { node: nodeId, advertise_addr: advertiseAddr });
  return { index, advertiser, close: () => index.close() };
}

/**
 * `host` with every committed fill advertised: a block a tier brought into
 * RAM (SSD prefetch, peer fetch) is held here like a saved one, so peers may
 * fetch it from this node too; its eviction withdraws it through the store's
 * `onEvict` as for any block. (The engine's `onSealed` only sees saves.)
 * A `fill` is advertised at its commit when that sealed it (a discard may
 * have doomed it meanwhile); `fillMany`'s blocks when the tier announces
 * them (`committed`, once per fetch).
 *
 * @example
 * ```ts
 * const tierHost = advertiser ? advertisedFills(storeTierHost(store), advertiser) : storeTierHost(store);
 * ```
 */
export function advertisedFills(host: TierHost, advertiser: IndexAdvertiser): TierHost {
  return {
    ...host,
    // A fetch commits its batches as they land and announces them once, at its end:
    // one advertise per fetch, not one per batch.
    committed(namespace, hashes) {
      // Only those still held: a block evicted since its commit was not held when its
      // eviction came (nothing was withdrawn), and advertising it now would list it for good.
      const held = host.committed(namespace, hashes);
      if (held.length > 0) {
        // Array.from, not `.map`: optimized `.map` returns a HOLEY array, which deopts
        // onSealed, optimized on the save path's packed keys (docs/server.md).
        advertiser.onSealed(namespace, Array.from(held, (h) => blockKey(namespace, h)));
      }
      return held;
    },
    fill(namespace, hash, filler, cacheClass) {
      const f = host.fill(namespace, hash, filler, cacheClass);
      if (!f) return null;
      return {
        extents: f.extents,
        payloadBytes: f.payloadBytes,
        abort: f.abort,
        commit: () => {
          f.commit();
          // Only if it sealed: a discard that named the block during the read freed it at
          // this commit (lib/storage/discard.ts), and no eviction would ever withdraw it.
          if (host.committed(namespace, [hash]).length > 0) {
            advertiser.onSealed(namespace, [blockKey(namespace, hash)]);
          }
        },
      };
    },
  };
}
