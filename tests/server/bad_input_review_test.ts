/**
 * Regressions found by tests/server/fuzz_review_test.ts:
 * - a refusal that echoed an id of any length (1 MiB instance id, client
 *   version, layer name, request id, load state name) made grpc-js drop the
 *   answer: the engine saw CANCELLED "Call cancelled", not the status; the
 *   log line carried the whole id too;
 * - an instance id outside the name rule answered FAILED_PRECONDITION "not
 *   registered" (or opened a Session) where the proto says INVALID_ARGUMENT.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import type { PegaflowClient, PegaflowError } from "../../lib/client/client.ts";
import { capDetails, MAX_DETAILS_BYTES } from "../../lib/server/status_text.ts";
import { hostSim, refusedWith, startServer, uid } from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 2 };
const MB = 1 << 20;

/** The refusal's status and text, and that the text is cut to what a trailer carries. */
function cutRefusal(name: string, detail: RegExp): (e: unknown) => true {
  const check = refusedWith(name, detail);
  return (e: unknown) => {
    check(e);
    const d = (e as { details: string }).details;
    assert.ok(d.length <= MAX_DETAILS_BYTES, `${d.length}-character details`);
    return true;
  };
}

/** How a Session of (id, tp_rank) was refused, or undefined when it stayed open (then closed here). */
async function sessionError(
  client: PegaflowClient,
  id: string,
  tpRank: number,
): Promise<PegaflowError | undefined> {
  const s = client.openSession(id, tpRank, 0);
  let timer: ReturnType<typeof setTimeout> | undefined;
  const open = new Promise<"open">((r) => timer = setTimeout(() => r("open"), 2000));
  const r = await Promise.race([s.closed, open]);
  clearTimeout(timer);
  if (r === "open") {
    s.close();
    await s.closed;
    return undefined;
  }
  return s.error;
}

