/**
 * A registration never adopts a session that did not present its token. A
 * token-less Session opened before RegisterContext (by any process: a stale
 * engine, a rogue one) stands for no registration: the registration ends it
 * FAILED_PRECONDITION naming the instance and rank, keeps its grace timer until
 * a session presenting its token opens, and that earlier stream's end cleans
 * nothing up. Before, the registration adopted it, and the other process
 * ending its stream cleaned the real engine's instance up. And a client of the
 * protocol before tokens is refused at RegisterContext (PROTOCOL_VERSION).
 */
import assert from "node:assert/strict";
import { closeStandingSession, instanceIds, ownSim, SHORT_GRACE_MS, until } from "./_sessions.ts";
import { PegaflowClient, PROTOCOL_VERSION } from "../../lib/client/client.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { settlesWithin } from "../../lib/http/shutdown.ts";
import { refusedWith, startServer, uid } from "./harness.ts";

Deno.test("a token-less session opened before a registration is not adopted: its end leaves the registration alone", async () => {
  const srv = await startServer();
  const instanceId = uid("rogue");
  const rogue = new PegaflowClient(srv.grpc);
  const holder = ownSim(srv, instanceId);
  try {
    // Another process opens the rank's session before the real engine registers.
    const early = rogue.openSession(instanceId);
    await until(
      "the early session taken",
      async () => (await srv.metric("pegaflow_sessions")) === 1,
    );
    const r = await holder.sim.register();
    assert.match(r.registrationToken, /^[0-9a-f]{32}$/);
    // The registration ends the early stream (it stands for no registration) ...
    const endedByServer = await settlesWithin(early.closed, 10_000);
    // ... and the other process going away afterwards ends nothing of the registration.
    early.close();
    await early.closed;
    await until(
      "the early session gone",
      async () => (await srv.metric("pegaflow_sessions")) === 0,
    );
    const lost = await srv.metric("pegaflow_instance_cleanups_total", '{reason="session_lost"}');
    assert.ok(!(lost > 0), `the early session's end cleaned the instance up (${lost})`);
    assert.deepEqual(await instanceIds(srv), [instanceId]);
    assert.ok(endedByServer, "the registration left the token-less session open");
    assert.equal(early.error?.codeName, "FAILED_PRECONDITION", String(early.error));
    assert.match(
      early.error?.details ?? "",
      new RegExp(`instance "${instanceId}" tp_rank 0 pp_rank 0 was registered after`),
    );
    // The registration's own session (its token) stands for it, and the rank works.
    const own = holder.client.openSession(instanceId);
    await until("the own session taken", async () => (await srv.metric("pegaflow_sessions")) === 1);
    const hashes = chainedBlockHashes(syntheticTokens(11, 16 * 2), 16);
    holder.sim.fill([0, 1], hashes);
    assert.equal((await holder.sim.save([0, 1], hashes)).blocksSaved, 2);
    // Its own session's end does clean it up.
    await closeStandingSession(srv, own);
  } finally {
    holder.close();
    rogue.close();
    await srv.stop();
  }
});

Deno.test("a registration whose only session opened before it keeps its grace timer and is reaped", async () => {
  const env = { PEGAFLOW_SESSION_GRACE_MS: String(SHORT_GRACE_MS) };
  const srv = await startServer([], env);
  const instanceId = uid("early");
  const rogue = new PegaflowClient(srv.grpc);
  const dead = ownSim(srv, instanceId);
  try {
    const early = rogue.openSession(instanceId);
    await until(
      "the early session taken",
      async () => (await srv.metric("pegaflow_sessions")) === 1,
    );
    // The engine registers and dies before opening its own session: the early stream (now
    // ended by the registration) must not keep the rank held past the grace period.
    await dead.sim.register();
    assert.ok(await settlesWithin(early.closed, 10_000), "the early session was adopted");
    await until(
      "the session-less registration reaped",
      async () => !(await instanceIds(srv)).includes(instanceId),
    );
    assert.equal(
      await srv.metric("pegaflow_instance_cleanups_total", '{reason="session_never_opened"}'),
      1,
    );
  } finally {
    dead.close();
    rogue.close();
    await srv.stop();
  }
});

Deno.test("a client of the protocol before registration tokens is refused at RegisterContext, naming both versions", async () => {
  const srv = await startServer();
  const old = ownSim(srv, uid("old"));
  try {
    // A "pegaflow-1" client opens its Session without a token: accepted at RegisterContext, it
    // only failed at its Session ("carries no registration token"). Refused here instead.
    await assert.rejects(
      old.sim.register({ clientVersion: "pegaflow-1" }),
      refusedWith(
        "FAILED_PRECONDITION",
        new RegExp(
          `client version "pegaflow-1" does not match the server's "${PROTOCOL_VERSION}"`,
        ),
      ),
    );
    assert.equal((await old.client.health()).version, PROTOCOL_VERSION);
    assert.deepEqual(await instanceIds(srv), []);
  } finally {
    old.close();
    await srv.stop();
  }
});
