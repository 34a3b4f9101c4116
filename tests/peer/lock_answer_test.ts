// The requester's reading of a lock answer: the owner's packed extents become
// one flat range array (no object per range), and an answer whose counts,
// bytes or coverage disagree is refused with a message naming what is wrong, and
// so is one that would describe more ranges than a whole answer could carry.
import { deepStrictEqual, strictEqual } from "node:assert/strict";
import { MAX_ANSWER_RANGES, packExtents, remoteExtents } from "../../lib/peer/extents_wire.ts";
import { QueryBlocksForTransferResponse } from "../../proto/pegaflow.ts";
import { type BlockRanges, BlockRangesWriter } from "../../lib/transfer/ranges.ts";
import { lockPart } from "../../lib/peer/lock_call.ts";
import type { PeerLinks } from "../../lib/peer/link.ts";
import { Logger } from "../../lib/log.ts";

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
  shifts: number[] = [],
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
      extentShifts: shifts,
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

/** Flat ranges of blocks given as (offset, bytes) pairs per block. */
function flat(blocks: [number, number][][]): BlockRanges {
  const w = new BlockRangesWriter(blocks.length, blocks.flat().length);
  for (const b of blocks) {
    // One item per pair (the test's blocks have no adjacent ranges to merge).
    const offs = b.map(([o]) => o);
    if (b.length === 0) w.addEmpty();
    else if (b.every(([, n]) => n === b[0][1])) w.addBlock(offs, 0, 1, b.length, b[0][1]);
    else throw new Error("test blocks use one range size");
  }
  return w.finish();
}

Deno.test("blocks cut like the one before them go as shifts, and unpack to the same ranges", () => {
  // Three blocks saved together (one slot apart in each of 2 columns), then one cut otherwise.
  const S = 4096, col1 = 1 << 20;
  const blocks: [number, number][][] = [
    [[0, S], [col1, S]],
    [[S, S], [col1 + S, S]],
    [[2 * S, S], [col1 + 2 * S, S]],
    [[3 * S, S], [col1 + 9 * S, S]],
  ];
  const r = flat(blocks);
  const p = packExtents(r, 4, true);
  deepStrictEqual([...p.extentCounts], [2, 0, 0, 2]);
  deepStrictEqual([...p.extentShifts], [0, S, S, 0]);
  strictEqual(p.extents.length, 4 * 16, "only the blocks sent whole carry extents");
  const res = answer([...p.extentCounts], [], 2 * S, [...p.extentShifts]);
  res.extents = p.extents; // the owner's packed bytes, not answer()'s
  const back = remoteExtents(res);
  if (typeof back === "string") throw new Error(back);
  deepStrictEqual([...back.starts], [...r.starts]);
  deepStrictEqual([...back.ranges], [...r.ranges]);
  // A requester that did not ask gets every extent.
  const all = packExtents(r, 4, false);
  deepStrictEqual([...all.extentCounts], [2, 2, 2, 2]);
  strictEqual(all.extentShifts.length, 0);
});

Deno.test("a shifted lock answer that cannot be applied is refused, naming why", () => {
  strictEqual(
    remoteExtents(answer([1, 0], [[0, 8192]], 8192, [0])),
    "2 checksums but 1 extent shifts",
  );
  strictEqual(
    remoteExtents(answer([0, 1], [[0, 8192]], 8192, [0, 0])),
    "block 0: 0 extents and no previous block's extents to shift",
  );
  strictEqual(
    remoteExtents(answer([1, 0], [[0, 8192]], 8192)),
    "block 1: 0 extents and no previous block's extents to shift",
  );
  strictEqual(
    remoteExtents(answer([1, 0], [[4096, 8192]], 8192, [0, -8192])),
    "block 1: shift -8192 moves extent 0 to offset -4096",
  );
});

Deno.test("a small lock answer that shifts its way to millions of ranges, or names 0-byte extents, is refused before anything is built", () => {
  // One block cut into 65,536 one-byte ranges (1 MiB of extents), then 64 blocks "like it":
  // 4.26M ranges. It was unpacked (68 MB of ranges here; with more blocks, gigabytes and a
  // RangeError that escaped the fetch and left the owner's lock pinned until its TTL).
  const K = 65536, n = 65;
  const pairs = Array.from({ length: K }, (_, e) => [e, 1] as [number, number]);
  const counts = [K, ...new Array(n - 1).fill(0)];
  const shifts = [0, ...new Array(n - 1).fill(K)];
  const why = (r: ReturnType<typeof remoteExtents>) =>
    typeof r === "string" ? r : `taken: ${r.starts[r.starts.length - 1]} ranges`;
  strictEqual(
    why(remoteExtents(answer(counts, pairs, K, shifts))),
    `blocks 0..64 describe ${n * K} pool ranges; at most ${MAX_ANSWER_RANGES}`,
  );
  // The same, one block fewer, is exactly the bound: taken.
  const ok = remoteExtents(answer(counts.slice(0, n - 1), pairs, K, shifts.slice(0, n - 1)));
  strictEqual(why(ok), `taken: ${MAX_ANSWER_RANGES} ranges`);
  strictEqual(
    why(remoteExtents(answer([2], [[0, 8192], [8192, 0]], 8192))),
    "block 0: extent 1 is 0 bytes",
  );
});

Deno.test("a lock answer naming more blocks than were asked is refused as a bad answer, and its lock released", async () => {
  const released: string[] = [];
  const links = {
    // Asked for one block, the owner answers two, each whole and well formed.
    lock: () => Promise.resolve(answer([1, 1], [[0, 8192], [8192, 8192]], 8192)),
    release: (_addr: string, req: { requester: string }) => {
      released.push(req.requester);
      return Promise.resolve({ released: true, condemned: 0 });
    },
  } as unknown as PeerLinks;
  const ask = {
    namespace: "ns",
    blockHashes: [new Uint8Array([7])],
    layoutFingerprint: "f",
    requester: "node-b",
    lockTtlMs: 1000,
    shiftedExtents: true,
  };
  const got = await lockPart(
    links,
    { addr: "10.0.0.1:50055", rpcAddr: "10.0.0.1:50057", nodeId: "node-a" },
    ask,
    { payloadBytes: 8192, transport: "tcp" },
    1000,
    new Logger("error"),
  );
  if ("res" in got) throw new Error("an answer with more blocks than asked was taken");
  strictEqual(got.why, "bad-answer");
  strictEqual(got.fields.error, "2 blocks locked, 1 asked");
  strictEqual(got.fields.owner, "node-a");
  deepStrictEqual(released, ["node-b"], "the lock it did grant is released at once");
});
