/**
 * A Session belongs to a registration: it presents the registration token
 * RegisterContext answered, and only a session of the rank's current
 * registration may supersede the holder's. Another engine under the same
 * instance id (no token, or another registration's) is refused
 * FAILED_PRECONDITION naming the rank and changes nothing. A rank that
 * registered and never opened its session is cleaned up after the grace
 * period (`--session-grace-ms`), so an engine that died in between does not
 * hold the rank for good.
 */
import assert from "node:assert/strict";
import {
  closeStandingSession,
  instanceIds,
  MODEL,
  ownSim,
  SHORT_GRACE_MS,
  until,
} from "./_sessions.ts";
import { PegaflowClient } from "../../lib/client/client.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { SimEngine } from "../../lib/client/sim_engine.ts";
import { settlesWithin } from "../../lib/http/shutdown.ts";
import { hostSim, refusedWith, startServer, uid } from "./harness.ts";

Deno.test("another engine's session for a held rank is refused and the holder keeps its session and instance", async () => {
  const srv = await startServer();
  const instanceId = uid("bind");
  const namespace = uid("ns");
  const holder = ownSim(srv, instanceId, namespace);
  const intruder = ownSim(srv, instanceId, namespace);
  try {
    // The holder registers, then opens its session with the token it was answered.
    await holder.sim.register();
    const own = holder.client.openSession(instanceId);
    await until(
      "the holder's session taken",
      async () => (await srv.metric("pegaflow_sessions")) === 1,
    );
    // The other engine opens its session first (and would register after it).
    const stray = intruder.client.openSession(instanceId);
    assert.ok(await settlesWithin(stray.closed, 10_000), "the other engine's session was taken");
    assert.equal(stray.error?.codeName, "FAILED_PRECONDITION", String(stray.error));
    assert.match(
      stray.error?.details ?? "",
      new RegExp(`instance "${instanceId}" tp_rank 0 pp_rank 0 is registered`),
    );
    await assert.rejects(intruder.sim.register(), refusedWith("FAILED_PRECONDITION"));
    // The holder's session was not superseded, and the refused one's end cleaned nothing up.
    assert.deepEqual(own.events, [], "the holder's session got no event");
    assert.equal(own.error, undefined);
    assert.deepEqual(await instanceIds(srv), [instanceId]);
    const hashes = chainedBlockHashes(syntheticTokens(8, 16 * 2), 16);
    holder.sim.fill([0, 1], hashes);
    assert.equal((await holder.sim.save([0, 1], hashes)).blocksSaved, 2);
    // The holder's own session still cleans it up when it ends.
    own.close();
    await until("instance gone", async () => (await instanceIds(srv)).length === 0);
  } finally {
    holder.close();
    intruder.close();
    await srv.stop();
  }
});

Deno.test("a session presents its registration's token: a wrong or stale token is refused, the right one supersedes", async () => {
  const srv = await startServer();
  const instanceId = uid("token");
  const namespace = uid("ns");
  const holder = ownSim(srv, instanceId, namespace);
  const other = new PegaflowClient(srv.grpc);
  try {
    const r = await holder.sim.register();
    assert.match(r.registrationToken, /^[0-9a-f]{32}$/, "RegisterContext answers a token");
    // The SDK opens the session with the token its registration answered.
    const own = holder.client.openSession(instanceId);
    // Another registration's token (or a made-up one) does not stand for this rank.
    const wrong = other.openSession(instanceId, 0, 0, { registrationToken: "0".repeat(32) });
    assert.ok(await settlesWithin(wrong.closed, 10_000));
    assert.equal(wrong.error?.codeName, "FAILED_PRECONDITION");
    assert.match(
      wrong.error?.details ?? "",
      new RegExp(
        `instance "${instanceId}" tp_rank 0 pp_rank 0 is registered by another registration`,
      ),
    );
    // The same registration's token, from another connection, supersedes: it is the holder's.
    const again = other.openSession(instanceId, 0, 0, { registrationToken: r.registrationToken });
    assert.equal((await own.closed)?.kind, 1 /* SUPERSEDED */);
    assert.deepEqual(await instanceIds(srv), [instanceId]);
    // The same registration again (ALREADY_EXISTS) names the token, for a holder whose answer was lost.
    await assert.rejects(
      holder.sim.register(),
      refusedWith("ALREADY_EXISTS", new RegExp(`registration token ${r.registrationToken}`)),
    );
    await srv.client.unregisterContext(instanceId);
    assert.equal((await again.closed)?.kind, 2 /* CLEANED_UP */);
    // A token of a registration that ended does not open a session for the rank.
    const stale = other.openSession(instanceId, 0, 0, { registrationToken: r.registrationToken });
    assert.ok(await settlesWithin(stale.closed, 10_000));
    assert.equal(stale.error?.codeName, "FAILED_PRECONDITION");
    assert.match(
      stale.error?.details ?? "",
      new RegExp(`instance "${instanceId}" tp_rank 0 pp_rank 0 is not registered`),
    );
  } finally {
    holder.close();
    other.close();
    await srv.stop();
  }
});

