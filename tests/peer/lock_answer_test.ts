// The requester's reading of a lock answer: the owner's packed extents become
// one flat range array (no object per range), and an answer whose counts,
// bytes or coverage disagree is refused with a message naming what is wrong.
import { deepStrictEqual, strictEqual } from "node:assert/strict";
import { remoteExtents } from "../../lib/peer/read.ts";
import { QueryBlocksForTransferResponse } from "../../proto/pegaflow.ts";

/** Packs (offset, bytes) pairs as the owner does: little-endian u64 each. */
function packed(pairs: [number, number][]): Uint8Array {
  const out = new Uint8Array(16 * pairs.length);
  const dv = new DataView(out.buffer);
  pairs.forEach(([off, n], i) => {
    dv.setBigUint64(16 * i, BigInt(off), true);
    dv.setBigUint64(16 * i + 8, BigInt(n), true);
  });
  return out;
}

function answer(
  counts: number[],
  pairs: [number, number][],
  payloadBytes: number,
): QueryBlocksForTransferResponse {
  // Through the wire codec, so the arrays are what a real answer decodes to.
  return QueryBlocksForTransferResponse.decode(
    QueryBlocksForTransferResponse.encode({
      lockId: new Uint8Array([1]),
      lockTtlMs: 1000,
      transport: "tcp",
      xferAddr: "10.0.0.1:1",
      payloadBytes,
      checksums: counts.map((_, i) => i + 1),
      extentCounts: counts,
      extents: packed(pairs),
      missReason: "",
    }).finish(),
  );
}

Deno.test("a lock answer's extents become one flat range array, per block in payload order", () => {
  const big = 2 ** 40; // offsets past 2^32 survive the u64 halves
  const r = remoteExtents(answer([2, 1], [[big, 4096], [0, 4096], [8192, 8192]], 8192));
  if (typeof r === "string") throw new Error(r);
  deepStrictEqual([...r.starts], [0, 2, 3]);
  deepStrictEqual([...r.ranges], [big, 4096, 0, 4096, 8192, 8192]);
});

Deno.test("a lock answer whose extents disagree with its counts or its payload is refused, naming why", () => {
  strictEqual(
    remoteExtents({ ...answer([1], [[0, 8192]], 8192), extentCounts: [1, 1] }),
    "1 checksums but 2 extent counts",
  );
  strictEqual(
    remoteExtents(answer([2], [[0, 8192]], 8192)),
    "16 extent bytes for 2 extents",
  );
  strictEqual(
    remoteExtents(answer([1, 1], [[0, 8192], [8192, 4096]], 8192)),
    "block 1: extents cover 4096 bytes, payload is 8192",
  );
});
