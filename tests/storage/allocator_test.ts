import {
  deepStrictEqual as assertEquals,
  ok as assert,
  strictEqual,
  throws,
} from "node:assert/strict";
import fc from "fast-check";
import { type Extent, PoolAllocator } from "../../lib/storage/allocator.ts";

/** Live items and free extents partition the pool's `cap` bytes exactly: no overlap, no hole. */
function assertPartition(
  a: PoolAllocator,
  live: readonly { offset: number; size: number }[],
  cap: number,
): void {
  const ranges = [
    ...live.map((x) => [x.offset, a.strideOf(x.size)] as [number, number]),
    ...a.freeExtents(),
  ].sort((x, y) => x[0] - y[0]);
  let at = 0;
  for (const [off, len] of ranges) {
    strictEqual(off, at, `overlap or hole at ${at}`);
    at += len;
  }
  strictEqual(at, cap);
}

const KiB = 1024;
const MiB = 1024 * KiB;

Deno.test("one save's K of one layer is a single contiguous run when the pool has room", () => {
  const a = new PoolAllocator({ capacityBytes: 8 * MiB });
  const runs = a.allocate(64, 32 * KiB)!;
  assertEquals(runs, [{ offset: 0, items: 64 }]);
  const next = a.allocate(64, 32 * KiB)!;
  assertEquals(next, [{ offset: 2 * MiB, items: 64 }]);
  strictEqual(a.usedBytes, 4 * MiB);
});

Deno.test("items are strided at the unit: a 3000-byte item takes one 4 KiB unit", () => {
  const a = new PoolAllocator({ capacityBytes: 64 * KiB, unitBytes: 4096 });
  strictEqual(a.strideOf(3000), 4096);
  assertEquals(a.allocate(4, 3000), [{ offset: 0, items: 4 }]);
  strictEqual(a.usedBytes, 16 * KiB);
});

Deno.test("a fragmented pool still satisfies a request from several extents, largest first", () => {
  const a = new PoolAllocator({ capacityBytes: 16 * 4096, unitBytes: 4096 });
  const all = a.allocate(16, 4096)!;
  assertEquals(all, [{ offset: 0, items: 16 }]);
  // Free every other item: eight 1-unit holes, none of two units.
  for (let i = 0; i < 16; i += 2) a.free(i * 4096, 4096);
  strictEqual(a.freeBytes, 8 * 4096);
  strictEqual(a.largestFreeBytes(), 4096);
  const runs = a.allocate(8, 4096)!;
  strictEqual(runs.length, 8);
  strictEqual(runs.reduce((n, r) => n + r.items, 0), 8);
  strictEqual(a.freeBytes, 0);
  strictEqual(a.allocate(1, 4096), null);
});

Deno.test("a request larger than the free bytes fails without allocating anything", () => {
  const a = new PoolAllocator({ capacityBytes: 10 * 4096, unitBytes: 4096 });
  a.allocate(3, 4096);
  strictEqual(a.allocate(8, 4096), null);
  strictEqual(a.freeBytes, 7 * 4096);
  // Holes smaller than an item do not count: two 1-unit holes cannot hold a 2-unit item.
  const b = new PoolAllocator({ capacityBytes: 4 * 4096, unitBytes: 4096 });
  b.allocate(4, 4096);
  b.free(0, 4096);
  b.free(2 * 4096, 4096);
  strictEqual(b.allocate(1, 8192), null);
  strictEqual(b.freeBytes, 2 * 4096);
});

Deno.test("freed neighbours coalesce back into one extent", () => {
  const a = new PoolAllocator({ capacityBytes: 32 * 4096, unitBytes: 4096 });
  const r = a.allocate(32, 4096)!;
  strictEqual(r.length, 1);
  for (const i of [5, 3, 4, 0, 2, 1, 31, 6]) a.free(i * 4096, 4096);
  assertEquals(a.freeExtents(), [[0, 7 * 4096], [31 * 4096, 4096]]);
  for (let i = 7; i < 31; i++) a.free(i * 4096, 4096);
  assertEquals(a.freeExtents(), [[0, 32 * 4096]]);
});

Deno.test("double free, misaligned and out-of-range frees are refused", () => {
  const a = new PoolAllocator({ capacityBytes: 8 * 4096, unitBytes: 4096 });
  a.allocate(4, 4096);
  a.free(0, 4096);
  throws(() => a.free(0, 4096), /already free/);
  throws(() => a.free(100, 4096), /misaligned/);
  throws(() => a.free(8 * 4096, 4096), /outside the pool/);
  throws(() => a.free(3 * 4096, 4096, 2), /already free/); // runs into the free tail
  throws(() => new PoolAllocator({ capacityBytes: 1 << 20, unitBytes: 1000 }), /power of two/);
  throws(() => new PoolAllocator({ capacityBytes: 100 }), /capacity/);
});

