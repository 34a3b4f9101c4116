/**
 * Decode failures after the hand-off: a decode engine that dies mid-stream (with either relay), and
 * one that answers with response headers too large to parse.
 *
 * The router and the well-behaved engines are real processes (harness.ts); the engine that sends
 * oversized headers is a raw TCP server in this process, so it can write exactly those bytes.
 */

import assert from "node:assert/strict";
import OpenAI from "openai";
import { metricValue, spawnBackend, spawnRouter, waitFor } from "./harness.ts";

const enc = new TextEncoder();
const dec = new TextDecoder();

/** Reads an SSE body until it has `n` events, then hands back the reader and what came so far. */
async function readEvents(
  res: Response,
  n: number,
): Promise<{ reader: ReadableStreamDefaultReader<Uint8Array>; text: string }> {
  const reader = res.body!.getReader();
  let text = "";
  while (text.split("\n\n").length - 1 < n) {
    const r = await reader.read();
    if (r.done) throw new Error(`stream ended after ${text.length} bytes: ${text}`);
    text += dec.decode(r.value);
  }
  return { reader, text };
}

/** Reads the rest of a body: its text and whether the read failed (a broken stream). */
async function readRest(
  reader: ReadableStreamDefaultReader<Uint8Array>,
): Promise<{ text: string; error: unknown }> {
  let text = "";
  try {
    for (;;) {
      const r = await reader.read();
      if (r.done) return { text, error: null };
      text += dec.decode(r.value);
    }
  } catch (e) {
    return { text, error: e };
  }
}

async function settled(routerUrl: string): Promise<string> {
  let text = "";
  await waitFor("nothing in flight", async () => {
    text = await (await fetch(`${routerUrl}/metrics`)).text();
    return metricValue(text, "pegaflow_router_inflight_requests") === 0 &&
      metricValue(text, "pegaflow_router_backend_inflight", { role: "decode" }) === 0;
  });
  return text;
}

for (const inspecting of [false, true]) {
  const relay = inspecting ? "--stream-idle-timeout" : "default relay";
  Deno.test(
    `a decode engine that dies mid-stream ends the client's stream with an error event (${relay})`,
    async () => {
      const [p, d] = await Promise.all([spawnBackend("P"), spawnBackend("D")]);
      const router = await spawnRouter([
        "--prefill",
        p.url,
        "--decode",
        d.url,
        "--health-interval",
        "1h",
        ...(inspecting ? ["--stream-idle-timeout", "30s"] : []),
      ]);
      try {
        // D sends its first event, then waits at the gate until it is killed.
        await d.control({ chunks: 3, gate: true });
        const res = await fetch(`${router.url}/v1/completions`, {
          method: "POST",
          headers: { "content-type": "application/json", "x-request-id": "dies-mid-stream" },
          body: JSON.stringify({ model: "m", prompt: "hi", stream: true }),
        });
        assert.equal(res.status, 200);
        const { reader, text: first } = await readEvents(res, 1);
        assert.match(first, /"text":"tok0 "/);
        await d.stop();

        const { text, error } = await readRest(reader);
        assert.equal(error, null, `the stream must end cleanly, got ${error}; read: ${text}`);
        const last = text.trim().split("\n\n").at(-1) ?? "";
        assert.ok(last.startsWith("data: "), `a final SSE event: ${text}`);
        const e = (JSON.parse(last.slice(6)) as {
          error: { message: string; type: string; code: string };
        }).error;
        assert.equal(e.code, "decode_failed");
        assert.equal(e.type, "server_error");
        assert.ok(e.message.includes(d.url), `names the decode backend: ${e.message}`);
        assert.ok(e.message.includes("dies-mid-stream"), `names the request: ${e.message}`);

        const m = await settled(router.url);
        assert.equal(
          metricValue(m, "pegaflow_router_upstream_failures_total", {
            role: "decode",
            reason: "network",
          }),
          1,
          m,
        );
        assert.match(router.stderr(), /decode stream cut short.*dies-mid-stream/);
      } finally {
        await router.stop();
        await Promise.all([p.stop(), d.stop()]);
      }
    },
  );
}

Deno.test("an openai client reads a decode engine's death as an APIError naming the backend", async () => {
  const [p, d] = await Promise.all([spawnBackend("P"), spawnBackend("D")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url]);
  const client = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: "k", maxRetries: 0 });
  try {
    await d.control({ chunks: 3, gate: true });
    const stream = await client.completions.create({ model: "m", prompt: "hi", stream: true });
    const got: string[] = [];
    const err = await (async () => {
      for await (const c of stream) {
        got.push(c.choices[0].text);
        await d.stop();
      }
    })().then(() => assert.fail("expected the stream to fail"), (e) => e);
    assert.deepEqual(got, ["tok0 "]);
    assert.ok(err instanceof OpenAI.APIError, `an APIError, got ${err}`);
    assert.match(String(err.message), new RegExp(`decode backend ${d.url} failed mid-response`));
  } finally {
    await router.stop();
    await Promise.all([p.stop(), d.stop()]);
  }
});

