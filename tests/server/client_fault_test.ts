/**
 * An engine that shrinks its own shared memory (ftruncate on a registered
 * region or on its load state) must get a clear error for ITS request, while
 * the server process keeps running and every other engine keeps its session,
 * its data in the RAM cache and byte-exact saves and loads. Real server
 * process, real gRPC, real shm files (host backend).
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { LLAMA_3_1_8B, SimEngine } from "../../lib/client/sim_engine.ts";
import { hostSim, type ServerProc, startServer, uid } from "./harness.ts";

const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };
/** PF_EFAULT: what a load state reports when the engine's memory faulted under the copy. */
const PF_EFAULT = -13;

function shmName(handle: Uint8Array): string {
  return new TextDecoder().decode(handle).replace(/\0+$/, "");
}

/** What an engine can do to its own memory: shrink the file behind the server's mapping. */
function shrink(name: string): void {
  Deno.truncateSync(`/dev/shm${name}`, 0);
}

/** The server process is still running (its exit status has not settled). */
async function alive(srv: ServerProc): Promise<boolean> {
  const exited = await Promise.race([
    srv.status.then(() => true),
    new Promise<false>((r) => setTimeout(() => r(false), 50)),
  ]);
  return !exited;
}

/** Engine B's whole flow still works byte-exact: its cached prefix hits, loads, and new saves land. */
async function bStillServed(b: SimEngine, hashes: Uint8Array[], tag: string): Promise<void> {
  const q = await b.query(hashes, `${tag}-q`);
  assert.equal(q.kind, "ready");
  if (q.kind !== "ready") return;
  assert.equal(q.hits, hashes.length, "B's blocks are still in the RAM cache");
  const dst = hashes.map((_, i) => 40 + i);
  b.clear(dst);
  await b.load(q.leaseId, dst, `${tag}-load`);
  const v = b.verify(dst, hashes);
  assert.equal(v.badSegments, 0, v.first ?? "");
  const more = chainedBlockHashes(syntheticTokens(Number(tag.length) + 77, 16 * 4), 16);
  b.fill([20, 21, 22, 23], more);
  assert.equal((await b.save([20, 21, 22, 23], more)).blocksSaved, 4);
}

async function twoEngines(srv: ServerProc, numBlocks = 64) {
  const mk = (name: string) =>
    hostSim(srv, {
      instanceId: uid(name),
      namespace: uid(`ns-${name}`),
      model: MODEL,
      numBlocks,
    });
  const a = mk("a");
  const b = mk("b");
  await a.register();
  await b.register();
  const bHashes = chainedBlockHashes(syntheticTokens(2, 16 * 8), 16);
  const bIds = bHashes.map((_, i) => i);
  b.fill(bIds, bHashes);
  assert.equal((await b.save(bIds, bHashes)).blocksSaved, 8);
  return { a, b, bHashes };
}

Deno.test("an engine that shrinks a registered region gets a clear Save and Load error; the server and other engines carry on", async () => {
  const srv = await startServer();
  const { a, b, bHashes } = await twoEngines(srv);
  try {
    // A saves a prefix while its memory is intact.
    const aHashes = chainedBlockHashes(syntheticTokens(1, 16 * 6), 16);
    const aIds = aHashes.map((_, i) => i);
    a.fill(aIds, aHashes);
    assert.equal((await a.save(aIds, aHashes)).blocksSaved, 6);

    // Then it shrinks the region behind layer 2 to nothing.
    const gone = shmName(a.regions[2].handle);
    shrink(gone);

    const more = chainedBlockHashes(syntheticTokens(3, 16 * 4), 16);
    await assert.rejects(
      srv.client.save({
        instanceId: a.instanceId,
        tpRank: 0,
        ppRank: 0,
        requestId: "req-shrunk-save",
        blockIds: [10, 11, 12, 13],
        blockHashes: more,
      }),
      (e: Error) => {
        assert.match(e.message, /FAILED_PRECONDITION/);
        assert.match(
          e.message,
          new RegExp(`instance "${a.instanceId}" tp_rank 0 pp_rank 0 request "req-shrunk-save"`),
        );
        assert.match(e.message, new RegExp(`region \\d+ \\("${gone}", \\d+ bytes mapped\\)`));
        assert.match(e.message, /faulted at offset \d+ reading it \(save\)/);
        return true;
      },
    );
    assert.ok(await alive(srv), "the server survived the save");
    // Nothing of the failed save became servable.
    const q0 = await a.query(more, "req-after");
    assert.equal(q0.kind === "ready" && q0.hits, 0);

    // A Load into the shrunk region fails that load (state = PF_EFAULT), nothing else.
    const q = await a.query(aHashes, "req-shrunk-load");
    assert.equal(q.kind === "ready" && q.hits, 6);
    if (q.kind !== "ready") return;
    await assert.rejects(
      a.load(q.leaseId, [30, 31, 32, 33, 34, 35], "req-shrunk-load"),
      new RegExp(`ended with state ${PF_EFAULT}`),
    );
    assert.ok(await alive(srv), "the server survived the load");
    // The engine sees the native state word before the server's JS handles the
    // completion record and logs it: wait (bounded) for the line.
    let line: string | undefined;
    for (let i = 0; i < 200 && !line; i++) {
      line = srv.logs().find((l) =>
        l.includes('"load copy failed"') && l.includes("req-shrunk-load")
      );
      if (!line) await new Promise((r) => setTimeout(r, 25));
    }
    assert.ok(line, "the failed load is logged");
    assert.match(line, /"client_memory_fault":true/);
    assert.match(line, new RegExp(gone));

    await bStillServed(b, bHashes, "b-after-region");
    assert.equal(
      await srv.metric(
        "pegaflow_rpc_requests_total",
        '{method="Save",status="FAILED_PRECONDITION"}',
      ),
      1,
    );
  } finally {
    await srv.stop();
    a.close();
    b.close();
  }
});