Deno.test("property: random allocate/free never overlaps and never leaks", () => {
  const unit = 512;
  const cap = 256 * unit;
  fc.assert(
    fc.property(
      fc.array(
        fc.oneof(
          fc.record({
            op: fc.constant("alloc" as const),
            count: fc.integer({ min: 1, max: 24 }),
            size: fc.constantFrom(512, 1000, 2048, 4096),
          }),
          fc.record({ op: fc.constant("free" as const), pick: fc.nat() }),
        ),
        { maxLength: 120 },
      ),
      (ops) => {
        const a = new PoolAllocator({ capacityBytes: cap, unitBytes: unit });
        const live: { offset: number; size: number }[] = []; // one entry per item
        for (const o of ops) {
          if (o.op === "alloc") {
            const stride = a.strideOf(o.size);
            const before = a.freeBytes;
            const runs: Extent[] | null = a.allocate(o.count, o.size);
            if (runs === null) {
              strictEqual(a.freeBytes, before);
              continue;
            }
            strictEqual(runs.reduce((n, r) => n + r.items, 0), o.count);
            for (const r of runs) {
              for (let i = 0; i < r.items; i++) {
                live.push({ offset: r.offset + i * stride, size: o.size });
              }
            }
          } else if (live.length > 0) {
            const [it] = live.splice(o.pick % live.length, 1);
            a.free(it.offset, it.size);
          }
          assertPartition(a, live, cap);
        }
        for (const it of live) a.free(it.offset, it.size);
        strictEqual(a.freeBytes, cap);
        assertEquals(a.freeExtents(), [[0, cap]]);
      },
    ),
    { numRuns: 200 },
  );
});

Deno.test("uniform item sizes: any request fits whenever enough free bytes exist", () => {
  fc.assert(
    fc.property(
      fc.array(fc.nat(), { maxLength: 60 }),
      fc.integer({ min: 1, max: 40 }),
      (frees, want) => {
        const a = new PoolAllocator({ capacityBytes: 64 * 8192, unitBytes: 4096 });
        const items: number[] = [];
        for (const r of a.allocate(64, 8192)!) {
          for (let i = 0; i < r.items; i++) items.push(r.offset + i * 8192);
        }
        for (const f of frees) {
          if (items.length === 0) break;
          const [off] = items.splice(f % items.length, 1);
          a.free(off, 8192);
        }
        const fits = want * 8192 <= a.freeBytes;
        assert((a.allocate(want, 8192) !== null) === fits);
      },
    ),
    { numRuns: 200 },
  );
});

Deno.test("parts: a save that names its part lands there, spills over only when its part is full, and extents never coalesce across parts", () => {
  const unit = 4096;
  const a = new PoolAllocator({
    capacityBytes: 64 * unit,
    unitBytes: unit,
    parts: [32 * unit, 32 * unit],
  });
  assertEquals(a.partCount, 2);
  const r1 = a.allocate(8, unit, 1)!;
  assertEquals(r1, [{ offset: 32 * unit, items: 8 }]);
  assertEquals(a.partUsedBytes(), [0, 8 * unit]);
  const r0 = a.allocate(4, unit, 0)!;
  assertEquals(a.partOf(r0[0].offset), 0);
  // Part 1 has 24 units left: 30 items spill over into part 0.
  const spill = a.allocate(30, unit, 1)!;
  assertEquals(spill.reduce((n, r) => n + r.items, 0), 30);
  assertEquals(a.partFreeBytes(1), 0);
  assertEquals(a.partUsedBytes(), [(4 + 6) * unit, 32 * unit]);
  // Free everything: two extents, one per part, not one across the boundary.
  for (const r of [...r1, ...r0, ...spill]) a.free(r.offset, unit, r.items);
  assertEquals(a.freeExtents(), [[0, 32 * unit], [32 * unit, 32 * unit]]);
  assertEquals(a.allocate(33, unit, 0)?.length, 2, "33 items need both parts");
});

Deno.test("parts: a run of items freed in one call across a part boundary leaves one extent per part", () => {
  // Eviction frees neighbouring victims as one run; the end of part 0 and the
  // start of part 1 are neighbours in offsets, never in memory.
  const unit = 4096;
  const a = new PoolAllocator({
    capacityBytes: 8 * unit,
    unitBytes: unit,
    parts: [4 * unit, 4 * unit],
  });
  assertEquals(a.allocate(4, unit, 0), [{ offset: 0, items: 4 }]);
  assertEquals(a.allocate(4, unit, 1), [{ offset: 4 * unit, items: 4 }]);
  a.free(2 * unit, unit, 4); // units 2..5: two of part 0, two of part 1
  assertEquals(a.freeExtents(), [[2 * unit, 2 * unit], [4 * unit, 2 * unit]]);
  assertEquals(a.partUsedBytes(), [2 * unit, 2 * unit]);
  assertEquals([a.partFreeBytes(0), a.partFreeBytes(1)], [2 * unit, 2 * unit]);
  // Part 0 has room for 2 items, not 4: a 3-item save for it takes those two
  // and spills the third into part 1 instead of using part 1 as its own.
  assertEquals(a.allocate(3, unit, 0), [
    { offset: 2 * unit, items: 2 },
    { offset: 4 * unit, items: 1 },
  ]);
  assertEquals(a.partUsedBytes(), [4 * unit, 3 * unit]);
  a.free(0, unit, 5); // units 0..4, one run over both parts (unit 5 is free)
  a.free(6 * unit, unit, 2);
  assertEquals(a.freeExtents(), [[0, 4 * unit], [4 * unit, 4 * unit]]);
  assertEquals(a.partUsedBytes(), [0, 0]);
});

