/**
 * The P/D hand-off end to end: a real router process between the `openai` client and two fake
 * engine processes (one prefill, one decode), all on ephemeral loopback ports.
 */

import assert from "node:assert/strict";
import OpenAI from "openai";
import { type FakeBackend, metricValue, spawnBackend, spawnRouter, waitFor } from "./harness.ts";

const API_KEY = "test-key";

Deno.test("router splits each request between prefill and decode", async (t) => {
  const p = await spawnBackend("P0");
  const d = await spawnBackend("D0");
  const router = await spawnRouter([
    "--prefill",
    p.url,
    "--decode",
    d.url,
    "--health-interval",
    "200ms",
  ]);
  const client = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: API_KEY, maxRetries: 0 });
  const last = async (b: FakeBackend) => (await b.requests()).at(-1)!;
  try {
    await t.step(
      "a completion goes to P with max_tokens=1 and no stream, then to D as sent, with P's kv_transfer_params",
      async () => {
        const { data, response } = await client.completions.create(
          { model: "m", prompt: "The capital of France is", max_tokens: 7, temperature: 0 },
          { headers: { "X-Request-Id": "req-flow-1" } },
        ).withResponse();
        assert.equal(response.headers.get("x-request-id"), "req-flow-1");
        assert.equal(data.choices[0].text, "D0 says hello");
        assert.equal(data.id, "cmpl-req-flow-1");

        const [pr, dr] = [await p.requests(), await d.requests()];
        assert.equal(pr.length, 1);
        assert.equal(dr.length, 1);
        assert.equal(pr[0].requestId, "req-flow-1");
        assert.equal(dr[0].requestId, "req-flow-1");
        assert.deepEqual(pr[0].body, {
          model: "m",
          prompt: "The capital of France is",
          max_tokens: 1,
          temperature: 0,
          stream: false,
          kv_transfer_params: {
            do_remote_decode: true,
            do_remote_prefill: false,
            remote_engine_id: null,
            remote_block_ids: null,
            remote_host: null,
            remote_port: null,
          },
        });
        // D gets the client's request untouched plus what P said about where its KV is.
        assert.deepEqual(dr[0].body, {
          model: "m",
          prompt: "The capital of France is",
          max_tokens: 7,
          temperature: 0,
          kv_transfer_params: {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_engine_id: "P0",
            remote_block_ids: [pr[0].seq, pr[0].seq + 1000],
            remote_host: "127.0.0.1",
            remote_port: p.port,
            remote_request_id: "req-flow-1",
          },
        });
        // P had answered before D heard of the request.
        assert.ok(pr[0].finishedAt! <= dr[0].receivedAt, "P finished before D was called");
        assert.equal(pr[0].authorization, `Bearer ${API_KEY}`);
        assert.equal(dr[0].authorization, `Bearer ${API_KEY}`);
      },
    );

    await t.step(
      "a chat request caps max_completion_tokens at 1 on P and keeps it on D",
      async () => {
        const data = await client.chat.completions.create({
          model: "m",
          messages: [{ role: "user", content: "hi" }],
          max_completion_tokens: 9,
        });
        assert.equal(data.choices[0].message.content, "D0 says hello");
        const [pr, dr] = [await last(p), await last(d)];
        assert.equal(pr.path, "/v1/chat/completions");
        assert.equal(pr.body.max_completion_tokens, 1);
        assert.equal(pr.body.max_tokens, 1);
        assert.equal(pr.body.stream, false);
        assert.equal(dr.body.max_completion_tokens, 9);
        assert.equal(dr.body.max_tokens, undefined);
        assert.equal(pr.requestId, dr.requestId);
      },
    );

    await t.step(
      "without X-Request-Id the router makes one, uses it on P and D, and returns it",
      async () => {
        const res = await fetch(`${router.url}/v1/completions`, {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ model: "m", prompt: "x" }),
        });
        assert.equal(res.status, 200);
        await res.json();
        const id = res.headers.get("x-request-id");
        assert.match(id ?? "", /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/);
        assert.equal((await last(p)).requestId, id);
        assert.equal((await last(d)).requestId, id);
      },
    );

    await t.step(
      "a streamed completion arrives whole; P saw stream=false without stream_options",
      async () => {
        await d.control({ chunks: 6, chunkDelayMs: 0 });
        const stream = await client.completions.create({
          model: "m",
          prompt: "count",
          max_tokens: 6,
          stream: true,
          stream_options: { include_usage: true },
        });
        const texts: string[] = [];
        for await (const chunk of stream) texts.push(chunk.choices[0].text);
        assert.deepEqual(texts, ["tok0 ", "tok1 ", "tok2 ", "tok3 ", "tok4 ", "tok5 "]);
        const [pr, dr] = [await last(p), await last(d)];
        assert.equal(pr.body.stream, false);
        assert.equal("stream_options" in pr.body, false);
        assert.equal(dr.body.stream, true);
        assert.deepEqual(dr.body.stream_options, { include_usage: true });
      },
    );

    await t.step(
      "streamed chunks reach the client as D sends them, not when D is done",
      async () => {
        // D sends one chunk, then holds the rest until released: a buffering relay would never
        // deliver that first chunk.
        await d.control({ chunks: 4, gate: true });
        const stream = await client.chat.completions.create({
          model: "m",
          messages: [{ role: "user", content: "stream please" }],
          stream: true,
        });
        const it = stream[Symbol.asyncIterator]();
        const first = await it.next();
        assert.equal(first.done, false);
        assert.equal(first.value.choices[0].delta.content, "tok0 ");
        const held = await last(d);
        assert.equal(held.chunksSent, 1, "D has sent only the first chunk so far");
        assert.equal(held.finishedAt, null);
        await d.release();
        const rest: string[] = [];
        for (let r = await it.next(); !r.done; r = await it.next()) {
          rest.push(r.value.choices[0].delta.content ?? "");
        }
        assert.deepEqual(rest, ["tok1 ", "tok2 ", "tok3 "]);
        await d.control({ gate: false });
      },
    );

    await t.step(
      "an error from P (not transient) is the client's answer and D is not called",
      async () => {
        const before = (await d.requests()).length;
        await p.control({ failNext: 1, failStatus: 400 });
        const err = await client.completions.create({ model: "m", prompt: "x" }).then(
          () => assert.fail("expected an error"),
          (e) => e,
        );
        assert.ok(err instanceof OpenAI.BadRequestError, String(err));
        assert.match(err.message, /P0 is failing on purpose/);
        assert.equal((await d.requests()).length, before);
      },
    );

    await t.step(
      "GET /v1/models lists the backends' models; /health reports both pools",
      async () => {
        const models = await client.models.list();
        assert.deepEqual(models.data.map((m) => m.id), ["fake-model"]);
        const health = await (await fetch(`${router.url}/health`)).json();
        assert.equal(health.status, "ok");
        assert.equal(health.prefill.healthy, 1);
        assert.equal(health.decode.backends[0].url, d.url);
      },
    );

    await t.step(
      "/metrics counts requests by route and status and times P, D and the whole",
      async () => {
        const m = await router.metrics();
        assert.equal(
          metricValue(m, "pegaflow_router_requests_total", {
            route: "/v1/completions",
            status: "200",
          }),
          3,
        );
        assert.equal(
          metricValue(m, "pegaflow_router_requests_total", {
            route: "/v1/chat/completions",
            status: "200",
          }),
          2,
        );
        assert.equal(
          metricValue(m, "pegaflow_router_requests_total", {
            route: "/v1/completions",
            status: "400",
          }),
          1,
        );
        assert.equal(
          metricValue(m, "pegaflow_router_prefill_duration_seconds_count", { backend: p.url }),
          6,
        );
        assert.equal(
          metricValue(m, "pegaflow_router_decode_ttfb_seconds_count", { backend: d.url }),
          5,
        );
        assert.equal(
          metricValue(m, "pegaflow_router_request_duration_seconds_count", {
            route: "/v1/completions",
          }),
          4,
        );
        assert.equal(
          metricValue(m, "pegaflow_router_backend_healthy", { role: "decode", backend: d.url }),
          1,
        );
        assert.equal(metricValue(m, "pegaflow_router_inflight_requests"), 0);
        assert.equal(
          metricValue(m, "pegaflow_router_backend_inflight", { role: "prefill", backend: p.url }),
          0,
        );
      },
    );

    await t.step(
      "a client that leaves mid-stream stops D (default relay) and is counted as 499",
      async () => {
        await d.control({ chunks: 500, chunkDelayMs: 10 });
        const stream = await client.completions.create({
          model: "m",
          prompt: "long",
          stream: true,
        });
        const it = stream[Symbol.asyncIterator]();
        assert.equal((await it.next()).done, false);
        stream.controller.abort();
        await waitFor("D's stream cancelled", async () => (await last(d)).cancelled);
        assert.ok((await last(d)).chunksSent < 500);
        await waitFor("499 counted and D released", async () => {
          const m = await router.metrics();
          return metricValue(m, "pegaflow_router_requests_total", {
                route: "/v1/completions",
                status: "499",
              }) === 1 &&
            metricValue(m, "pegaflow_router_backend_inflight", {
                role: "decode",
                backend: d.url,
              }) === 0;
        });
        await d.control({ chunks: 5, chunkDelayMs: 0 });
      },
    );
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});