/** A decode engine that answers every generation request with 1 MiB of response headers. */
function hugeHeaderEngine(): { url: string; seen: string[]; stop: () => Promise<void> } {
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const seen: string[] = [];
  const serve = async (conn: Deno.Conn) => {
    let head = "";
    const buf = new Uint8Array(64 * 1024);
    while (!head.includes("\r\n\r\n")) {
      const n = await conn.read(buf);
      if (n === null) return;
      head += dec.decode(buf.subarray(0, n));
    }
    const length = Number(/content-length: *(\d+)/i.exec(head)?.[1] ?? "0");
    while (head.length - head.indexOf("\r\n\r\n") - 4 < length) {
      const n = await conn.read(buf);
      if (n === null) return;
      head += dec.decode(buf.subarray(0, n));
    }
    const answer = head.startsWith("GET")
      ? "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
      : (seen.push(/x-request-id: *(\S+)/i.exec(head)?.[1] ?? ""),
        `HTTP/1.1 200 OK\r\nx-big: ${"x".repeat(1 << 20)}\r\ncontent-length: 2\r\n` +
        "connection: close\r\n\r\n{}");
    let bytes = enc.encode(answer);
    while (bytes.length > 0) bytes = bytes.subarray(await conn.write(bytes));
  };
  const loop = (async () => {
    for await (const conn of listener) {
      serve(conn).catch(() => {}).finally(() => conn.close());
    }
  })();
  return {
    url: `http://127.0.0.1:${listener.addr.port}`,
    seen,
    stop: async () => {
      listener.close();
      await loop.catch(() => {});
    },
  };
}

Deno.test("a decode engine whose response headers are too large is not retried on itself", async () => {
  const p = await spawnBackend("P");
  const d = hugeHeaderEngine();
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url]);
  try {
    const res = await fetch(`${router.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", "x-request-id": "huge-head" },
      body: JSON.stringify({ model: "m", prompt: "hi" }),
    });
    const body = await res.json() as { error: { message: string; code: string } };
    assert.equal(res.status, 502);
    assert.equal(res.headers.get("x-request-id"), "huge-head");
    assert.equal(body.error.code, "decode_unavailable");
    assert.ok(body.error.message.includes(d.url), body.error.message);
    assert.ok(body.error.message.includes("huge-head"), body.error.message);
    assert.match(body.error.message, /message head is too large/);
    assert.deepEqual(d.seen, ["huge-head"], "D was tried once");
    const m = await settled(router.url);
    assert.equal(metricValue(m, "pegaflow_router_retries_total", { role: "decode" }), 0);
    assert.equal(
      metricValue(m, "pegaflow_router_upstream_failures_total", {
        role: "decode",
        reason: "bad_response",
      }),
      1,
    );
  } finally {
    await router.stop();
    await Promise.all([p.stop(), d.stop()]);
  }
});

Deno.test("a decode engine whose response headers are too large: the retry goes to another D", async () => {
  const [p, good] = await Promise.all([spawnBackend("P"), spawnBackend("D-good")]);
  const bad = hugeHeaderEngine();
  const router = await spawnRouter(["--prefill", p.url, "--decode", bad.url, "--decode", good.url]);
  try {
    // Ties rotate, so some of these pick the bad D first.
    for (let i = 0; i < 4; i++) {
      const res = await fetch(`${router.url}/v1/completions`, {
        method: "POST",
        headers: { "content-type": "application/json", "x-request-id": `huge-${i}` },
        body: JSON.stringify({ model: "m", prompt: "hi" }),
      });
      assert.equal(res.status, 200, await res.clone().text());
      assert.match(await res.text(), /D-good says hello/);
    }
    assert.ok(bad.seen.length >= 1, "the bad D was picked at least once");
    assert.equal(new Set(bad.seen).size, bad.seen.length, "no request reached the bad D twice");
    const m = await settled(router.url);
    assert.equal(
      metricValue(m, "pegaflow_router_retries_total", { role: "decode", reason: "bad_response" }),
      bad.seen.length,
    );
  } finally {
    await router.stop();
    await Promise.all([p.stop(), good.stop(), bad.stop()]);
  }
});