Deno.test("parts must be positive unit multiples inside the capacity", () => {
  const unit = 4096;
  throws(
    () => new PoolAllocator({ capacityBytes: 8 * unit, unitBytes: unit, parts: [100, 8 * unit] }),
    RangeError,
  );
  throws(
    () =>
      new PoolAllocator({ capacityBytes: 8 * unit, unitBytes: unit, parts: [8 * unit, 4 * unit] }),
    RangeError,
  );
});

Deno.test("property: with parts, allocations never overlap or leak, no free extent crosses a part, and a part with room gets its save", () => {
  const unit = 512;
  const parts = [96 * unit, 64 * unit, 96 * unit];
  const cap = 256 * unit;
  const starts = [0, 96 * unit, 160 * unit];
  fc.assert(
    fc.property(
      fc.array(
        fc.oneof(
          fc.record({
            op: fc.constant("alloc" as const),
            count: fc.integer({ min: 1, max: 24 }),
            size: fc.constantFrom(512, 1000, 2048),
            part: fc.integer({ min: 0, max: 2 }),
          }),
          fc.record({ op: fc.constant("free" as const), pick: fc.nat() }),
        ),
        { maxLength: 120 },
      ),
      (ops) => {
        const a = new PoolAllocator({ capacityBytes: cap, unitBytes: unit, parts });
        const live: { offset: number; size: number }[] = [];
        for (const o of ops) {
          if (o.op === "alloc") {
            const stride = a.strideOf(o.size);
            // Whole items fit in the part's largest extent: then every item must land there.
            const ext = a.freeExtents().filter(([off]) => a.partOf(off) === o.part);
            const fitsInPart = ext.some(([, len]) => len >= o.count * stride);
            const runs = a.allocate(o.count, o.size, o.part);
            if (runs === null) continue;
            strictEqual(runs.reduce((n, r) => n + r.items, 0), o.count);
            if (fitsInPart) { for (const r of runs) strictEqual(a.partOf(r.offset), o.part); }
            for (const r of runs) {
              for (let i = 0; i < r.items; i++) {
                live.push({ offset: r.offset + i * stride, size: o.size });
              }
            }
          } else if (live.length > 0) {
            const [it] = live.splice(o.pick % live.length, 1);
            a.free(it.offset, it.size);
          }
          for (const [off, len] of a.freeExtents()) {
            const p = a.partOf(off);
            assert(
              off + len <= (starts[p + 1] ?? cap),
              `free extent [${off}, +${len}) crosses part ${p}`,
            );
          }
          assertPartition(a, live, cap);
        }
        for (const it of live) a.free(it.offset, it.size);
        assertEquals(a.freeExtents(), parts.map((b, i) => [starts[i], b]));
      },
    ),
    { numRuns: 200 },
  );
});

Deno.test("allocateRun places every item in one extent or nothing: it never splits", () => {
  const a = new PoolAllocator({ capacityBytes: 16 * 4096, unitBytes: 4096 });
  strictEqual(a.allocateRun(4, 4096), 0);
  strictEqual(a.allocateRun(2, 3000), 4 * 4096, "items at the unit's stride");
  // Free every other unit of the rest: 5 holes of one unit, 10 units free in all.
  const rest = a.allocate(10, 4096)!;
  assertEquals(rest, [{ offset: 6 * 4096, items: 10 }]);
  for (let i = 6; i < 16; i += 2) a.free(i * 4096, 4096);
  const before = a.freeExtents();
  strictEqual(a.allocateRun(2, 4096), null, "2 units free, but in no one extent");
  assertEquals(a.freeExtents(), before, "a refused run takes nothing");
  strictEqual(a.allocateRun(1, 4096), 6 * 4096);
  strictEqual(a.allocateRun(17, 4096), null);
  throws(() => a.allocateRun(0, 4096), /allocateRun: count must be an integer ≥ 1, got 0/);
});

Deno.test("allocateRun with a part stays in that part: a run too long for it is refused, not spilled", () => {
  const unit = 4096;
  const a = new PoolAllocator({
    capacityBytes: 64 * unit,
    unitBytes: unit,
    parts: [32 * unit, 32 * unit],
  });
  strictEqual(a.allocateRun(30, unit, 1), 32 * unit);
  strictEqual(a.allocateRun(8, unit, 1), null, "part 1 has 2 units left");
  assertEquals(a.partUsedBytes(), [0, 30 * unit]);
  strictEqual(a.allocateRun(8, unit), 0, "no part named: any part's extent");
  strictEqual(a.allocateRun(2, unit, 1), 62 * unit);
});
