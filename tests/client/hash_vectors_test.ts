/**
 * The shared cross-language block-hash vectors (tests/vectors/block_hashes.json,
 * also checked by python/tests/test_hashes.py) still match lib/client/hashes.ts.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";

interface VectorCase {
  name: string;
  synthetic?: { seed: number; count: number };
  tokens: number[];
  blockTokens: number;
  salt: string;
  hashes: string[];
}

const vectors: { cases: VectorCase[] } = JSON.parse(
  Deno.readTextFileSync(new URL("../vectors/block_hashes.json", import.meta.url)),
);
const hex = (b: Uint8Array) => [...b].map((x) => x.toString(16).padStart(2, "0")).join("");

Deno.test("the shared block-hash vectors match the TypeScript chained hashes", () => {
  assert.ok(vectors.cases.length >= 5);
  for (const c of vectors.cases) {
    const hashes = chainedBlockHashes(Uint32Array.from(c.tokens), c.blockTokens, c.salt).map(hex);
    assert.deepEqual(hashes, c.hashes, c.name);
  }
});

Deno.test("the shared vectors' synthetic token sequences match syntheticTokens", () => {
  for (const c of vectors.cases.filter((c) => c.synthetic)) {
    assert.deepEqual([...syntheticTokens(c.synthetic!.seed, c.synthetic!.count)], c.tokens, c.name);
  }
});
