/**
 * The SSD tier behind the {@link Tier} port: the port's namespace + hash
 * blocks become record keys once (`blockKey`, the key every record header
 * stores; never split again), writes pin their batch through
 * {@link TierHost.pin} (one transfer lock per batch, taken when the write
 * starts), and prefetched blocks are planned with {@link TierHost.fill}
 * (`beginFill`, one whole block per plan, committed the moment the record
 * verifies).
 *
 * @module
 */

import { blockKey } from "../storage/keys.ts";
import {
  type RamFill,
  type StoredLayout,
  type Tier,
  type TierBlocks,
  type TierHealth,
  tierHolder,
  type TierHost,
  type TierPrefetchAnswer,
  type TierPutResult,
  type TierTakeAnswer,
} from "../storage/tier.ts";
import type { PrefetchAllocation } from "./prefetch.ts";
import type { SsdTier } from "./tier.ts";
import type { SsdPinned, SsdWriteBlock } from "./write_behind.ts";
import { errorText, type Logger } from "../log.ts";

/** Name of the SSD tier: metric label and hit attribution; it holds blocks as `tierHolder(SSD_TIER_NAME)`. */
export const SSD_TIER_NAME = "ssd";

/** A write block that remembers its hash bytes (for pinning it in RAM). */
interface HashedWrite extends SsdWriteBlock {
  hash: Uint8Array;
}

function recordKeys(blocks: Pick<TierBlocks, "namespace" | "hashes">): string[] {
  return blocks.hashes.map((h) => blockKey(blocks.namespace, h));
}

/**
 * {@link Tier} over an open {@link SsdTier} and the pool's {@link TierHost}.
 *
 * @example
 * ```ts
 * const ssd = await SsdTier.open({ pool, ring, paths: ["/mnt/nvme0"] });
 * const tier = new SsdStorageTier(ssd, storeTierHost(store), log.child({ tier: "ssd" }));
 * tier.put({ namespace, hashes, layout });            // write-behind
 * tier.prefetch("req-1", { namespace, hashes, layout }); // { state: "loading" }
 * ```
 */
export class SsdStorageTier implements Tier {
  readonly name = SSD_TIER_NAME;
  readonly label = "SSD";

  constructor(
    readonly ssd: SsdTier,
    readonly host: TierHost,
    readonly log: Logger,
  ) {}

  has(blocks: TierBlocks): number {
    return this.ssd.lookupPrefix(recordKeys(blocks), blocks.layout.fingerprint);
  }

  put(blocks: TierBlocks): TierPutResult {
    const { namespace, hashes, layout } = blocks;
    const writes: HashedWrite[] = hashes.map((hash) => ({
      key: blockKey(namespace, hash),
      namespace,
      layout,
      hash,
    }));
    return this.ssd.enqueueWrite({
      blocks: writes,
      pin: (fresh): SsdPinned => {
        const pin = this.host.pin(namespace, fresh.map((w) => w.hash), tierHolder(this.name));
        if (!pin) return { extents: fresh.map(() => undefined), release: () => {} };
        return { extents: pin.blocks.map((b) => b?.extents), release: () => pin.release() };
      },
    });
  }

  prefetch(requestId: string, blocks: TierBlocks): TierPrefetchAnswer {
    // A fetch already under this id is polled with take(), never restarted.
    if (this.ssd.hasPrefetch(requestId)) return { state: "loading" };
    const { namespace, hashes, layout } = blocks;
    const blockBytes = this.host.payloadBytes(namespace);
    if (blockBytes === undefined) return { state: "miss", reason: "not-held" };
    const a = this.ssd.prefetch(requestId, recordKeys(blocks), (wanted) => {
      const out: PrefetchAllocation[] = [];
      for (const w of wanted) {
        if (w.payloadBytes !== blockBytes) {
          // The layout fingerprint matched, so this is a damaged index entry: never read it.
          this.log.warn("SSD block size differs from its namespace's blocks: not fetched", {
            block: w.key,
            namespace,
            bytes: w.payloadBytes,
            expected_bytes: blockBytes,
          });
          break;
        }
        let fill: RamFill | null;
        try {
          fill = this.host.fill(namespace, hashes[w.index], tierHolder(this.name), "retained");
        } catch (e) {
          // Planning refused (a store bug): the blocks planned before it are still read.
          this.log.error("SSD prefetch: planning pool space for a block failed; fetched up to it", {
            block: w.key,
            namespace,
            request: requestId,
            error: errorText(e),
          });
          break;
        }
        if (!fill) break;
        out.push({ extents: [...fill.extents], free: fill.abort, commit: fill.commit });
      }
      return out;
    }, layout.fingerprint);
    if (a.state === "miss") {
      return { state: "miss", reason: a.reason === "not-on-ssd" ? "not-held" : a.reason };
    }
    // A new request id never answers "ready" (only a poll does).
    return { state: "loading" };
  }

  take(requestId: string): TierTakeAnswer {
    return { state: this.ssd.poll(requestId) ?? "none" };
  }

  settled(requestId: string): Promise<void> | undefined {
    return this.ssd.settled(requestId);
  }

  drop(namespace: string, hashes: readonly Uint8Array[]): number {
    return this.ssd.drop(recordKeys({ namespace, hashes }));
  }

  storedLayouts(namespace: string): readonly StoredLayout[] {
    return this.ssd.storedLayouts(namespace);
  }

  health(): TierHealth {
    const u = this.ssd.usage();
    return {
      // A degraded SSD (stalled io, stall.ts) takes no work until that io completes.
      state: this.ssd.closed ? "closed" : this.ssd.degraded ? "degraded" : "up",
      capacityBytes: u.capacityBytes,
      usedBytes: u.indexBytes,
      blocks: u.indexBlocks,
    };
  }

  flush(): Promise<void> {
    return this.ssd.flushWrites();
  }

  close(): Promise<void> {
    return this.ssd.close();
  }
}
