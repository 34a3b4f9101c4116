/**
 * Writes tests/vectors/block_hashes.json from lib/client/hashes.ts: the
 * cross-language vectors that tests/client/hash_vectors_test.ts (this
 * implementation) and python/tests/test_hashes.py (the Python port) both
 * check. Run once after changing the hash: `./deno run -A tests/vectors/gen_block_hashes.ts`.
 */
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";

interface Case {
  name: string;
  /** Explicit tokens, or a syntheticTokens(seed, count) recipe. */
  tokens?: number[];
  synthetic?: { seed: number; count: number };
  blockTokens: number;
  salt: string;
}

const CASES: Case[] = [
  { name: "empty", tokens: [], blockTokens: 16, salt: "" },
  { name: "one partial block gets no hash", tokens: [1, 2, 3], blockTokens: 4, salt: "" },
  { name: "counting, 4 blocks of 16", tokens: [...Array(64).keys()], blockTokens: 16, salt: "" },
  {
    name: "large token ids, trailing partial",
    tokens: [0xffffffff, 128255, 7, 0, 65536, 9, 1],
    blockTokens: 2,
    salt: "",
  },
  { name: "salted", tokens: [...Array(32).keys()], blockTokens: 8, salt: "lora-7" },
  { name: "synthetic seed 1", synthetic: { seed: 1, count: 100 }, blockTokens: 16, salt: "" },
  {
    name: "synthetic seed 0 (spread to 1)",
    synthetic: { seed: 0, count: 40 },
    blockTokens: 8,
    salt: "x",
  },
  {
    name: "synthetic large seed (double rounding)",
    synthetic: { seed: 987654321, count: 48 },
    blockTokens: 16,
    salt: "",
  },
  { name: "synthetic negative seed", synthetic: { seed: -5, count: 16 }, blockTokens: 1, salt: "" },
];

const hex = (b: Uint8Array) => [...b].map((x) => x.toString(16).padStart(2, "0")).join("");

const out = CASES.map((c) => {
  const tokens = c.synthetic
    ? syntheticTokens(c.synthetic.seed, c.synthetic.count)
    : Uint32Array.from(c.tokens!);
  return {
    name: c.name,
    ...(c.synthetic ? { synthetic: c.synthetic } : {}),
    tokens: [...tokens],
    blockTokens: c.blockTokens,
    salt: c.salt,
    hashes: chainedBlockHashes(tokens, c.blockTokens, c.salt).map(hex),
  };
});
const path = new URL("./block_hashes.json", import.meta.url);
Deno.writeTextFileSync(
  path,
  JSON.stringify({ generatedBy: "tests/vectors/gen_block_hashes.ts", cases: out }, null, 1) + "\n",
);
console.log(`wrote ${out.length} cases to ${path.pathname}`);
