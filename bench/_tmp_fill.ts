import { KvStore } from "../lib/storage/store.ts";
import { storeTierHost } from "../lib/storage/tier_host.ts";
import { prefixHashes } from "./micro.ts";
const LAYOUT = { layers: 32, tpSize: 1, collapseTp: false, segments: 2, segmentBytes: 32 * 1024 };
const NS = "x";
const blockBytes = 32 * 2 * 32 * 1024;
const store = new KvStore({ capacityBytes: 2 * 640 * blockBytes });
store.defineNamespace(NS, LAYOUT);
const host = storeTierHost(store);
for (let it = 0; it < 12; it++) {
  const hs = prefixHashes(it + 1, false).slice(0, 256);
  const t0 = performance.now();
  const parts = [];
  for (let from = 0; from < 256; from += 32) parts.push(host.fillMany(NS, hs.slice(from, from + 32), "peer", "reclaimable")!);
  const t1 = performance.now();
  for (const f of parts) f.settle(() => true);
  const t2 = performance.now();
  // evict: drop them by filling... just measure
  console.log(`fillMany x8 (256 blocks): ${(t1 - t0).toFixed(2)} ms, settle ${(t2 - t1).toFixed(2)} ms`);
}