Deno.test("a registered rank that never opens its session is cleaned up after the grace period", async () => {
  const env = { PEGAFLOW_SESSION_GRACE_MS: String(SHORT_GRACE_MS) };
  const srv = await startServer([], env);
  const instanceId = uid("grace");
  const namespace = uid("ns");
  const dead = hostSim(srv, { instanceId, namespace, model: MODEL, numBlocks: 16 });
  const kept = uid("kept");
  const live = hostSim(srv, { instanceId: kept, namespace, model: MODEL, numBlocks: 16 });
  const restarted = ownSim(srv, instanceId, namespace);
  try {
    // An engine that registers and dies before its session opens.
    await dead.register();
    // One that registers and opens its session stays past the grace period.
    await live.register();
    const session = srv.client.openSession(kept);
    // The restarted engine is refused while the dead one holds the rank ...
    await assert.rejects(restarted.sim.register(), refusedWith("FAILED_PRECONDITION"));
    // ... and registers once the grace period has reaped it.
    await until(
      "the session-less registration reaped",
      async () => !(await instanceIds(srv)).includes(instanceId),
    );
    const line = srv.logs().find((l) => l.includes("never opened its session"));
    assert.ok(line, "the reaping is logged");
    const fields = JSON.parse(line);
    assert.equal(fields.instance, instanceId);
    assert.equal(fields.tp_rank, 0);
    assert.equal(fields.pp_rank, 0);
    assert.equal(
      await srv.metric("pegaflow_instance_cleanups_total", '{reason="session_never_opened"}'),
      1,
    );
    const r = await restarted.sim.register();
    assert.equal(r.topologySealed, true);
    const own = restarted.client.openSession(instanceId);
    await new Promise((res) => setTimeout(res, 2 * SHORT_GRACE_MS));
    assert.deepEqual((await instanceIds(srv)).sort(), [instanceId, kept].sort());
    assert.deepEqual(session.events, []);
    own.close();
    session.close();
  } finally {
    dead.close();
    live.close();
    restarted.close();
    await srv.stop();
  }
});

Deno.test("a session opened before its registration is ended by it, and the session opened after with its token stands (no reaping)", async () => {
  const env = { PEGAFLOW_SESSION_GRACE_MS: String(SHORT_GRACE_MS) };
  const srv = await startServer([], env);
  const instanceId = uid("early");
  const sim = hostSim(srv, { instanceId, namespace: uid("ns"), model: MODEL, numBlocks: 16 });
  try {
    // The old order (session, then RegisterContext): the token-less session stands for no
    // registration (tests/server/session_token_review_test.ts), so the registration ends it ...
    const early = srv.client.openSession(instanceId);
    await until(
      "the early session taken",
      async () => (await srv.metric("pegaflow_sessions")) === 1,
    );
    await sim.register();
    assert.ok(await settlesWithin(early.closed, 10_000), "the early session was adopted");
    assert.equal(early.error?.codeName, "FAILED_PRECONDITION", String(early.error));
    // ... and the client kept the token: the session it opens now presents it and stands.
    const own = srv.client.openSession(instanceId);
    await new Promise((res) => setTimeout(res, 2 * SHORT_GRACE_MS));
    assert.deepEqual(await instanceIds(srv), [instanceId], "not reaped: it has its session");
    await closeStandingSession(srv, own);
  } finally {
    sim.close();
    await srv.stop();
  }
});

