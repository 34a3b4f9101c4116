// Review of LowerTiers' admit worker: one tier whose put throws must not keep
// the tiers after it from their put, and the failure is logged (tier name,
// namespace, block count) and counted.
import { deepStrictEqual as assertEquals, ok as assert, strictEqual } from "node:assert/strict";
import { Logger } from "../../lib/log.ts";
import { LowerTiers } from "../../lib/storage/lower_tiers.ts";
import type {
  StoredLayout,
  Tier,
  TierBlocks,
  TierHealth,
  TierPrefetchAnswer,
  TierPutResult,
  TierTakeAnswer,
} from "../../lib/storage/tier.ts";
import { makeStore, NS } from "./helpers.ts";

const bytes = (i: number) => new Uint8Array([0x7e, i]);

/** A tier that records its puts, or throws from put when `failPut` is set. */
class PutTier implements Tier {
  readonly label: string;
  puts: TierBlocks[] = [];
  constructor(readonly name: string, readonly failPut = false) {
    this.label = name.toUpperCase();
  }
  has(_b: TierBlocks): number {
    return 0;
  }
  put(b: TierBlocks): TierPutResult {
    if (this.failPut) throw new Error(`${this.name} index is gone`);
    this.puts.push(b);
    return { status: "queued", blocks: b.hashes.length, duplicates: 0 };
  }
  prefetch(_requestId: string, _b: TierBlocks): TierPrefetchAnswer {
    return { state: "miss", reason: "not-held" };
  }
  take(_requestId: string): TierTakeAnswer {
    return { state: "none" };
  }
  settled(_requestId: string): undefined {
    return undefined;
  }
  drop(): number {
    return 0;
  }
  storedLayouts(_namespace: string): StoredLayout[] {
    return [];
  }
  health(): TierHealth {
    return { state: "up", capacityBytes: 1, usedBytes: 0, blocks: 0 };
  }
  flush(): Promise<void> {
    return Promise.resolve();
  }
  close(): Promise<void> {
    return Promise.resolve();
  }
}

Deno.test("a tier whose put throws does not keep the tiers after it from the sealed blocks; it is logged once and counted", async () => {
  const { store } = makeStore(8);
  const lines: string[] = [];
  const log = new Logger("info", {}, (l) => void lines.push(l));
  const ssd = new PutTier("ssd", true), peer = new PutTier("peer");
  const tiers = new LowerTiers({ ram: store, tiers: [ssd, peer], log });
  strictEqual(tiers.sealed(NS, [bytes(1), bytes(2), bytes(3)]), "queued");
  await tiers.flush();
  strictEqual(peer.puts.length, 1, "the peer tier never got the batch the SSD tier failed on");
  strictEqual(peer.puts[0].hashes.length, 3);
  const failed = lines.map((l) => JSON.parse(l)).filter((r) => r.tier === "ssd");
  strictEqual(
    failed.length,
    1,
    `expected one log line naming the ssd tier, got ${lines.join("\n")}`,
  );
  strictEqual(failed[0].namespace, NS);
  strictEqual(failed[0].blocks, 3);
  assert(String(failed[0].error).includes("index is gone"));
  assertEquals(tiers.stats().admitFailed, { ssd: 1, peer: 0 });
  await tiers.close();
});
