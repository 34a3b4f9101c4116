/**
 * Bad input never reaches a backend: every malformed request gets a 400 (a body over --max-body a
 * 413) with an OpenAI-style error naming the problem, and bad command-line values stop the router
 * before it listens.
 */

import assert from "node:assert/strict";
import OpenAI from "openai";
import { runRouterCli, spawnBackend, spawnRouter } from "./harness.ts";
import { brokenChunkedRequest, peakRssBytes, streamUpload } from "../http/raw_http.ts";

const MAX_BODY = 2048;

interface Case {
  name: string;
  path?: string;
  body: string | (() => ReadableStream<Uint8Array>);
  headers?: Record<string, string>;
  param: string | null;
  code: string;
  message: RegExp;
  /** HTTP status (400 unless given). */
  status?: number;
}

const big = "x".repeat(MAX_BODY);
const CASES: Case[] = [
  {
    name: "not JSON",
    body: "{model: m",
    param: null,
    code: "invalid_json",
    message: /not valid JSON/,
  },
  { name: "empty body", body: "", param: null, code: "invalid_json", message: /empty/ },
  {
    name: "a JSON array",
    body: "[1,2]",
    param: null,
    code: "invalid_json",
    message: /must be a JSON object, got an array/,
  },
  {
    name: "missing model",
    body: '{"prompt":"hi"}',
    param: "model",
    code: "missing_model",
    message: /'model' is required/,
  },
  {
    name: "model not a string",
    body: '{"model":7,"prompt":"hi"}',
    param: "model",
    code: "invalid_model",
    message: /non-empty string, got a number/,
  },
  {
    name: "missing prompt",
    body: '{"model":"m"}',
    param: "prompt",
    code: "missing_prompt",
    message: /'prompt' is required/,
  },
  {
    name: "empty prompt array",
    body: '{"model":"m","prompt":[]}',
    param: "prompt",
    code: "invalid_prompt",
    message: /'prompt' must be/,
  },
  {
    name: "missing messages",
    path: "/v1/chat/completions",
    body: '{"model":"m"}',
    param: "messages",
    code: "missing_messages",
    message: /'messages' is required/,
  },
  {
    name: "empty messages",
    path: "/v1/chat/completions",
    body: '{"model":"m","messages":[]}',
    param: "messages",
    code: "invalid_messages",
    message: /non-empty array, got an empty array/,
  },
  {
    name: "message without role",
    path: "/v1/chat/completions",
    body: '{"model":"m","messages":[{"content":"x"}]}',
    param: "messages[0]",
    code: "invalid_messages",
    message: /string 'role'/,
  },
  {
    name: "n > 1",
    body: '{"model":"m","prompt":"hi","n":2}',
    param: "n",
    code: "unsupported_n",
    message: /n > 1 is not supported.*n=2/,
  },
  {
    name: "n = 0",
    body: '{"model":"m","prompt":"hi","n":0}',
    param: "n",
    code: "invalid_n",
    message: /positive integer, got 0/,
  },
  {
    name: "stream not a boolean",
    body: '{"model":"m","prompt":"hi","stream":"yes"}',
    param: "stream",
    code: "invalid_stream",
    message: /must be a boolean/,
  },
  {
    name: "negative max_tokens",
    body: '{"model":"m","prompt":"hi","max_tokens":-1}',
    param: "max_tokens",
    code: "invalid_max_tokens",
    message: /positive integer, got -1/,
  },
  {
    name: "oversized body (Content-Length)",
    body: JSON.stringify({ model: "m", prompt: big }),
    param: null,
    code: "body_too_large",
    message: /larger than the limit of 2048 bytes \(raise it with --max-body\)/,
    status: 413,
  },
  {
    name: "oversized body (chunked, no Content-Length)",
    body: () =>
      new ReadableStream({
        start(c) {
          for (let i = 0; i < 8; i++) c.enqueue(new TextEncoder().encode(big.slice(0, 512)));
          c.close();
        },
      }),
    param: null,
    code: "body_too_large",
    message: /at least \d+ bytes, larger than the limit of 2048/,
    status: 413,
  },
  {
    name: "request id with spaces",
    body: '{"model":"m","prompt":"hi"}',
    headers: { "x-request-id": "has spaces" },
    param: null,
    code: "invalid_request_id",
    message: /X-Request-Id/,
  },
];

