/**
 * `deno bench bench/native_bench.ts`: microbenchmarks of the native copy
 * layer on the host backend (CI-safe). Each case opens its own CopyEngine
 * outside the timed section (b.start/b.end), so nothing is left waiting
 * when the run ends. GPU figures come from `deno task bench` (bench/run.ts).
 */
import { CopyBatch, CopyEngine, loadLibrary } from "../ffi/mod.ts";
import { fillStrided } from "./native_copy.ts";

loadLibrary();
const SEGS = 40_000;
const SMALL = 512;

Deno.bench({
  name: "CopyBatch: write 40,000 segments (JS only)",
  group: "submit",
  n: 200,
  warmup: 20,
  fn() {
    const b = benchBatch;
    b.reset("d2h");
    for (let l = 0; l < 32; l++) {
      b.group(1, l);
      for (let i = 0; i < SEGS / 32; i++) {
        b.seg(2 * i * SMALL, (l * (SEGS / 32) + i) * SMALL, SMALL);
      }
    }
    b.finish();
  },
});
const benchBatch = new CopyBatch(32, SEGS);

Deno.bench({
  name: "fill + pf_copy_submit of a 40,000-segment batch (host backend)",
  group: "submit",
  n: 30,
  warmup: 3,
  async fn(b) {
    const ce = CopyEngine.open({ backend: "host", poolBytes: SEGS * SMALL, workers: 2 });
    const region = ce.engine.allocRegion(2 * SEGS * SMALL);
    const batch = new CopyBatch(32, SEGS);
    b.start();
    fillStrided(batch, region, "d2h", "host", SMALL, SEGS, 32);
    const s = ce.submit(batch);
    b.end();
    await s.done;
    region.close();
    await ce.close();
  },
});

for (const seg of [8 << 10, 32 << 10, 512 << 10]) {
  Deno.bench({
    name: `gather 32 MiB in ${seg >> 10} KB segments, submit to done (host memcpy)`,
    group: "copy",
    n: 20,
    warmup: 2,
    async fn(b) {
      const total = 32 << 20;
      const ce = CopyEngine.open({ backend: "host", poolBytes: total, workers: 2, pretouch: true });
      const region = ce.engine.allocRegion(2 * total);
      const batch = new CopyBatch(32, total / seg);
      fillStrided(batch, region, "d2h", "host", seg, total / seg, 32);
      await ce.submit(batch).done; // fault the pages in
      b.start();
      await ce.submit(batch).done;
      b.end();
      region.close();
      await ce.close();
    },
  });
}

Deno.bench({
  name: "completion latency: one 4 KB segment, submit to done (host)",
  group: "latency",
  n: 50,
  warmup: 5,
  async fn(b) {
    const ce = CopyEngine.open({ backend: "host", poolBytes: 1 << 20, workers: 1 });
    const region = ce.engine.allocRegion(1 << 16);
    const batch = new CopyBatch(1, 1).reset("h2d");
    batch.group(region, 0).seg(0, 0, 4096);
    await ce.submit(batch).done;
    b.start();
    await ce.submit(batch).done;
    b.end();
    region.close();
    await ce.close();
  },
});
