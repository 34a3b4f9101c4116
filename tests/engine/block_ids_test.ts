/**
 * A block id is an index below the layer's num_blocks: a negative or
 * fractional id (possible through the in-process KvEngine API; the wire's
 * uint32 cannot carry one) is refused before anything is planned or
 * consumed. Two layers share one region here, with a header before them,
 * so block -1 of the second layer is the first layer's last block: an
 * address the native bounds check (inside the region) cannot catch.
 */
import assert from "node:assert/strict";
import { Engine } from "../../ffi/mod.ts";
import { KvEngine, PROTOCOL_VERSION } from "../../lib/engine/engine.ts";
import type { EngineError } from "../../lib/engine/errors.ts";
import { openNative } from "../../lib/engine/native_adapter.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { KvStore } from "../../lib/storage/store.ts";
import { STATE_OK } from "../../lib/engine/load_state.ts";
import { silent } from "./setup.ts";

const BLOCK = 4096;
const BLOCKS = 8;
/** Where layer `l`'s block `b` starts: a one-block header, then l0's blocks, then l1's. */
const at = (l: number, b: number) => BLOCK * (1 + l * BLOCKS + b);

Deno.test("negative and fractional block ids are refused by Save and Load, nothing read, written or consumed", async () => {
  const native = await openNative({
    backend: "host",
    devices: [0],
    poolBytes: 16 << 20,
    useHugepages: false,
    transferPath: "auto",
  }, silent);
  const store = new KvStore({ capacityBytes: native.poolBytes });
  const engine = new KvEngine({ native, store, log: silent, leaseTtlMs: 60_000 });
  const mem = Engine.open({ backend: "host", device: 0 });
  const region = mem.allocRegion(BLOCK * (1 + 2 * BLOCKS));
  const st = LoadState.create();
  const geometry = (baseOffset: number) => ({
    numBlocks: BLOCKS,
    blockStride: BLOCK,
    segStride: BLOCK,
    segBytes: BLOCK,
    numSegments: 1,
    baseOffset,
    regionBytes: region.bytes,
  });
  const rank = { instanceId: "ids", tpRank: 0, ppRank: 0 };
  try {
    engine.register({
      ...rank,
      namespace: "ns-ids",
      tpSize: 1,
      ppSize: 1,
      worldSize: 1,
      deviceId: 0,
      layerNames: ["l0", "l1"],
      regionHandles: [region.handle, region.handle],
      geometry: [geometry(at(0, 0)), geometry(at(1, 0))],
      clientVersion: PROTOCOL_VERSION,
    });
    const fill = (off: number, byte: number) => region.write(off, new Uint8Array(BLOCK).fill(byte));
    fill(at(0, 0), 0x10);
    fill(at(1, 0), 0x11);
    fill(at(0, BLOCKS - 1), 0x77);
    const refused = (id: number) => (e: EngineError) =>
      e.code === 3 && e.message.includes(`block id ${id} is not a block index 0..7`) &&
      e.fields.blockId === id;

    for (const id of [-1, 0.5]) {
      await assert.rejects(
        engine.save({
          ...rank,
          layers: [],
          blockIds: [id],
          blockHashes: [new Uint8Array([1, id < 0 ? 1 : 2])],
        }),
        refused(id),
      );
    }
    assert.equal(store.stats().sealedBlocks + store.stats().inflightBlocks, 0, "nothing stored");

    const h = new Uint8Array([7, 7, 7]);
    assert.equal(
      (await engine.save({ ...rank, layers: [], blockIds: [0], blockHashes: [h] }))
        .blocksSaved,
      1,
    );
    const q = engine.query("ids", [h], "r-ids");
    assert.equal(q.hits, 1);
    for (const id of [-1, 0.5]) {
      await assert.rejects(
        engine.load({ ...rank, leaseId: q.leaseId!, blockIds: [id], loadStateShm: st.name }),
        refused(id),
      );
    }
    assert.deepEqual(
      region.read(at(0, BLOCKS - 1), BLOCK),
      new Uint8Array(BLOCK).fill(0x77),
      "layer l0's last block was not written by a load of l1's block -1",
    );
    // The refusals left the lease as it was: the corrected load spends it.
    const l = await engine.load({
      ...rank,
      leaseId: q.leaseId!,
      blockIds: [3],
      loadStateShm: st.name,
    });
    await l.done;
    assert.equal(st.snapshot().state, STATE_OK);
    assert.deepEqual(region.read(at(1, 3), BLOCK), new Uint8Array(BLOCK).fill(0x11));
  } finally {
    st.close();
    await engine.close();
    region.close();
    mem.close();
    await native.close();
  }
});
