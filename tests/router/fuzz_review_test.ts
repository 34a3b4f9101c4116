/**
 * Seeded fuzz and adversarial cases for the router's HTTP side: clients that send malformed HTTP
 * and JSON or leave half-way, and backends that misbehave at the byte level (non-JSON answers, cut
 * bodies, broken SSE streams, stalls, oversized headers, garbage instead of HTTP). After every
 * case the router must still answer /health and /metrics, have nothing in flight, and have sent
 * nothing upstream for a request it refused.
 *
 * The router and the well-behaved fake engines are real processes (harness.ts); the misbehaving
 * engines are raw TCP servers in this process, scripted per X-Request-Id, so each case can write
 * exactly the bytes it needs. Deterministic: one seed, no wall-clock assertions.
 */

import assert from "node:assert/strict";
import { metricValue, spawnBackend, spawnRouter, waitFor } from "./harness.ts";

const SEED = 0x5eed_2024;
const FUZZ_CASES = 160;

/** mulberry32: a small deterministic PRNG. */
function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const enc = new TextEncoder();
const dec = new TextDecoder();

// ---------------------------------------------------------------------------------------------
// A raw HTTP/1.1 engine, scripted per request id.

interface RawRequest {
  method: string;
  path: string;
  headers: Map<string, string>;
  body: string;
}

/** Writes the answer to one request; the connection is closed afterwards unless kept. */
type Script = (conn: Deno.Conn, req: RawRequest) => Promise<void>;

class RawEngine {
  readonly listener: Deno.Listener<Deno.TcpConn, Deno.NetAddr>;
  readonly url: string;
  /** Generation requests received, by request id. */
  readonly seen = new Map<string, RawRequest[]>();
  readonly scripts = new Map<string, Script>();
  readonly #conns = new Set<Deno.Conn>();
  readonly #loop: Promise<void>;

  constructor(readonly role: "prefill" | "decode") {
    this.listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
    this.url = `http://127.0.0.1:${this.listener.addr.port}`;
    this.#loop = this.#accept();
  }

  async #accept(): Promise<void> {
    for await (const conn of this.listener) {
      this.#conns.add(conn);
      this.#serve(conn).catch(() => {}).finally(() => {
        this.#conns.delete(conn);
        try {
          conn.close();
        } catch (_closed) {
          // The script closed it already.
        }
      });
    }
  }

  async #serve(conn: Deno.Conn): Promise<void> {
    const req = await readRequest(conn);
    if (req === null) return;
    if (req.method === "GET") {
      await writeAll(conn, "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
      return;
    }
    const id = req.headers.get("x-request-id") ?? "";
    const list = this.seen.get(id) ?? [];
    list.push(req);
    this.seen.set(id, list);
    const script = this.scripts.get(id) ?? (this.role === "prefill" ? prefillOk(KV) : decodeOk());
    await script(conn, req);
  }

  count(id: string): number {
    return this.seen.get(id)?.length ?? 0;
  }

  async stop(): Promise<void> {
    this.listener.close();
    for (const c of this.#conns) {
      try {
        c.close();
      } catch (_closed) {
        // Gone already.
      }
    }
    await this.#loop.catch(() => {});
  }
}

async function readRequest(conn: Deno.Conn): Promise<RawRequest | null> {
  let buf = new Uint8Array(0);
  const chunk = new Uint8Array(64 * 1024);
  let headEnd = -1;
  while (headEnd < 0) {
    const n = await conn.read(chunk);
    if (n === null) return null;
    const next = new Uint8Array(buf.length + n);
    next.set(buf);
    next.set(chunk.subarray(0, n), buf.length);
    buf = next;
    headEnd = dec.decode(buf).indexOf("\r\n\r\n");
  }
  const text = dec.decode(buf);
  const [line, ...lines] = text.slice(0, headEnd).split("\r\n");
  const [method, path] = line.split(" ");
  const headers = new Map<string, string>();
  for (const l of lines) {
    const i = l.indexOf(":");
    headers.set(l.slice(0, i).trim().toLowerCase(), l.slice(i + 1).trim());
  }
  const length = Number(headers.get("content-length") ?? "0");
  let body = buf.subarray(enc.encode(text.slice(0, headEnd + 4)).length);
  while (body.length < length) {
    const n = await conn.read(chunk);
    if (n === null) break;
    const next = new Uint8Array(body.length + n);
    next.set(body);
    next.set(chunk.subarray(0, n), body.length);
    body = next;
  }
  return { method, path, headers, body: dec.decode(body) };
}