Deno.test("a session opened before registering, for a rank the instance then does not have, cleans nothing up when it ends", async () => {
  const srv = await startServer();
  const instanceId = uid("stray");
  const holder = ownSim(srv, instanceId, uid("ns"));
  const other = new PegaflowClient(srv.grpc);
  try {
    // A session (no token) for tp_rank 1 of an instance not registered yet is taken ...
    const stray = other.openSession(instanceId, 1, 0);
    await until(
      "the early session taken",
      async () => (await srv.metric("pegaflow_sessions")) === 1,
    );
    // ... and the instance then registers with tp_size 1 and opens its own session.
    await holder.sim.register();
    const own = holder.client.openSession(instanceId);
    await until("both sessions open", async () => (await srv.metric("pegaflow_sessions")) === 2);
    // The stray session stood for no registered rank: its end must not clean the instance up.
    stray.close();
    await settlesWithin(stray.closed, 10_000);
    await until(
      "the stray session gone",
      async () => (await srv.metric("pegaflow_sessions")) <= 1,
    );
    await new Promise((res) => setTimeout(res, 300));
    assert.deepEqual(await instanceIds(srv), [instanceId]);
    assert.deepEqual(own.events, [], "the holder's session got no event");
    const lost = await srv.metric("pegaflow_instance_cleanups_total", '{reason="session_lost"}');
    assert.ok(!(lost > 0), `cleanups for a lost session: ${lost}`);
    // The holder's own session still cleans it up when it ends.
    own.close();
    await until("instance gone", async () => (await instanceIds(srv)).length === 0);
  } finally {
    holder.close();
    other.close();
    await srv.stop();
  }
});

/**
 * A TCP relay to `target` that can be cut: while cut it closes every connection (the relayed
 * ones too), as a network blip between an engine and a server that stays up.
 */
function cuttableRelay(target: string) {
  const [hostname, port] = [target.slice(0, target.lastIndexOf(":")), target.split(":").at(-1)];
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const open = new Set<Deno.Conn>();
  let cut = false;
  const drop = (c: Deno.Conn) => {
    open.delete(c);
    try {
      c.close();
    } catch { /* closed already: the other side of the pipe went first */ }
  };
  (async () => {
    for await (const conn of listener) {
      if (cut) {
        drop(conn);
        continue;
      }
      const up = await Deno.connect({ hostname, port: Number(port) });
      open.add(conn).add(up);
      const pipe = (a: Deno.Conn, b: Deno.Conn) =>
        a.readable.pipeTo(b.writable).catch(() => {}).finally(() => (drop(a), drop(b)));
      pipe(conn, up);
      pipe(up, conn);
    }
  })().catch(() => {});
  return {
    address: `127.0.0.1:${(listener.addr as Deno.NetAddr).port}`,
    setCut(on: boolean) {
      cut = on;
      if (on) { for (const c of [...open]) drop(c); }
    },
    close() {
      this.setCut(true);
      listener.close();
    },
  };
}

Deno.test("a session that never reached the server keeps the token: the next one stands for the live registration", async () => {
  const srv = await startServer();
  const instanceId = uid("blip");
  const relay = cuttableRelay(srv.grpc);
  const client = new PegaflowClient(relay.address);
  const sim = SimEngine.create({
    client,
    instanceId,
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: 16,
    backend: "host",
  });
  try {
    await sim.register();
    // The connection drops before the session is opened: it fails without reaching the server,
    // whose registration (inside its grace period) is untouched.
    relay.setCut(true);
    const lost = client.openSession(instanceId);
    assert.ok(await settlesWithin(lost.closed, 10_000), "the session failed");
    assert.equal(lost.error?.codeName, "UNAVAILABLE", String(lost.error));
    assert.deepEqual(await instanceIds(srv), [instanceId]);
    relay.setCut(false);
    await until("the connection is back", () => client.health().then(() => true, () => false));
    // The next session presents the registration's token and is taken.
    const again = client.openSession(instanceId);
    await until("the session taken", async () => (await srv.metric("pegaflow_sessions")) === 1);
    await closeStandingSession(srv, again);
    // That session stood for the registration: its end forgot the token, so a session opened
    // before the next registration (the old order) carries none and is taken.
    const early = client.openSession(instanceId);
    await until(
      "the early session taken",
      async () => (await srv.metric("pegaflow_sessions")) === 1,
    );
    assert.equal(early.error, undefined, String(early.error));
    early.close();
  } finally {
    sim.close();
    client.close();
    relay.close();
    await srv.stop();
  }
});
