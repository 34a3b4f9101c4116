/** Upstream signal plumbing and failure classification. */

import assert from "node:assert/strict";
import { badRequest, errorResponse, RouterError } from "../../lib/router/errors.ts";
import { classifyNetworkError, UpstreamLink } from "../../lib/router/upstream.ts";

Deno.test("a link aborts with the first cause: client, deadline or the router's own", async () => {
  const client = new AbortController();
  const a = new UpstreamLink(client.signal);
  client.abort();
  assert.equal(a.cause, "client_gone");
  assert.ok(a.signal.aborted);
  a.dispose();

  const b = new UpstreamLink(new AbortController().signal, 10);
  await new Promise((r) => setTimeout(r, 40));
  assert.equal(b.cause, "timeout");
  b.abort("idle_timeout");
  assert.equal(b.cause, "timeout", "the first cause wins");
  b.dispose();

  const c = new UpstreamLink(new AbortController().signal, 10);
  c.clearDeadline();
  await new Promise((r) => setTimeout(r, 40));
  assert.equal(c.cause, null, "a cleared deadline does not fire");
  c.dispose();
});

Deno.test("a link made under an already-gone client is aborted at once", () => {
  const client = new AbortController();
  client.abort();
  const l = new UpstreamLink(client.signal, 1000);
  assert.equal(l.cause, "client_gone");
  l.dispose();
});

Deno.test("a refused connection is told apart from a reset one", async () => {
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const port = listener.addr.port;
  listener.close();
  const refused = await fetch(`http://127.0.0.1:${port}/`).then(() => null, (e) => e);
  assert.equal(classifyNetworkError(refused), "connect");

  // A server that accepts and closes at once: the request was sent, the answer never came.
  const rude = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const accepting = (async () => {
    for await (const conn of rude) conn.close();
  })();
  const reset = await fetch(`http://127.0.0.1:${rude.addr.port}/`).then(() => null, (e) => e);
  assert.equal(classifyNetworkError(reset), "network");
  rude.close();
  await accepting.catch((e) => assert.ok(e instanceof Deno.errors.BadResource, String(e)));
});

Deno.test("errors render as OpenAI error bodies with the status and request id", async () => {
  const res = errorResponse(badRequest("'model' is required", "model", "missing_model"), "r-1");
  assert.equal(res.status, 400);
  assert.equal(res.headers.get("x-request-id"), "r-1");
  assert.deepEqual(await res.json(), {
    error: {
      message: "'model' is required",
      type: "invalid_request_error",
      param: "model",
      code: "missing_model",
    },
  });
  const e = new RouterError(503, "server_error", "no backend");
  assert.deepEqual(e.toBody().error, {
    message: "no backend",
    type: "server_error",
    param: null,
    code: null,
  });
});

Deno.test("an answer that is not a usable HTTP response head is told apart from a reset", async () => {
  const answers = [
    `HTTP/1.1 200 OK\r\nx-big: ${"x".repeat(1 << 20)}\r\ncontent-length: 2\r\n\r\n{}`,
    "HELLO I AM NOT HTTP\r\n\r\n",
    "HTTP/1.1 200 OK\r\ncontent-length: many\r\n\r\n",
  ];
  for (const answer of answers) {
    const server = Deno.listen({ hostname: "127.0.0.1", port: 0 });
    const serving = (async () => {
      const conn = await server.accept();
      await conn.read(new Uint8Array(64 * 1024));
      let bytes = new TextEncoder().encode(answer);
      while (bytes.length > 0) bytes = bytes.subarray(await conn.write(bytes));
      conn.close();
    })();
    const err = await fetch(`http://127.0.0.1:${server.addr.port}/`, { method: "POST", body: "x" })
      .then(() => null, (e) => e);
    await serving.catch(() => {});
    server.close();
    assert.equal(classifyNetworkError(err), "bad_response", `${answer.slice(0, 30)}: ${err}`);
  }
});
