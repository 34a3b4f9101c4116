/**
 * Every unary call of the TS client has a deadline: a server that accepts the
 * connection and never answers (wedged) fails the call with DEADLINE_EXCEEDED,
 * over gRPC and over the local RPC socket alike, instead of hanging the caller.
 */
import assert from "node:assert/strict";
import { PegaflowClient, type PegaflowError } from "../../lib/client/client.ts";

/** Accepts connections and never writes a byte; returns a stop function. */
function silent(listener: Deno.Listener): () => Promise<void> {
  const held: Deno.Conn[] = [];
  const accepting = (async () => {
    try {
      for await (const c of listener) held.push(c);
    } catch {
      // closed
    }
  })();
  return async () => {
    listener.close();
    for (const c of held) c.close();
    await accepting;
  };
}

async function refusedWithDeadline(c: PegaflowClient, deadlineMs: number): Promise<void> {
  const t0 = performance.now();
  const err = await c.health().then(
    () => assert.fail("a silent server cannot answer"),
    (e) => e as PegaflowError,
  );
  const ms = performance.now() - t0;
  assert.equal(err.codeName, "DEADLINE_EXCEEDED", err.message);
  assert.ok(ms >= deadlineMs * 0.9, `failed after ${ms} ms, before its ${deadlineMs} ms deadline`);
}

Deno.test("a wedged server fails a gRPC call at its deadline", async () => {
  const l = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const stop = silent(l);
  const c = new PegaflowClient(`127.0.0.1:${(l.addr as Deno.NetAddr).port}`, { deadlineMs: 300 });
  try {
    await refusedWithDeadline(c, 300);
  } finally {
    c.close();
    await stop();
  }
});

Deno.test("a wedged local RPC socket fails a call at its deadline", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-deadline-" });
  const l = Deno.listen({ transport: "unix", path: `${dir}/pf.sock.rpc` });
  const stop = silent(l);
  const c = new PegaflowClient(`unix:${dir}/pf.sock`, { deadlineMs: 300 });
  try {
    await refusedWithDeadline(c, 300);
  } finally {
    c.close();
    await stop();
    await Deno.remove(dir, { recursive: true });
  }
});
