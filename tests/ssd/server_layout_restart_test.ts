/**
 * The one-layout-per-namespace rule survives a restart with the SSD tier.
 * A real server saves blocks of one layout, they are written behind to SSD,
 * the server is killed with SIGKILL and a new one starts on the same file:
 * an engine that cuts the same bytes per block differently (TP 1 → 2,
 * 8 layers × 2 segments → 16 × 1, 32 KiB → 16 KiB segments) under the same
 * namespace is refused with FAILED_PRECONDITION naming the namespace and
 * both layouts, and the layout that wrote the blocks still loads them
 * byte-exact. Before the fix, the second layout was accepted, hit every
 * block, and loaded the first layout's bytes cut differently.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { PegaflowError } from "../../lib/client/client.ts";
import type { ModelShape, SimEngine } from "../../lib/client/sim_engine.ts";
import { type ServerProc, startServer, uid } from "../server/harness.ts";
import { MODEL, queryUntilReady, sim, SSD_FLAGS, until } from "./_server.ts";

const BLOCKS = 12;

/** Registers `e` with its K/V planes re-cut into `numSegments` segments of `segBytes` each. */
function registerRecut(e: SimEngine, segBytes: number, numSegments: number) {
  const nb = e.numBlocks;
  return e.register({
    geometry: e.regions.map(() => ({
      numBlocks: nb,
      blockStride: segBytes,
      segStride: nb * segBytes,
      segBytes,
      numSegments,
      baseOffset: 0,
      regionBytes: 2 * nb * e.segBytes,
    })),
  });
}

/** Saves BLOCKS blocks of `model` (TP=1, K/V split) in `namespace`, waits for write-behind, then SIGKILLs the server. */
async function saveThenKill(dir: string, namespace: string, model: ModelShape) {
  const hashes = chainedBlockHashes(syntheticTokens(11, 16 * BLOCKS), 16);
  const srv = await startServer(SSD_FLAGS(dir));
  const eng = sim(srv.client, namespace, { model });
  try {
    await eng.register();
    const ids = Array.from({ length: BLOCKS }, (_, i) => 1 + i);
    eng.fill(ids, hashes);
    assert.equal((await eng.save(ids, hashes)).blocksSaved, BLOCKS);
    await until(
      "write-behind",
      async () => (await srv.metric("pegaflow_ssd_write_blocks_total")) === BLOCKS,
    );
    Deno.kill(srv.pid, "SIGKILL");
    await srv.status;
  } finally {
    srv.client.close();
    eng.close();
    await srv.stop();
  }
  return hashes;
}

/** After the restart: the writer's layout still loads every block byte-exact. */
async function writerLayoutStillServes(
  srv: ServerProc,
  namespace: string,
  model: ModelShape,
  hashes: Uint8Array[],
) {
  const eng = sim(srv.client, namespace, { model });
  try {
    await eng.register();
    const r = await queryUntilReady(eng, hashes, uid("req"));
    assert.equal(r.hits, BLOCKS);
    const dst = Array.from({ length: BLOCKS }, (_, i) => 40 + i);
    eng.clear(dst);
    await eng.load(r.leaseId, dst);
    assert.deepEqual(eng.verify(dst, hashes), { badSegments: 0, first: undefined });
    await srv.client.unregisterContext(eng.instanceId);
  } finally {
    eng.close();
  }
}

/** Asserts a FAILED_PRECONDITION that names the namespace and both layouts. */
function refusedNaming(namespace: string, stored: string, offered: string) {
  return (e: unknown) => {
    assert.ok(e instanceof PegaflowError, String(e));
    assert.equal(e.codeName, "FAILED_PRECONDITION", e.message);
    assert.ok(e.message.includes(`namespace "${namespace}"`), e.message);
    assert.ok(e.message.includes(`stored on SSD with layout ${stored}`), e.message);
    assert.ok(e.message.includes(`offers ${offered}`), e.message);
    return true;
  };
}

async function withRestartedServer(
  model: ModelShape,
  offerOther: (srv: ServerProc, namespace: string) => Promise<void>,
) {
  const dir = await Deno.makeTempDir({ prefix: "pf-ssd-layout-" });
  const namespace = uid("llama");
  let srv: ServerProc | undefined;
  try {
    const hashes = await saveThenKill(dir, namespace, model);
    srv = await startServer(SSD_FLAGS(dir));
    assert.equal(await srv.metric("pegaflow_ssd_recovered_blocks"), BLOCKS);
    await offerOther(srv, namespace);
    await writerLayoutStillServes(srv, namespace, model, hashes);
    assert.equal(await srv.metric("pegaflow_ssd_checksum_failures_total"), 0);
  } finally {
    await srv?.stop();
    await Deno.remove(dir, { recursive: true });
  }
}

Deno.test("after kill -9 and a restart on the same SSD file, a TP=2 engine in a TP=1 namespace is refused, never served TP=1 bytes", async () => {
  await withRestartedServer(MODEL, async (srv, namespace) => {
    const instanceId = uid("tp2");
    const r0 = sim(srv.client, namespace, { tpRank: 0, tpSize: 2, instanceId });
    const r1 = sim(srv.client, namespace, { tpRank: 1, tpSize: 2, instanceId });
    try {
      // Same bytes per block: 4 layers × 2 ranks × 2 × 16 KiB = 4 × 1 × 2 × 32 KiB.
      assert.equal(r0.blockBytes * 2, MODEL.numLayers * 2 * 32768);
      await r0.register();
      await assert.rejects(
        r1.register(),
        refusedNaming(
          namespace,
          "tp_size 1, pp_size 1, 4 layers × 2 segments × 32768 B",
          "tp_size 2, pp_size 1, 4 layers × 2 segments × 16384 B",
        ),
      );
      await srv.client.unregisterContext(instanceId);
    } finally {
      r0.close();
      r1.close();
    }
  });
});

Deno.test("after a restart, 16 layers × 1 segment is refused in a namespace stored as 8 layers × 2 segments of equal block size", async () => {
  const eight = { ...MODEL, numLayers: 8 };
  await withRestartedServer(eight, async (srv, namespace) => {
    const e = sim(srv.client, namespace, { model: { ...MODEL, numLayers: 16 } });
    try {
      // 16 × 1 × 32 KiB = 8 × 2 × 32 KiB.
      await assert.rejects(
        registerRecut(e, e.segBytes, 1),
        refusedNaming(
          namespace,
          "tp_size 1, pp_size 1, 8 layers × 2 segments × 32768 B",
          "tp_size 1, pp_size 1, 16 layers × 1 segments × 32768 B",
        ),
      );
    } finally {
      e.close();
    }
  });
});

Deno.test("after a restart, the same block bytes cut into 16 KiB segments (a dtype-like change) are refused in a namespace of 32 KiB segments", async () => {
  await withRestartedServer(MODEL, async (srv, namespace) => {
    const e = sim(srv.client, namespace);
    try {
      // 4 layers × 4 × 16 KiB = 4 × 2 × 32 KiB.
      await assert.rejects(
        registerRecut(e, e.segBytes / 2, 4),
        refusedNaming(
          namespace,
          "tp_size 1, pp_size 1, 4 layers × 2 segments × 32768 B",
          "tp_size 1, pp_size 1, 4 layers × 4 segments × 16384 B",
        ),
      );
    } finally {
      e.close();
    }
  });
});
