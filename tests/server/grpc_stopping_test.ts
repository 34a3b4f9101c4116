/**
 * The gRPC service of a stopping server, in-process (grpc-js server over a
 * KvEngine on the host backend, a copy's completion held back so the stop
 * stays in its drain): the stop begins as server.ts's does (every session
 * ended, then the engine closed), and a Session or an RPC arriving meanwhile
 * is answered UNAVAILABLE at once. Before, such a Session stayed open with no
 * event until the sockets closed (never, for an embedder without the GOAWAY
 * guard), and Health answered "ok".
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { PegaflowClient } from "../../lib/client/client.ts";
import { Sessions } from "../../lib/server/sessions.ts";
import { ServerMetrics } from "../../lib/server/metrics.ts";
import { SessionEvent_Kind } from "../../proto/pegaflow.ts";
import { serveEngine, setup, silent } from "../engine/setup.ts";
import { refusedWith } from "./harness.ts";
import { settlesWithin } from "../../lib/http/shutdown.ts";

/** Resolves with what `p` resolved, or with "timeout" after `ms`. */
Deno.test("while the server stops, a new Session and new RPCs are answered UNAVAILABLE", async () => {
  const { engine, held, store, sims: [a], teardown } = await setup(["s-a"]);
  const sessions = new Sessions();
  const metrics = new ServerMetrics(() => store.stats(), {
    instances: () => engine.instances().length,
    sessions: () => sessions.count,
    prefetchWaits: () => engine.prefetchWaits,
  });
  const { server, port } = await serveEngine(engine, sessions, metrics, silent);
  const client = new PegaflowClient(`127.0.0.1:${port}`, { deadlineMs: 10_000 });
  const early = client.openSession("s-a");
  let late: ReturnType<PegaflowClient["openSession"]> | undefined;
  let hold: ReturnType<typeof held.holdNext> | undefined;
  let saving: Promise<unknown> | undefined;
  try {
    assert.equal((await client.health()).status, "ok");
    const hashes = chainedBlockHashes(syntheticTokens(6, 16 * 8), 16);
    const ids = hashes.map((_, i) => i);
    a.fill(ids, hashes);
    // A's save is copying (its completion held back): the stop waits on A's drain.
    hold = held.holdNext();
    const save = client.save({
      instanceId: "s-a",
      tpRank: 0,
      ppRank: 0,
      blockIds: ids,
      blockHashes: hashes,
      requestId: "r-stop",
    });
    saving = save;
    await hold.submitted;
    // The stop, in server.ts's order: sessions ended, then the engine closed.
    sessions.endAll(SessionEvent_Kind.SHUTDOWN, "server is stopping");
    const closing = engine.close();
    assert.equal((await early.closed)?.kind, SessionEvent_Kind.SHUTDOWN);

    late = client.openSession("s-late");
    assert.ok(await settlesWithin(late.closed, 5_000), "the late session is refused at once");
    assert.equal(await late.closed, null);
    assert.equal(late.error?.codeName, "UNAVAILABLE", String(late.error));
    assert.match(late.error!.details, /stopping/);
    assert.equal(sessions.count, 0, "the refused session is not kept");
    await assert.rejects(client.health(), refusedWith("UNAVAILABLE", /stopping/));

    hold.release();
    await closing;
    assert.equal((await save).blocksSaved, 8, "the save in flight finished");
    // Its instance is gone now: the server is stopping, not the instance unknown.
    await assert.rejects(
      client.queryPrefetch({ instanceId: "s-a", blockHashes: hashes, requestId: "r-late" }),
      refusedWith("UNAVAILABLE", /stopping/),
    );
  } finally {
    // A failed assertion above must not leave the held copy (and its RPC) hanging.
    hold?.release();
    await saving?.catch(() => {});
    late?.close();
    early.close();
    client.close();
    server.forceShutdown();
    await teardown();
  }
});
