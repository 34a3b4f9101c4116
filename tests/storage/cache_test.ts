import { ok as assert, strictEqual } from "node:assert/strict";
import { Block } from "../../lib/storage/block.ts";
import { CountMinSketch, LruCache, TinyLfu } from "../../lib/storage/cache.ts";

const LAYOUT = { layers: 1, tpSize: 1, collapseTp: false, segments: 1, segmentBytes: 4096 };

function sealed(key: string): Block {
  const b = new Block(key, "ns", key, LAYOUT, 0, 0);
  b.state = "sealed";
  return b;
}

Deno.test("the LRU victim is the least recently used unpinned block; a touch renews", () => {
  const lru = new LruCache(() => 10);
  const [a, b, c] = ["a", "b", "c"].map(sealed);
  for (const x of [a, b, c]) lru.insert(x);
  strictEqual(lru.victim(), a);
  lru.touch(a);
  strictEqual(lru.victim(), b);
  strictEqual(lru.evictableBytes, 30);
});

Deno.test("a pinned block is never the victim and rejoins at the MRU end when unpinned", () => {
  const lru = new LruCache(() => 10);
  const [a, b] = ["a", "b"].map(sealed);
  lru.insert(a);
  lru.insert(b);
  lru.pin(a);
  lru.pin(a);
  strictEqual(lru.victim(), b);
  strictEqual(lru.evictableBytes, 10);
  lru.remove(b);
  strictEqual(lru.victim(), null);
  lru.unpin(a);
  strictEqual(lru.victim(), null); // still one holder
  lru.unpin(a);
  strictEqual(lru.victim(), a);
});

Deno.test("reclaimable blocks (fetched from a peer) are evicted before retained ones", () => {
  const lru = new LruCache(() => 1);
  const [old, peer] = ["old", "peer"].map(sealed);
  lru.insert(old, "retained");
  lru.insert(peer, "reclaimable");
  strictEqual(lru.victim(), peer);
  lru.remove(peer);
  strictEqual(lru.victim(), old);
});

Deno.test("the count-min sketch never underestimates before a reset and saturates at 255", () => {
  const s = new CountMinSketch(10_000);
  const truth = new Map<string, number>();
  for (let i = 0; i < 5_000; i++) {
    const k = `ns:${(i * 7919) % 997}`;
    s.increment(k);
    truth.set(k, (truth.get(k) ?? 0) + 1);
  }
  strictEqual(s.resets, 0);
  for (const [k, n] of truth) assert(s.estimate(k) >= Math.min(n, 255), k);
  for (let i = 0; i < 300; i++) s.increment("hot");
  strictEqual(s.estimate("hot"), 255);
});

Deno.test("the sketch halves every counter after 8 × capacity increments", () => {
  const s = new CountMinSketch(16);
  strictEqual(s.sampleSize, 128);
  for (let i = 0; i < 100; i++) s.increment("hot");
  strictEqual(s.estimate("hot"), 100);
  for (let i = 0; i < 28; i++) s.increment(`cold-${i}`);
  strictEqual(s.resets, 1);
  assert(s.estimate("hot") >= 50 && s.estimate("hot") <= 51);
});

Deno.test("TinyLFU admits a candidate only when it is more popular than the victim", () => {
  const lfu = new TinyLfu(1000);
  for (let i = 0; i < 5; i++) lfu.record("hot");
  lfu.record("scan-1");
  strictEqual(lfu.admit("scan-1", "hot"), false);
  strictEqual(lfu.rejections, 1);
  for (let i = 0; i < 5; i++) lfu.record("rising");
  strictEqual(lfu.admit("rising", "scan-1"), true);
  strictEqual(lfu.rejections, 1);
});