Deno.test("bad requests get a 400 (413 over --max-body) OpenAI error and nothing goes upstream", async (t) => {
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D0")]);
  // Backends and the body limit from the environment: the PEGAFLOW_ROUTER_* names work too.
  const router = await spawnRouter([], {
    PEGAFLOW_ROUTER_PREFILL: p.url,
    PEGAFLOW_ROUTER_DECODE: d.url,
    PEGAFLOW_ROUTER_MAX_BODY: String(MAX_BODY),
  });
  try {
    for (const c of CASES) {
      await t.step(c.name, async () => {
        const body = typeof c.body === "string" ? c.body : c.body();
        const res = await fetch(router.url + (c.path ?? "/v1/completions"), {
          method: "POST",
          headers: { "content-type": "application/json", ...c.headers },
          body,
        });
        const json = await res.json();
        assert.equal(res.status, c.status ?? 400, JSON.stringify(json));
        assert.equal(json.error.type, "invalid_request_error");
        assert.equal(json.error.param, c.param);
        assert.equal(json.error.code, c.code);
        assert.match(json.error.message, c.message);
      });
    }

    await t.step("the openai client sees n > 1 as a BadRequestError", async () => {
      const openai = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: "k", maxRetries: 0 });
      const err = await openai.chat.completions.create({
        model: "m",
        messages: [{ role: "user", content: "x" }],
        n: 3,
      }).then(() => assert.fail("expected 400"), (e) => e);
      assert.ok(err instanceof OpenAI.BadRequestError);
      assert.equal(err.param, "n");
      assert.equal(err.code, "unsupported_n");
    });

    await t.step("unknown routes and wrong methods are refused", async () => {
      const nf = await fetch(`${router.url}/v1/embeddings`, { method: "POST", body: "{}" });
      assert.equal(nf.status, 404);
      assert.equal((await nf.json()).error.code, "not_found");
      const na = await fetch(`${router.url}/v1/completions`);
      assert.equal(na.status, 405);
      assert.equal(na.headers.get("allow"), "POST");
      await na.body?.cancel();
    });

    await t.step("a broken chunked body is a 400 and a warning, not a 500", async () => {
      const a = await brokenChunkedRequest(router.port, "/v1/completions");
      assert.equal(a.status, 400, a.body);
      const err = JSON.parse(a.body).error;
      assert.equal(err.type, "invalid_request_error");
      assert.equal(err.code, "malformed_body");
      assert.match(err.message, /could not be read/);
      const lines = router.stderr().split("\n").filter((l) => l.startsWith("{"))
        .map((l) => JSON.parse(l));
      const refused = lines.filter((l) => l.code === "malformed_body");
      assert.equal(refused.length, 1, router.stderr());
      assert.equal(refused[0].level, "warn");
      assert.ok(!lines.some((l) => l.level === "error"), router.stderr());
    });

    await t.step("none of it reached a backend", async () => {
      assert.deepEqual(await p.requests(), []);
      assert.deepEqual(await d.requests(), []);
    });

    await t.step("a body just under the limit still goes through", async () => {
      const prompt = "y".repeat(MAX_BODY - 64);
      const res = await fetch(`${router.url}/v1/completions`, {
        method: "POST",
        body: JSON.stringify({ model: "m", prompt }),
      });
      assert.equal(res.status, 200);
      await res.json();
      assert.equal((await d.requests())[0].body.prompt, prompt);
    });
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});

Deno.test("bad command-line values stop the router before it starts, naming the flag", async () => {
  const ok = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"];
  const cases: Array<{ args: string[]; env?: Record<string, string>; flag: string; says: RegExp }> =
    [
      { args: [...ok, "--port", "70000"], flag: "--port", says: /0-65535, got 70000/ },
      {
        args: [...ok, "--prefill-timeout", "soon"],
        flag: "--prefill-timeout",
        says: /expected a duration/,
      },
      {
        args: [...ok, "--decode-timeout", "0s"],
        flag: "--decode-timeout",
        says: /greater than zero/,
      },
      { args: [...ok, "--max-body", "lots"], flag: "--max-body", says: /expected a size/ },
      {
        args: [...ok, "--log-level", "loud"],
        flag: "--log-level",
        says: /one of debug, info, warn, error/,
      },
      { args: [...ok, "--workers", "0"], flag: "--workers", says: /from 1 to 256, got '0'/ },
      {
        args: [...ok, "--health-path", "health"],
        flag: "--health-path",
        says: /starting with '\/'/,
      },
      { args: ["--decode", "http://127.0.0.1:9"], flag: "--prefill", says: /at least one prefill/ },
      {
        args: ["--prefill", "ftp://x", "--decode", "http://127.0.0.1:9"],
        flag: "--prefill",
        says: /http:\/\/ or https:\/\//,
      },
      {
        args: ok,
        env: { PEGAFLOW_ROUTER_HEALTH_INTERVAL: "-1" },
        flag: "--health-interval",
        says: /expected a duration/,
      },
    ];
  await Promise.all(cases.map(async (c) => {
    const { code, stderr } = await runRouterCli(c.args, c.env);
    assert.equal(code, 2, `${c.flag}: exit code (stderr: ${stderr})`);
    assert.match(stderr, new RegExp(`error: ${c.flag}: `), stderr);
    assert.match(stderr, c.says, stderr);
    assert.doesNotMatch(stderr, /listening/);
  }));
});

