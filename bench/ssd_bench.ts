/**
 * `deno bench bench/ssd_bench.ts`: the io_uring engine's sequential write
 * and read of a 64 MiB file in 1 MiB blocks at queue depth 32, O_DIRECT, and
 * a tier round trip (write-behind + verified prefetch) of 16 × 2 MiB blocks.
 * The full sweep with fio beside it is bench/ssd_run.ts.
 */
import { Engine } from "../ffi/native.ts";
import { CompletionRing } from "../ffi/ring.ts";
import type { PrefetchWant } from "../lib/ssd/prefetch.ts";
import { SsdTier } from "../lib/ssd/tier.ts";
import { layoutIdentity } from "../lib/storage/layout.ts";
import { Logger } from "../lib/log.ts";
import { runOurs } from "./ssd_lib.ts";

const MiB = 1 << 20;
const dir = await Deno.makeTempDir({ prefix: "pf-ssd-bench-" });
const engine = Engine.open({ backend: "host" });
const pool = engine.createPool(128 * MiB);
const ring = new CompletionRing(1 << 14);
const path = `${dir}/bench.dat`;
await Deno.writeFile(path, new Uint8Array(64 * MiB));

for (const op of ["write", "read"] as const) {
  Deno.bench({
    name: `uring ${op} 64 MiB, 1 MiB blocks, qd 32, O_DIRECT`,
    group: "engine",
    n: 10,
    warmup: 1,
    async fn() {
      await runOurs(pool.handle, 64 * MiB, ring, path, 64 * MiB, {
        op,
        blockBytes: MiB,
        qd: 32,
        direct: true,
      }, 0);
    },
  });
}

const tier = await SsdTier.open({
  pool: pool.handle,
  ring,
  paths: [dir],
  capacityBytes: 512 * MiB,
  segmentBytes: 64 * MiB,
  log: new Logger("error", {}, () => {}),
});
/** The layout the benchmark's blocks are written and read under. */
const BENCH_LAYOUT = layoutIdentity({
  tpSize: 1,
  ppSize: 1,
  collapseTp: false,
  layers: [{ name: "bench", segBytes: 2 * 1024 * 1024, numSegments: 1 }],
});
const FP = BENCH_LAYOUT.fingerprint;
let round = 0;
Deno.bench({
  name: "tier: write-behind then verified prefetch of 16 × 2 MiB blocks",
  group: "tier",
  n: 10,
  warmup: 1,
  async fn() {
    const keys = Array.from({ length: 16 }, (_, i) => `bench/${round}/${i}`);
    round++;
    tier.enqueueWrite({
      blocks: keys.map((key) => ({ key, namespace: "bench", layout: BENCH_LAYOUT })),
      pin: (fresh) => ({
        extents: fresh.map((b) => [{ offset: keys.indexOf(b.key) * 2 * MiB, bytes: 2 * MiB }]),
        release: () => {},
      }),
    });
    await tier.flushWrites();
    let at = 64 * MiB;
    let committed = 0;
    const alloc = (wanted: readonly PrefetchWant[]) =>
      wanted.map(({ payloadBytes: n }) => ({
        extents: [{ offset: (at += n) - n, bytes: n }],
        free: () => {},
        commit: () => committed++,
      }));
    tier.prefetch("b", keys, alloc, FP);
    await tier.prefetchSettled("b");
    const r = tier.prefetch("b", keys, alloc, FP);
    if (r.state !== "ready" || committed !== 16) {
      throw new Error(`prefetch returned ${r.state} with ${committed} blocks`);
    }
  },
});

globalThis.addEventListener("unload", () => {
  Deno.removeSync(dir, { recursive: true });
});