Deno.test("capDetails keeps short messages and cuts long ones to the trailer budget, both ends kept", () => {
  assert.equal(capDetails('instance "a" is not registered'), 'instance "a" is not registered');
  const fits = "x".repeat(MAX_DETAILS_BYTES);
  assert.equal(capDetails(fits), fits);
  const cut = capDetails(`Save: instance "${"i".repeat(MB)}" is not registered`);
  assert.ok(cut.length <= MAX_DETAILS_BYTES, String(cut.length));
  assert.match(cut, /^Save: instance "iii/);
  assert.match(cut, /\[\d+ characters cut\]/);
  assert.match(cut, /iii" is not registered$/);
  // The budget is in bytes as grpc-js sends them (encodeURI): spaces, quotes, non-ASCII
  // take 3 to 12; a surrogate pair is never split (encodeURI throws on half of one).
  for (const fill of ["\u4e2d", " ", '"', "\u{1F600}", "a\u{1F600}"]) {
    for (const shift of ["", "x", "xy"]) {
      const wide = capDetails(`${shift}layer "${fill.repeat(10_000)}" unknown`);
      const encoded = encodeURI(wide).length;
      assert.ok(encoded <= MAX_DETAILS_BYTES, `${JSON.stringify(fill)}: ${encoded} encoded bytes`);
      assert.match(wide, /" unknown$/);
    }
  }
});

Deno.test("a refusal naming an id of any length reaches the engine with its status, cut; the log line too", async () => {
  const srv = await startServer();
  const sim = hostSim(srv, {
    instanceId: uid("long"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 8,
  });
  try {
    await assert.rejects(
      sim.register({ clientVersion: "v".repeat(MB) }),
      cutRefusal("FAILED_PRECONDITION", /client version "vvv.*does not match the server's/),
    );
    await assert.rejects(
      sim.register({ instanceId: "i".repeat(MB), clientVersion: "pegaflow-0" }),
      cutRefusal("FAILED_PRECONDITION", /client version "pegaflow-0" does not match/),
    );
    await sim.register();
    const hashes = chainedBlockHashes(syntheticTokens(4, 16), 16);
    const save = { instanceId: sim.instanceId, tpRank: 0, ppRank: 0 };
    await assert.rejects(
      srv.client.save({
        ...save,
        layers: [{ layerName: "L".repeat(MB), blockIds: [0], blockHashes: hashes }],
      }),
      cutRefusal("INVALID_ARGUMENT", /which this rank did not register/),
    );
    await assert.rejects(
      srv.client.save({ ...save, blockIds: [8], blockHashes: hashes, requestId: "r".repeat(MB) }),
      cutRefusal("INVALID_ARGUMENT", /block id 8 >= num_blocks 8/),
    );
    await assert.rejects(
      srv.client.queryPrefetch({
        instanceId: "ghost",
        blockHashes: hashes,
        requestId: "r".repeat(MB),
      }),
      cutRefusal("FAILED_PRECONDITION", /instance "ghost" is not registered/),
    );
    const st = LoadState.create();
    try {
      await assert.rejects(
        srv.client.load({
          ...save,
          leaseId: new Uint8Array(16),
          blockIds: [0],
          loadStateShm: "/" + "s".repeat(MB),
        }),
        cutRefusal("INVALID_ARGUMENT", /cannot open load state/),
      );
    } finally {
      st.close();
    }
    const e = await sessionError(srv.client, "i".repeat(MB), 2048);
    assert.equal(e?.codeName, "INVALID_ARGUMENT", e?.message ?? "the session opened");
    assert.ok(e.details.length <= MAX_DETAILS_BYTES, `${e.details.length}-character details`);
    const long = srv.logs().filter((l) => l.length > 16_384);
    assert.deepEqual(long.map((l) => l.slice(0, 300)), [], "no log line carries an id whole");
    assert.equal((await srv.client.health()).status, "ok");
  } finally {
    sim.close();
    await srv.stop();
  }
});

Deno.test("an instance id outside the name rule is INVALID_ARGUMENT on every RPC; a Load's state still reports it", async () => {
  const srv = await startServer();
  const st = LoadState.create();
  const hashes = chainedBlockHashes(syntheticTokens(6, 16), 16);
  try {
    for (
      const [id, why] of [["", /instance_id is empty/], [
        "a:b",
        /instance_id "a:b" contains ":"/,
      ]] as const
    ) {
      await assert.rejects(
        srv.client.save({
          instanceId: id,
          tpRank: 0,
          ppRank: 0,
          blockIds: [0],
          blockHashes: hashes,
        }),
        refusedWith("INVALID_ARGUMENT", why),
      );
      await assert.rejects(
        srv.client.queryPrefetch({ instanceId: id, blockHashes: hashes, requestId: "q" }),
        refusedWith("INVALID_ARGUMENT", why),
      );
      await assert.rejects(srv.client.unregisterContext(id), refusedWith("INVALID_ARGUMENT", why));
      st.rearm();
      await assert.rejects(
        srv.client.load({
          instanceId: id,
          tpRank: 0,
          ppRank: 0,
          leaseId: new Uint8Array(16),
          blockIds: [0],
          loadStateShm: st.name,
        }),
        refusedWith("INVALID_ARGUMENT", why),
      );
      // A poller of the load state sees the refusal (no layer count known: all ones).
      const v = new DataView((await Deno.readFile(`/dev/shm${st.name}`)).buffer);
      assert.equal(v.getInt32(20, true), -1000, "state: refused before any copy");
      assert.equal(v.getUint32(16, true), 0xffff_ffff, "layers_ready: every layer done");
      const e = await sessionError(srv.client, id, 0);
      assert.equal(e?.codeName, "INVALID_ARGUMENT", e?.message ?? "the session opened");
      assert.match(e.details, why);
    }
    assert.equal(await srv.metric("pegaflow_sessions"), 0, "no session was taken");
  } finally {
    st.close();
    await srv.stop();
  }
});

Deno.test("a registration whose blocks could never be stored (layers x TP x segments over the limit) is refused at its first rank", async () => {
  const srv = await startServer();
  const sim = hostSim(srv, {
    instanceId: uid("items"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 1,
  });
  // 4096 layers of one block of 8 one-byte segments, side by side in one region.
  const layers = 4096;
  const region = sim.engine.allocRegion(layers * 8);
  try {
    const reg = (instanceId: string, kvSharedAcrossTp: boolean) =>
      srv.client.registerContext({
        instanceId,
        namespace: uid("ns"),
        tpRank: 0,
        tpSize: 33,
        ppRank: 0,
        ppSize: 1,
        worldSize: 33,
        deviceId: 0,
        layerNames: Array.from({ length: layers }, (_, i) => `layer.${i}`),
        regionHandles: Array.from({ length: layers }, () => region.handle),
        geometry: Array.from({ length: layers }, (_, i) => ({
          numBlocks: 1,
          blockStride: 8,
          segStride: 1,
          segBytes: 1,
          numSegments: 8,
          baseOffset: i * 8,
          regionBytes: layers * 8,
        })),
        kvSharedAcrossTp,
      });
    // 4096 x 33 x 8 = 1,081,344 items per block: over 2^20, whichever ranks come later.
    await assert.rejects(
      reg(uid("over"), false),
      refusedWith(
        "INVALID_ARGUMENT",
        /4096 layers x 33 TP rank slots x 8 segments = 1081344 items per block, at most 1048576/,
      ),
    );
    const j = await (await srv.http_get("/instances")).json();
    assert.deepEqual(j.instances, [], "the rank was not kept");
    // MLA stores one rank slot: the same shape fits.
    const ok = uid("mla");
    const r = await reg(ok, true);
    assert.equal(r.ranksRegistered, 1);
    await srv.client.unregisterContext(ok);
  } finally {
    region.close();
    sim.close();
    await srv.stop();
  }
});