async function writeAll(conn: Deno.Conn, data: string | Uint8Array): Promise<void> {
  let bytes = typeof data === "string" ? enc.encode(data) : data;
  while (bytes.length > 0) bytes = bytes.subarray(await conn.write(bytes));
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function head(status: number, headers: Record<string, string>): string {
  const lines = Object.entries({ connection: "close", ...headers }).map(([k, v]) => `${k}: ${v}`);
  return `HTTP/1.1 ${status} X\r\n${lines.join("\r\n")}\r\n\r\n`;
}

function answer(status: number, body: string, contentType = "application/json"): Script {
  return async (conn) => {
    const b = enc.encode(body);
    await writeAll(
      conn,
      head(status, { "content-type": contentType, "content-length": `${b.length}` }),
    );
    await writeAll(conn, b);
  };
}

const KV = { do_remote_prefill: true, remote_engine_id: "raw", remote_block_ids: [1, 2] };

/** P's usual answer; `kv` is what it says in `kv_transfer_params` (`undefined`: no such key). */
function prefillOk(kv: unknown): Script {
  return answer(200, JSON.stringify({ id: "p", choices: [{ text: "x" }], kv_transfer_params: kv }));
}

/** An SSE answer of `events` (each written as its own chunk), then `then`. */
function sse(events: string[], then: "done" | "cut" | "stall" = "done"): Script {
  return async (conn) => {
    await writeAll(
      conn,
      head(200, { "content-type": "text/event-stream", "transfer-encoding": "chunked" }),
    );
    for (const e of events) {
      const b = enc.encode(e);
      await writeAll(conn, `${b.length.toString(16)}\r\n`);
      await writeAll(conn, b);
      await writeAll(conn, "\r\n");
      await sleep(5);
    }
    if (then === "done") await writeAll(conn, "0\r\n\r\n");
    // "cut": return; the connection closes without the last chunk.
    if (then === "stall") await sleep(3_000);
  };
}

function decodeOk(): Script {
  return async (conn, req) => {
    const body = JSON.parse(req.body) as { stream?: boolean };
    if (body.stream === true) {
      await sse(['data: {"choices":[{"text":"a"}]}\n\n', "data: [DONE]\n\n"])(conn, req);
    } else {
      await answer(200, JSON.stringify({ id: "d", choices: [{ text: "decoded" }] }))(conn, req);
    }
  };
}

// ---------------------------------------------------------------------------------------------
// Client-side helpers.

/** One HTTP/1.1 exchange over a raw socket; returns everything the router wrote before closing. */
async function rawExchange(
  port: number,
  write: (conn: Deno.Conn) => Promise<void>,
  readMs = 3_000,
): Promise<string> {
  const conn = await Deno.connect({ hostname: "127.0.0.1", port });
  try {
    await write(conn);
    let out = "";
    const buf = new Uint8Array(16 * 1024);
    const deadline = setTimeout(() => conn.close(), readMs);
    try {
      for (;;) {
        const n = await conn.read(buf);
        if (n === null) break;
        out += dec.decode(buf.subarray(0, n));
      }
    } catch (_closedByDeadline) {
      // The deadline closed the socket: return what came.
    } finally {
      clearTimeout(deadline);
    }
    return out;
  } finally {
    try {
      conn.close();
    } catch (_closed) {
      // Closed by the deadline.
    }
  }
}

interface OpenAIError {
  error: { message: string; type: string; param: string | null; code: string | null };
}

function assertOpenAIError(text: string, what: string): OpenAIError {
  let j: OpenAIError;
  try {
    j = JSON.parse(text);
  } catch {
    throw new Error(`${what}: not a JSON error body: ${text.slice(0, 300)}`);
  }
  assert.equal(typeof j.error?.message, "string", `${what}: error.message: ${text}`);
  assert.ok(j.error.message.length > 0, what);
  assert.ok(
    ["invalid_request_error", "server_error", "timeout_error"].includes(j.error.type),
    `${what}: error.type ${j.error.type}`,
  );
  assert.equal(typeof j.error.code, "string", `${what}: error.code: ${text}`);
  assert.doesNotMatch(j.error.message, /\n\s+at /, `${what}: a stack trace leaked`);
  return j;
}

/** /health and /metrics answer, and nothing is left in flight (requests, backends). */
async function assertSettled(routerUrl: string, what: string): Promise<void> {
  const h = await fetch(`${routerUrl}/health`);
  await h.body?.cancel();
  assert.ok(h.status === 200 || h.status === 503, `${what}: /health answered ${h.status}`);
  await waitFor(`${what}: nothing in flight`, async () => {
    const res = await fetch(`${routerUrl}/metrics`);
    assert.equal(res.status, 200, `${what}: /metrics answered ${res.status}`);
    const text = await res.text();
    const backendInflight = text.split("\n")
      .filter((l) => l.startsWith("pegaflow_router_backend_inflight{"))
      .reduce((s, l) => s + Number(l.slice(l.lastIndexOf(" ") + 1)), 0);
    return metricValue(text, "pegaflow_router_inflight_requests") === 0 && backendInflight === 0;
  }, 5_000);
}

// ---------------------------------------------------------------------------------------------
// Fuzzed request bodies.

const VALID = { model: "m", prompt: "hello", max_tokens: 3, stream: false };

const WEIRD_VALUES: unknown[] = [
  null,
  true,
  false,
  0,
  -1,
  1.5,
  -0,
  1e308,
  -1e308,
  2 ** 53 + 2,
  "",
  "\u0000",
  "\ud800",
  "\u{1f600}\u200d\ufeff",
  "é".normalize("NFD"),
  [],
  [1, "a", null],
  {},
  { nested: { deeper: [1, { x: "y" }] } },
];

function pick<T>(rand: () => number, xs: readonly T[]): T {
  return xs[Math.floor(rand() * xs.length)];
}

function nested(depth: number): string {
  return "[".repeat(depth) + "]".repeat(depth);
}

/** A body, its content type, and the route: mutations of a valid request, or noise. */
function fuzzBody(
  rand: () => number,
): { route: string; body: Uint8Array<ArrayBuffer>; type: string } {
  const route = rand() < 0.5 ? "/v1/completions" : "/v1/chat/completions";
  const type = pick(rand, [
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin1",
  ]);
  const kind = Math.floor(rand() * 6);
  if (kind === 0) {
    const bytes = new Uint8Array(Math.floor(rand() * 300));
    for (let i = 0; i < bytes.length; i++) bytes[i] = Math.floor(rand() * 256);
    return { route, body: bytes, type };
  }
  const base: Record<string, unknown> = route === "/v1/completions"
    ? { ...VALID }
    : { model: "m", messages: [{ role: "user", content: "hi" }], max_tokens: 3, stream: false };
  if (kind === 1) {
    const field = pick(rand, [
      "model",
      "prompt",
      "messages",
      "n",
      "stream",
      "max_tokens",
      "max_completion_tokens",
      "stream_options",
      "kv_transfer_params",
      "extra_field",
    ]);
    if (rand() < 0.2) delete base[field];
    else base[field] = pick(rand, WEIRD_VALUES);
    return { route, body: enc.encode(JSON.stringify(base)), type };
  }
  if (kind === 2) {
    // Deep nesting, inside an extra field or as the whole body.
    // (Deeper still the router copes, but the fake engine cannot render its record.)
    const depth = pick(rand, [10, 1_000, 5_000]);
    const text = rand() < 0.5
      ? JSON.stringify(base).slice(0, -1) + `,"deep":${nested(depth)}}`
      : nested(depth);
    return { route, body: enc.encode(text), type };
  }
  if (kind === 3) {
    // Numbers JSON allows but JavaScript turns into something else.
    const num = pick(rand, ["1e400", "-1e400", "1e-400", "-0", "99999999999999999999", "0.5e1"]);
    const text = JSON.stringify(base).replace('"max_tokens":3', `"max_tokens":${num}`);
    return { route, body: enc.encode(text), type };
  }
  if (kind === 4) {
    // A valid body cut at a random point, or with a byte flipped.
    const text = enc.encode(JSON.stringify(base));
    if (rand() < 0.5) return { route, body: text.slice(0, Math.floor(rand() * text.length)), type };
    const copy = text.slice();
    copy[Math.floor(rand() * copy.length)] = Math.floor(rand() * 256);
    return { route, body: copy, type };
  }
  // Invalid UTF-8 inside a string, or a BOM in front.
  const text = JSON.stringify(base);
  const bytes = rand() < 0.5
    ? new Uint8Array([...enc.encode(text.slice(0, -2)), 0xc3, 0x28, ...enc.encode('"}')])
    : new Uint8Array([0xef, 0xbb, 0xbf, ...enc.encode(text)]);
  return { route, body: bytes, type };
}

// ---------------------------------------------------------------------------------------------

Deno.test("fuzzed client bodies get a 200 or a named 400, never a 500, and refusals stay local", async () => {
  const [p, d] = await Promise.all([spawnBackend("P"), spawnBackend("D")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url, "--max-body", "4mb"]);
  try {
    const rand = prng(SEED);
    const statuses = new Map<number, number>();
    for (let i = 0; i < FUZZ_CASES; i++) {
      const { route, body, type } = fuzzBody(rand);
      const id = `fuzz-${i}`;
      const res = await fetch(router.url + route, {
        method: "POST",
        headers: { "content-type": type, "x-request-id": id },
        body,
      });
      const text = await res.text();
      const what = `case ${i} (${dec.decode(body.slice(0, 120))})`;
      statuses.set(res.status, (statuses.get(res.status) ?? 0) + 1);
      assert.ok(res.status === 200 || res.status === 400, `${what}: HTTP ${res.status} ${text}`);
      assert.equal(res.headers.get("x-request-id"), id, what);
      if (res.status === 400) assertOpenAIError(text, what);
    }
    // Every refused request stayed in the router; every accepted one went to P and then D.
    const sentP = new Set((await p.requests()).map((r) => r.requestId));
    const sentD = new Set((await d.requests()).map((r) => r.requestId));
    assert.equal(sentP.size, statuses.get(200) ?? 0, `P got ${sentP.size}: ${[...statuses]}`);
    assert.equal(sentD.size, statuses.get(200) ?? 0);
    assert.ok((statuses.get(400) ?? 0) > FUZZ_CASES / 3, `mostly refusals: ${[...statuses]}`);
    await assertSettled(router.url, "after the fuzz");
  } finally {
    await router.stop();
    await Promise.all([p.stop(), d.stop()]);
  }
});

/** What one misbehaving-backend case sends and what the client must see. */
interface BackendCase {
  name: string;
  prefill?: Script;
  decode?: Script;
  stream?: boolean;
  /** Checks the client's view (status, body text), given the engines' record. */
  check: (res: { status: number; text: string; error: unknown }, id: string) => void;
  /** Expected P and D attempts. */
  attempts: [number, number];
}

const HUGE_HEADER = "x".repeat(1 << 20);

const BACKEND_CASES: BackendCase[] = [
  {
    // Read whole it held the router's memory: refused at 16 MiB, no retry, D not called.
    name: "P answers 200 with a body of 17 MiB",
    prefill: answer(200, `{"pad":"${"x".repeat(17 << 20)}"}`),
    attempts: [1, 0],
    check: ({ status, text }) => {
      assert.equal(status, 502);
      const e = assertOpenAIError(text, "huge P").error;
      assert.equal(e.code, "prefill_bad_response");
      assert.match(
        e.message,
        /prefill answer is \d+ bytes \(Content-Length\), larger than the limit/,
      );
    },
  },
  {
    name: "P answers 200 with a body that is not JSON",
    prefill: answer(200, "<html>oops</html>", "text/html"),
    attempts: [1, 0],
    check: ({ status, text }) => {
      assert.equal(status, 502);
      assert.equal(assertOpenAIError(text, "non-JSON P").error.code, "prefill_bad_response");
    },
  },
  {
    name: "P answers 200 with a body cut before its Content-Length",
    prefill: async (conn) => {
      await writeAll(
        conn,
        head(200, { "content-type": "application/json", "content-length": "500" }),
      );
      await writeAll(conn, '{"kv_transfer_params":');
    },
    attempts: [2, 0],
    check: ({ status, text }) => {
      assert.equal(status, 502);
      assert.equal(assertOpenAIError(text, "cut P").error.code, "prefill_unavailable");
    },
  },
  {
    // An answer that is not HTTP would come again from the same P: no retry on it.
    name: "P answers with bytes that are not HTTP",
    prefill: async (conn) => await writeAll(conn, "HELLO I AM NOT HTTP\r\n\r\n"),
    attempts: [1, 0],
    check: ({ status, text }) => {
      assert.equal(status, 502);
      assert.equal(assertOpenAIError(text, "garbage P").error.code, "prefill_unavailable");
    },
  },
  {
    name: "P answers with headers far too large",
    prefill: async (conn) =>
      await writeAll(conn, head(200, { "x-big": HUGE_HEADER, "content-length": "2" }) + "{}"),
    attempts: [1, 0],
    check: ({ status, text }) => {
      assert.equal(status, 502);
      assert.equal(assertOpenAIError(text, "huge P headers").error.code, "prefill_unavailable");
    },
  },
  ...([undefined, "a string", [1, 2], 7, null, {}] as unknown[]).map((kv): BackendCase => ({
    name: `P's kv_transfer_params is ${JSON.stringify(kv) ?? "missing"}: D gets none`,
    prefill: prefillOk(kv),
    attempts: [1, 1],
    check: ({ status, text }) => {
      assert.equal(status, 200, text);
      assert.match(text, /decoded/);
    },
  })),
  {
    name: "P answers JSON that is not an object: D gets no kv_transfer_params",
    prefill: answer(200, "[1,2,3]"),
    attempts: [1, 1],
    check: ({ status }) => assert.equal(status, 200),
  },
  {
    name: "P answers 500 then the client gets P's answer as it stands",
    prefill: answer(
      500,
      '{"error":{"message":"boom","type":"server_error","param":null,"code":null}}',
    ),
    attempts: [1, 0],
    check: ({ status, text }) => {
      assert.equal(status, 500);
      assert.match(text, /boom/);
    },
  },
  {
    name: "D streams malformed SSE events: relayed as they are, then the end",
    stream: true,
    decode: sse([
      "data: {not json\n\n",
      "event: weird\r\n",
      "data: \u0000\n\n",
      "data: [DONE]\n\n",
    ]),
    attempts: [1, 1],
    check: ({ status, text, error }) => {
      assert.equal(status, 200);
      assert.equal(error, null);
      assert.match(text, /data: \{not json/);
      assert.match(text, /\[DONE\]/);
    },
  },
  {
    name: "D answers headers too large",
    decode: async (conn) =>
      await writeAll(conn, head(200, { "x-big": HUGE_HEADER, "content-length": "2" }) + "{}"),
    // The only D would answer the same again: not retried on it.
    attempts: [1, 1],
    check: ({ status, text }) => {
      assert.equal(status, 502);
      assert.equal(assertOpenAIError(text, "huge D headers").error.code, "decode_unavailable");
    },
  },
  {
    name: "D answers 503: the client gets it (D is never retried once it answered)",
    decode: answer(
      503,
      '{"error":{"message":"busy","type":"server_error","param":null,"code":null}}',
    ),
    attempts: [1, 1],
    check: ({ status, text }) => {
      assert.equal(status, 503);
      assert.match(text, /busy/);
    },
  },
];

/** A D that breaks off mid-answer; the stall past an idle deadline only where one is set. */
function streamBreakCases(inspecting: boolean): BackendCase[] {
  // Both relays end a cut SSE stream with an error event (an SSE body is never piped natively).
  const cutEvent = (text: string, error: unknown, code: string) => {
    assert.equal(error, null, `the stream ends cleanly after the error event: ${error}`);
    const last = text.trim().split("\n\n").at(-1) ?? "";
    assert.ok(last.startsWith("data: "), `terminal event: ${text}`);
    const j = assertOpenAIError(last.slice(6), code);
    assert.equal(j.error.code, code);
    assert.equal(
      j.error.type,
      code === "decode_idle_timeout" ? "timeout_error" : "server_error",
      `error type of ${code}`,
    );
  };
  const cases: BackendCase[] = [
    {
      name: "D closes the connection mid-stream",
      stream: true,
      decode: sse(['data: {"choices":[{"text":"a"}]}\n\n'], "cut"),
      attempts: [1, 1],
      check: ({ status, text, error }) => {
        assert.equal(status, 200);
        assert.match(text, /"text":"a"/);
        cutEvent(text, error, "decode_failed");
      },
    },
    {
      name: "D answers 200 (not a stream) with a body cut before its Content-Length",
      decode: async (conn) => {
        await writeAll(
          conn,
          head(200, { "content-type": "application/json", "content-length": "999" }),
        );
        await writeAll(conn, '{"choices":');
      },
      attempts: [1, 1],
      check: ({ status, error }) => {
        assert.equal(status, 200);
        assert.notEqual(error, null, "a cut body must not read as complete");
      },
    },
  ];
  if (inspecting) {
    cases.push({
      name: "D stalls mid-stream past --stream-idle-timeout",
      stream: true,
      decode: sse(['data: {"choices":[{"text":"a"}]}\n\n'], "stall"),
      attempts: [1, 1],
      check: ({ status, text, error }) => {
        assert.equal(status, 200);
        cutEvent(text, error, "decode_idle_timeout");
      },
    });
  }
  return cases;
}

for (const inspecting of [false, true]) {
  Deno.test(
    `misbehaving engines get a named error and leave nothing open (${
      inspecting ? "inspecting relay" : "default relay"
    })`,
    async (t) => {
      const p = new RawEngine("prefill");
      const d = new RawEngine("decode");
      const router = await spawnRouter([
        "--prefill",
        p.url,
        "--decode",
        d.url,
        "--health-interval",
        "1h",
        "--prefill-timeout",
        "3s",
        "--decode-timeout",
        "3s",
        ...(inspecting ? ["--stream-idle-timeout", "400ms"] : []),
      ]);
      try {
        for (const [i, c] of [...BACKEND_CASES, ...streamBreakCases(inspecting)].entries()) {
          await t.step(c.name, async () => {
            const id = `backend-${inspecting ? "i" : "n"}-${i}`;
            if (c.prefill) p.scripts.set(id, c.prefill);
            if (c.decode) d.scripts.set(id, c.decode);
            const res = await fetch(`${router.url}/v1/completions`, {
              method: "POST",
              headers: { "content-type": "application/json", "x-request-id": id },
              body: JSON.stringify({ model: "m", prompt: "hi", stream: c.stream ?? false }),
            });
            let text = "";
            let error: unknown = null;
            try {
              text = await res.text();
            } catch (e) {
              error = e;
            }
            assert.equal(res.headers.get("x-request-id"), id);
            c.check({ status: res.status, text, error }, id);
            assert.deepEqual([p.count(id), d.count(id)], c.attempts, "P and D attempts");
            if (c.attempts[1] > 0) {
              const sent = JSON.parse(d.seen.get(id)![0].body) as Record<string, unknown>;
              const kvOk = c.prefill === undefined;
              assert.equal("kv_transfer_params" in sent, kvOk, "D's kv_transfer_params");
            }
            await assertSettled(router.url, c.name);
          });
        }
        // Every case left the router up and healthy (the engines answered their health checks).
        const h = await fetch(`${router.url}/health`);
        assert.equal(h.status, 200, await h.text());
        // A P answer that is not JSON, or over the limit, is counted as P's failure.
        const m = await (await fetch(`${router.url}/metrics`)).text();
        for (const reason of ["bad_response", "oversized"]) {
          const n = metricValue(m, "pegaflow_router_upstream_failures_total", {
            role: "prefill",
            reason,
          });
          assert.ok(n >= 1, `upstream failures {prefill, ${reason}}: ${n}`);
        }
      } finally {
        await router.stop();
        await Promise.all([p.stop(), d.stop()]);
      }
    },
  );
}

Deno.test("clients that send broken HTTP, stall or leave half-way cost nothing upstream", async (t) => {
  const [p, d] = await Promise.all([spawnBackend("P"), spawnBackend("D")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url, "--workers", "1"]);
  const valid = JSON.stringify(VALID);
  const upstream = async () => (await p.requests()).length + (await d.requests()).length;
  try {
    const raw: Array<[string, (conn: Deno.Conn) => Promise<void>, RegExp | null]> = [
      [
        "a request line that is not HTTP",
        (c) => writeAll(c, "BLAH BLAH\r\n\r\n"),
        /^HTTP\/1\.1 400/,
      ],
      [
        "a negative Content-Length",
        (c) =>
          writeAll(c, "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n{}"),
        /^HTTP\/1\.1 400/,
      ],
      [
        "request headers of 1 MiB",
        (c) =>
          writeAll(c, `POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: ${HUGE_HEADER}\r\n\r\n`),
        // hyper refuses it (400 or 431) or drops the connection.
        /^(HTTP\/1\.1 4(00|31)|$)/,
      ],
      [
        "a body shorter than its Content-Length, then the client leaves",
        async (c) => {
          await writeAll(
            c,
            `POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n${
              valid.slice(0, 10)
            }`,
          );
          await (c as Deno.TcpConn).closeWrite();
        },
        null,
      ],
      [
        "a chunked body that stalls half-way, then the client leaves",
        async (c) => {
          await writeAll(
            c,
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" +
              `${(10).toString(16)}\r\n${valid.slice(0, 10)}\r\n`,
          );
          await sleep(300);
          // Meanwhile the router serves everyone else.
          const h = await fetch(`${router.url}/health`);
          assert.equal(h.status, 200);
          await h.body?.cancel();
          await (c as Deno.TcpConn).closeWrite();
        },
        null,
      ],
    ];
    for (const [name, write, expect] of raw) {
      await t.step(name, async () => {
        const before = await upstream();
        const out = await rawExchange(router.port, write);
        if (expect !== null) assert.match(out, expect, out.slice(0, 200));
        assert.doesNotMatch(out, /^HTTP\/1\.1 5/, out.slice(0, 300));
        assert.equal(await upstream(), before, "nothing went upstream");
        await assertSettled(router.url, name);
      });
    }

    await t.step("a client that leaves during prefill: P sees it go, counted as 499", async () => {
      await p.control({ delayMs: 2_000 });
      const ac = new AbortController();
      const sent = fetch(`${router.url}/v1/completions`, {
        method: "POST",
        headers: { "x-request-id": "leaves-in-prefill" },
        body: valid,
        signal: ac.signal,
      }).catch(() => null);
      await waitFor("P got the request", async () => (await p.requests()).length > 0);
      ac.abort();
      await sent;
      await waitFor(
        "P saw the client go",
        async () =>
          (await p.requests()).some((r) => r.requestId === "leaves-in-prefill" && r.cancelled),
      );
      await assertSettled(router.url, "left in prefill");
      assert.equal((await d.requests()).length, 0, "D never got it");
      const m = await router.metrics();
      assert.equal(metricValue(m, "pegaflow_router_requests_total", { status: "499" }), 1);
      assert.equal(metricValue(m, "pegaflow_router_requests_total", { status: "500" }), 0);
      await p.control({ delayMs: 0 });
    });
  } finally {
    await router.stop();
    await Promise.all([p.stop(), d.stop()]);
  }
});
