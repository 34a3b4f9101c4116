/**
 * Descriptor values the u32-pair encoding cannot carry (negative, NaN,
 * fractional, above 2^53) are refused where the descriptor is built. Before,
 * `x >>> 0` / `(x / 2^32) >>> 0` turned -4096 into 2^32 - 4096 and NaN into
 * 0: valid-looking offsets the library's bounds checks then accepted, so a
 * caller's bug copied other bytes instead of failing.
 */
import assert from "node:assert/strict";
import { CopyBatch, CopyEngine } from "../../ffi/mod.ts";
import { XferBatch } from "../../ffi/xfer.ts";
import { poolChecksums } from "../../ffi/uring.ts";

const FOUR_GIB = 2 ** 32;
const BAD = [-4096, -1, Number.NaN, 0.5, 2 ** 53 + 2, Infinity];

Deno.test("CopyBatch.seg refuses a negative, NaN, fractional or unsafe value instead of encoding another one", async () => {
  const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20, workers: 1 });
  // A sparse 4 GiB + 64 KiB shm region: 2^32 - 4096 is inside it.
  const region = ce.engine.allocRegion(FOUR_GIB + 65536);
  try {
    region.write(FOUR_GIB - 4096, new Uint8Array(4096).fill(0xcd));
    region.write(0, new Uint8Array(4096).fill(0xab));
    const pool = ce.pool.view(0, 4096);
    const b = new CopyBatch(1, 1);
    for (const bad of BAD) {
      for (const field of ["regionOff", "poolOff", "bytes"] as const) {
        pool.fill(0x11);
        const args = { regionOff: 0, poolOff: 0, bytes: 4096, [field]: bad };
        let refused: unknown;
        try {
          b.reset("d2h").group(region, 0).seg(args.regionOff, args.poolOff, args.bytes);
          const { done } = ce.submit(b);
          const r = await done;
          refused = r.status !== 0 ? r : undefined;
        } catch (e) {
          refused = e;
        }
        assert.ok(
          refused instanceof RangeError,
          `${field} ${bad}: expected a RangeError at seg(), got ${refused}; pool now starts ${
            pool[0].toString(16)
          }`,
        );
        assert.match(
          refused.message,
          new RegExp(`segment 0 \\(group 0\\): ${field} ${bad} is not an integer`),
        );
        assert.ok(pool.every((x) => x === 0x11), `${field} ${bad}: pool bytes changed`);
      }
    }
    // The largest safe integer still encodes exactly (the library then
    // refuses it by range, naming it).
    b.reset("d2h").group(region, 0).seg(Number.MAX_SAFE_INTEGER, 0, 64);
    assert.throws(() => ce.submit(b), /region_off 9007199254740991 /);
  } finally {
    region.close();
    await ce.close();
  }
});

Deno.test("XferBatch.seg/group and poolChecksums refuse values the u32 pairs cannot carry", async () => {
  const x = new XferBatch(4, 4).reset("read", 1000);
  for (const bad of BAD) {
    assert.throws(() => x.seg(bad, 0, 64), new RegExp(`segment 0: remoteOff ${bad}`));
    assert.throws(() => x.seg(0, bad, 64), new RegExp(`segment 0: localOff ${bad}`));
    assert.throws(() => x.seg(0, 0, bad), new RegExp(`segment 0: bytes ${bad}`));
    assert.throws(() => x.group(bad), new RegExp(`group 0: bytes ${bad}`));
    await assert.rejects(
      poolChecksums(1, [[{ offset: 0, bytes: 64 }, { offset: bad, bytes: 64 }]]),
      new RegExp(`block 0 extent 1: offset ${bad}`),
    );
  }
  assert.equal(x.numSegs, 0);
  assert.equal(x.numGroups, 0);
});
