/**
 * The peer tier's seal-time checksum stage: when blocks seal, their CRC32Cs
 * are computed (one native call per batch) and recorded on the blocks, so a
 * peer's lock (lib/peer/locks.ts) answers them without reading the bytes
 * again. The queue is bounded; a full one drops the batch and the lock
 * computes those checksums when asked.
 *
 * @module
 */

import { tierHolder, type TierHost } from "../storage/tier.ts";
import { Stage, type StageMetrics } from "../pipeline/stage.ts";
import type { PoolExtent } from "../transfer/ranges.ts";
import type { ChecksumFn } from "./locks.ts";

/** Depth of the seal-time checksum queue (sealed batches; a full queue drops, the lock computes). */
const CHECKSUM_QUEUE_DEPTH = 64;

interface ChecksumJob {
  namespace: string;
  hashes: readonly Uint8Array[];
}

/**
 * The bounded checksum stage over sealed batches.
 *
 * @example
 * ```ts
 * const sums = new SealChecksums(host, checksum);
 * if (!sums.submit(namespace, hashes)) console.log("dropped: the lock computes them");
 * await sums.flush();
 * ```
 */
export class SealChecksums {
  readonly #host: TierHost;
  readonly #checksum: ChecksumFn;
  readonly #stage: Stage<ChecksumJob, void>;
  readonly #pending = new Set<Promise<unknown>>();
  /** Checksums recorded after a seal. */
  recorded = 0;
  /** Batches the full queue dropped. */
  dropped = 0;

  constructor(host: TierHost, checksum: ChecksumFn, metrics?: StageMetrics) {
    this.#host = host;
    this.#checksum = checksum;
    this.#stage = new Stage<ChecksumJob, void>(
      "peer.checksum",
      {
        concurrency: 1,
        queue: { depth: CHECKSUM_QUEUE_DEPTH, policy: "drop-newest" },
        metrics,
      },
      (job) => this.#run(job),
    );
  }

  /** Queues a sealed batch; false when the full queue dropped it. Never waits. */
  submit(namespace: string, hashes: readonly Uint8Array[]): boolean {
    const sub = this.#stage.submit({ namespace, hashes });
    if (sub.status !== "accepted") {
      this.dropped++;
      return false;
    }
    const ended = sub.done();
    this.#pending.add(ended);
    ended.then(() => this.#pending.delete(ended));
    return true;
  }

  /** Resolves when every batch queued so far has been checksummed. */
  async flush(): Promise<void> {
    while (this.#pending.size > 0) await Promise.all(this.#pending);
  }

  /** Takes no more batches and waits for the queued ones. */
  async close(): Promise<void> {
    await this.#stage.drain();
    await this.flush();
  }

  /** Pins the batch, checksums the blocks that have none yet, records them. */
  async #run(job: ChecksumJob): Promise<void> {
    const pin = this.#host.pin(job.namespace, job.hashes, tierHolder("peer-checksum"));
    if (!pin) return;
    try {
      const hashes: Uint8Array[] = [];
      const extents: (readonly PoolExtent[])[] = [];
      pin.blocks.forEach((b, i) => {
        if (b && b.checksum === undefined) {
          hashes.push(job.hashes[i]);
          extents.push(b.extents);
        }
      });
      if (hashes.length === 0) return;
      const crcs = await this.#checksum(extents);
      this.#host.recordChecksums(job.namespace, hashes, crcs);
      this.recorded += hashes.length;
    } finally {
      pin.release();
    }
  }
}
