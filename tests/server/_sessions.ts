/**
 * What the session tests share: a small model, a short grace period, the
 * server's instance list, a polling wait, and a simulated engine on its own
 * connection (its own registration tokens).
 */
import assert from "node:assert/strict";
import { PegaflowClient } from "../../lib/client/client.ts";
import { LLAMA_3_1_8B, SimEngine } from "../../lib/client/sim_engine.ts";
import { type ServerProc, uid } from "./harness.ts";

export const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };
/** A grace period short enough for a test, long enough for a loaded 2-core machine's round trips. */
export const SHORT_GRACE_MS = 1500;

/** The instance ids the server's `/instances` lists. */
export async function instanceIds(srv: ServerProc): Promise<string[]> {
  const j = await (await srv.http_get("/instances")).json();
  return j.instances.map((i: { instanceId: string }) => i.instanceId);
}

/** Polls `cond` every 50 ms until it holds; throws naming `what` after `timeoutMs`. */
export async function until(what: string, cond: () => Promise<boolean>, timeoutMs = 20_000) {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** A simulated engine with its own connection (its own registration tokens). */
export function ownSim(srv: ServerProc, instanceId: string, namespace: string = uid("ns")) {
  const client = new PegaflowClient(srv.grpc);
  const sim = SimEngine.create({
    client,
    instanceId,
    namespace,
    model: MODEL,
    numBlocks: 16,
    backend: "host",
  });
  return {
    client,
    sim,
    close() {
      sim.close();
      client.close();
    },
  };
}

/**
 * `session` stands for its registration (no event, no error so far), and its end cleans
 * the instance up: the server lists no instance once it is closed.
 */
export async function closeStandingSession(
  srv: ServerProc,
  session: ReturnType<PegaflowClient["openSession"]>,
) {
  assert.deepEqual(session.events, []);
  assert.equal(session.error, undefined, String(session.error));
  session.close();
  await until(
    "instance gone with its session",
    async () => (await instanceIds(srv)).length === 0,
  );
}