Deno.test("an upload far over --max-body is a 413 on every route, memory stays flat, the router serves on", async () => {
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D0")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url, "--max-body", "64kb"]);
  /** A thousand times the limit; reading it whole would add ≥ 64 MiB to the peak. */
  const upload = 64 * 1024 * 1024;
  /** Generous: allocator and JIT noise, not the body. */
  const bound = 32 * 1024 * 1024;
  try {
    const before = peakRssBytes(router.pid);
    for (
      const [path, chunked] of [
        ["/v1/completions", true],
        ["/v1/chat/completions", false],
        ["/health", true],
        ["/metrics", false],
      ] as const
    ) {
      let r = await streamUpload({ port: router.port, path, totalBytes: upload, chunked });
      // Now and then (1 run in ~10 on a loaded 2-core machine) the HTTP layer drains the rest
      // of an upload it refused before it closes; a router that always reads it all fails twice.
      if (r.sentBytes >= upload) {
        r = await streamUpload({ port: router.port, path, totalBytes: upload, chunked });
      }
      const what = `${path} (${chunked ? "chunked" : "Content-Length"})`;
      assert.ok(r.answer, `${what}: the router answered`);
      assert.equal(r.answer.status, 413, `${what}: ${r.answer.body}`);
      assert.equal(JSON.parse(r.answer.body).error.code, "body_too_large");
      assert.equal(r.answer.headers["connection"], "close", what);
      assert.ok(r.sentBytes < upload, `${what}: the router stopped the upload early`);
    }
    const growth = peakRssBytes(router.pid) - before;
    assert.ok(growth < bound, `peak memory grew by ${(growth / 2 ** 20).toFixed(1)} MiB`);
    const res = await fetch(`${router.url}/v1/completions`, {
      method: "POST",
      body: JSON.stringify({ model: "m", prompt: "still serving" }),
    });
    assert.equal(res.status, 200);
    await res.json();
    assert.deepEqual(await p.requests().then((r) => r.length), 1);
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});

Deno.test("an unknown flag exits 2 naming the flag, as every other usage error", async () => {
  const { code, stderr } = await runRouterCli([
    "--prefill",
    "http://127.0.0.1:9",
    "--decode",
    "http://127.0.0.1:9",
    "--no-such-flag",
  ]);
  assert.equal(code, 2, stderr);
  assert.match(stderr, /unknown option '--no-such-flag'/);
  const missing = await runRouterCli(["--prefill"]);
  assert.equal(missing.code, 2, missing.stderr);
  assert.match(missing.stderr, /--prefill <url>' argument missing/);
  const help = await runRouterCli(["--help"]);
  assert.equal(help.code, 0, help.stderr);
});

Deno.test("a port already in use is refused with exit 2, naming host and port", async () => {
  const taken = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  try {
    const { code, stderr } = await runRouterCli([
      "--port",
      String(taken.addr.port),
      "--prefill",
      "http://127.0.0.1:9",
      "--decode",
      "http://127.0.0.1:9",
      "--health-timeout",
      "200ms",
    ]);
    assert.equal(code, 2, stderr);
    assert.match(stderr, new RegExp(`cannot listen on 127\\.0\\.0\\.1:${taken.addr.port}`));
  } finally {
    taken.close();
  }
});

Deno.test("a --host that does not resolve is refused with exit 2, naming host and port", async () => {
  // .invalid never resolves (RFC 6761).
  const { code, stderr } = await runRouterCli([
    "--host",
    "no-such-host.invalid",
    "--port",
    "0",
    "--prefill",
    "http://127.0.0.1:9",
    "--decode",
    "http://127.0.0.1:9",
    "--health-timeout",
    "200ms",
  ]);
  assert.equal(code, 2, stderr);
  assert.match(stderr, /error: --host\/--port: cannot listen on no-such-host\.invalid:0: /);
  assert.doesNotMatch(stderr, /Uncaught/);
});