Deno.test("without --unstable-no-legacy-abort served streams still count as 200, with a warning", async () => {
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D0")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url], {}, {
    legacyAbort: true,
  });
  try {
    const client = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: API_KEY, maxRetries: 0 });
    const stream = await client.completions.create({ model: "m", prompt: "x", stream: true });
    let n = 0;
    for await (const _ of stream) n++;
    assert.equal(n, 5);
    await waitFor(
      "request counted",
      async () =>
        metricValue(await router.metrics(), "pegaflow_router_requests_total", {
          route: "/v1/completions",
          status: "200",
        }) === 1,
    );
    const m = await router.metrics();
    assert.equal(
      metricValue(m, "pegaflow_router_requests_total", { route: "/v1/completions", status: "499" }),
      0,
    );
    assert.match(router.stderr(), /legacy behaviour/);
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});

/**
 * A decode engine behind a compressing proxy: it gzips every answer whose request offers gzip
 * (JSON and SSE alike) and answers plainly otherwise.
 */
function compressingDecode() {
  const enc = new TextEncoder();
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
    if (new URL(req.url).pathname === "/health") return new Response("ok");
    const body = await req.json() as { stream?: boolean };
    const gzip = (req.headers.get("accept-encoding") ?? "").includes("gzip");
    const parts = body.stream === true
      ? [0, 1, 2].map((i) =>
        `data: ${
          JSON.stringify({
            id: "c",
            object: "text_completion",
            choices: [{ index: 0, text: `z${i}` }],
          })
        }\n\n`
      ).concat("data: [DONE]\n\n")
      : [JSON.stringify({
        id: "c",
        object: "text_completion",
        choices: [{ index: 0, text: "plain text", finish_reason: "length" }],
      })];
    const stream = ReadableStream.from(parts.map((p) => enc.encode(p)));
    const headers: Record<string, string> = {
      "content-type": body.stream === true ? "text/event-stream" : "application/json",
    };
    if (!gzip) return new Response(stream, { headers });
    headers["content-encoding"] = "gzip";
    return new Response(stream.pipeThrough(new CompressionStream("gzip")), { headers });
  });
  return { url: `http://127.0.0.1:${server.addr.port}`, stop: () => server.shutdown() };
}