Deno.test("a load state shrunk before the Load is refused with INVALID_ARGUMENT; the server carries on", async () => {
  const srv = await startServer();
  const { a, b, bHashes } = await twoEngines(srv);
  const st = LoadState.create();
  try {
    const aHashes = chainedBlockHashes(syntheticTokens(4, 16 * 4), 16);
    a.fill([0, 1, 2, 3], aHashes);
    await a.save([0, 1, 2, 3], aHashes);
    const q = await a.query(aHashes, "req-ls-early");
    if (q.kind !== "ready") throw new Error("expected a hit");
    shrink(st.name);
    await assert.rejects(
      srv.client.load({
        instanceId: a.instanceId,
        tpRank: 0,
        ppRank: 0,
        leaseId: q.leaseId,
        blockIds: [10, 11, 12, 13],
        loadStateShm: st.name,
        requestId: "req-ls-early",
      }),
      new RegExp(`INVALID_ARGUMENT.*load state "${st.name}".*is 0 bytes; expected at least 64`),
    );
    assert.ok(await alive(srv));
    await bStillServed(b, bHashes, "b-after-ls-early");
  } finally {
    await srv.stop();
    st.close();
    a.close();
    b.close();
  }
});

Deno.test("a load state shrunk while its load is queued fails that load only; the server carries on", async () => {
  const srv = await startServer(["--pool-size", "768mb"]);
  // B is large: its 128 MiB save sits in front of A's load in the copy
  // workers' FIFO, so A's batch is still queued when A (after Load returned)
  // shrinks its load state. The server log says which way each attempt went.
  const { a, b, bHashes } = await twoEngines(srv, 512);
  try {
    const aHashes = chainedBlockHashes(syntheticTokens(5, 16 * 64), 16);
    const aIds = aHashes.map((_, i) => i);
    a.fill(aIds, aHashes);
    await a.save(aIds, aHashes);
    let caught = false;
    for (let attempt = 0; attempt < 4 && !caught; attempt++) {
      const bigHashes = chainedBlockHashes(syntheticTokens(100 + attempt, 16 * 512), 16);
      const q = await a.query(aHashes, `req-ls-q-${attempt}`);
      if (q.kind !== "ready") throw new Error("expected a hit");
      const st = LoadState.create();
      const requestId = `req-ls-mid-${attempt}`;
      const bigSave = b.save(bigHashes.map((_, i) => i), bigHashes);
      await srv.client.load({
        instanceId: a.instanceId,
        tpRank: 0,
        ppRank: 0,
        leaseId: q.leaseId,
        blockIds: aIds.map((i) => 100 + i),
        loadStateShm: st.name,
        requestId,
      });
      shrink(st.name); // the engine's own block: never read it again after this
      await bigSave;
      // The load ends either way; wait for its line in the server log.
      const deadline = Date.now() + 30_000;
      let line: string | undefined;
      while (!line && Date.now() < deadline) {
        line = srv.logs().find((l) =>
          l.includes(requestId) && (l.includes('"load done"') || l.includes('"load copy failed"'))
        );
        if (!line) await new Promise((r) => setTimeout(r, 20));
      }
      assert.ok(line, `no outcome logged for ${requestId}`);
      if (line.includes('"load copy failed"')) {
        assert.match(line, /"client_memory_fault":true/);
        assert.match(line, new RegExp(`progress words: shm \\d+ \\(\\\\"${st.name}\\\\"`));
        caught = true;
      }
      st.close();
      assert.ok(await alive(srv), `the server survived attempt ${attempt}`);
    }
    assert.ok(caught, "the shrink never landed while the load was queued");
    await bStillServed(b, bHashes, "b-after-ls-mid");
  } finally {
    await srv.stop();
    a.close();
    b.close();
  }
});
