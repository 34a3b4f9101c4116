/**
 * Layer order is the order the engine registers (its execution order), not
 * sorted names — vLLM's `model.layers.10` sorts before `model.layers.2` —
 * and one order holds per namespace: the first registration of each PP
 * stage fixes it, TP peers and other instances must repeat it or get
 * FAILED_PRECONDITION before anything is mapped; the global order is the
 * stages in pp_rank order. Over real gRPC against a server child.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { hostSim, refusedWith, type ServerProc, shmMappings, startServer, uid } from "./harness.ts";

/** vLLM's names, in execution order: a name sort would put 10 and 11 first. */
const VLLM_NAMES = ["model.layers.8.attn", "model.layers.9.attn", "model.layers.10.attn"];
const MODEL = { ...LLAMA_3_1_8B, numLayers: 3 };

async function instance(srv: ServerProc, id: string) {
  const j = await (await srv.http_get("/instances")).json();
  return j.instances.find((i: { instanceId: string }) => i.instanceId === id);
}

function sim(srv: ServerProc, instanceId: string, ns: string, tpRank = 0, tpSize = 1) {
  return hostSim(srv, {
    instanceId,
    namespace: ns,
    model: MODEL,
    numBlocks: 8,
    tpRank,
    tpSize,
  });
}

Deno.test("layer ids follow registration order, and another instance of the namespace loads them byte-exact", async () => {
  const srv = await startServer();
  const ns = uid("ns");
  const a = sim(srv, uid("first"), ns);
  const b = sim(srv, uid("second"), ns);
  try {
    await a.register({ layerNames: VLLM_NAMES });
    assert.deepEqual((await instance(srv, a.instanceId)).layers, VLLM_NAMES);
    const hashes = chainedBlockHashes(syntheticTokens(31, 16 * 3), 16);
    a.fill([0, 1, 2], hashes);
    await a.save([0, 1, 2], hashes);

    await b.register({ layerNames: VLLM_NAMES });
    const q = await b.query(hashes, "r-order");
    assert.ok(q.kind === "ready" && q.hits === 3);
    if (q.kind !== "ready") return;
    await b.load(q.leaseId, [5, 6, 7]);
    const v = b.verify([5, 6, 7], hashes);
    assert.equal(v.badSegments, 0, v.first ?? "");
  } finally {
    a.close();
    b.close();
    await srv.stop();
  }
});

Deno.test("a registration in another layer order is refused with the namespace, rank and expected vs got, and maps nothing", async () => {
  const srv = await startServer();
  const ns = uid("ns");
  const id = uid("tp");
  const r0 = sim(srv, id, ns, 0, 2);
  const r1 = sim(srv, id, ns, 1, 2);
  const other = sim(srv, uid("other"), ns, 0, 2);
  try {
    await r0.register({ layerNames: VLLM_NAMES });
    // The TP peer lists the same names sorted: refused before any mapping.
    const sorted = [...VLLM_NAMES].sort();
    await assert.rejects(
      r1.register({ layerNames: sorted }),
      refusedWith(
        "FAILED_PRECONDITION",
        new RegExp(
          `tp_rank 1 pp_rank 0: namespace "${ns}" .*pp stage 0 layer 0 is ` +
            `"model\\.layers\\.8\\.attn" there, got "model\\.layers\\.10\\.attn"`,
        ),
      ),
    );
    const tag = r1.regions[0].handle;
    const shmName = new TextDecoder().decode(tag.subarray(1, tag.indexOf(0)));
    assert.deepEqual(shmMappings(srv.pid, shmName), [], "the refused rank mapped nothing");
    const inst = await instance(srv, id);
    assert.equal(inst.ranksRegistered, 1);
    assert.equal(inst.sealed, false);

    // A missing layer is named the same way.
    const g = {
      numBlocks: 8,
      blockStride: r1.segBytes,
      segStride: 8 * r1.segBytes,
      segBytes: r1.segBytes,
      numSegments: 2,
      baseOffset: 0,
      regionBytes: 2 * 8 * r1.segBytes,
    };
    await assert.rejects(
      r1.register({
        layerNames: VLLM_NAMES.slice(0, 2),
        regionHandles: r1.regions.slice(0, 2).map((r) => r.handle),
        geometry: [g, g],
      }),
      refusedWith(
        "FAILED_PRECONDITION",
        /layer 2 is "model\.layers\.10\.attn" there, got \(none\)/,
      ),
    );

    // The right order seals; then another instance of the namespace must agree too.
    const sealed = await r1.register({ layerNames: VLLM_NAMES });
    assert.equal(sealed.topologySealed, true);
    await assert.rejects(
      other.register({ layerNames: sorted }),
      refusedWith("FAILED_PRECONDITION", /already holds a different layout: pp stage 0 layer 0/),
    );
  } finally {
    r0.close();
    r1.close();
    other.close();
    await srv.stop();
  }
});

Deno.test("pipeline stages: global order is the stages in pp_rank order, whichever registers first", async () => {
  const srv = await startServer();
  const ns = uid("ns");
  const id = uid("pp");
  const s0 = sim(srv, id, ns);
  const s1 = sim(srv, id, ns);
  const stage0 = ["model.layers.8.attn", "model.layers.9.attn", "model.layers.10.attn"];
  const stage1 = ["model.layers.11.attn", "model.layers.12.attn", "model.layers.13.attn"];
  try {
    await s1.register({ ppRank: 1, ppSize: 2, worldSize: 2, layerNames: stage1 });
    const r = await s0.register({ ppRank: 0, ppSize: 2, worldSize: 2, layerNames: stage0 });
    assert.equal(r.topologySealed, true);
    assert.deepEqual((await instance(srv, id)).layers, [...stage0, ...stage1]);
  } finally {
    s0.close();
    s1.close();
    await srv.stop();
  }
});