Deno.test("a decode engine that would compress its answers still reaches the client readable", async () => {
  const p = await spawnBackend("P0");
  const d = compressingDecode();
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url]);
  try {
    const client = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: API_KEY, maxRetries: 0 });
    const { data, response } = await client.completions.create({ model: "m", prompt: "x" })
      .withResponse();
    assert.equal(data.choices[0].text, "plain text");
    assert.equal(response.headers.get("content-encoding"), null);
    const stream = await client.completions.create({ model: "m", prompt: "x", stream: true });
    const got: string[] = [];
    for await (const c of stream) got.push(c.choices[0].text);
    assert.deepEqual(got, ["z0", "z1", "z2"]);
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});

Deno.test("an engine's 500 goes to the client as it is; the log says which phase and engine", async () => {
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D0")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url]);
  const logged = (requestId: string) =>
    router.stderr().split("\n").filter((l) => l.startsWith("{")).map((l) => JSON.parse(l))
      .filter((r) => r.request_id === requestId && r.msg === "backend answered with an error");
  try {
    await p.control({ failNext: 1, failStatus: 500 });
    await d.control({ failNext: 1, failStatus: 500 });
    for (const [id, role, backend] of [["p-500", "prefill", p], ["d-500", "decode", d]] as const) {
      const res = await fetch(`${router.url}/v1/completions`, {
        method: "POST",
        headers: { "x-request-id": id },
        body: JSON.stringify({ model: "m", prompt: "x" }),
      });
      assert.equal(res.status, 500);
      assert.equal(res.headers.get("x-request-id"), id);
      assert.match(await res.text(), /failing on purpose/);
      await waitFor(`the log line of ${id}`, () => logged(id).length === 1);
      const [line] = logged(id);
      assert.equal(line.level, "warn");
      assert.equal(line.role, role);
      assert.equal(line.backend, backend.url);
      assert.equal(line.status, 500);
    }
    assert.equal((await d.requests()).length, 1, "P's 500 was not sent on to D");
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});
