/**
 * A bug hunt with real processes: a shutdown that cuts requests in flight, a decode engine that
 * breaks off in the middle of an SSE event or ends its stream without `[DONE]`, valid OpenAI/vLLM
 * requests the prefill copy must not break (`min_tokens`, integers past 2^53), and errors that must
 * name what failed and the request.
 *
 * The router and the well-behaved engines are real processes (harness.ts); the engines that send
 * exact bytes are raw TCP servers in this process, scripted per X-Request-Id.
 */

import assert from "node:assert/strict";
import OpenAI from "openai";
import { metricValue, spawnBackend, spawnRouter, waitFor } from "./harness.ts";

const enc = new TextEncoder();
const dec = new TextDecoder();

/** Writes one answer on a raw connection; the connection is closed afterwards. */
type Script = (conn: Deno.Conn) => Promise<void>;

/** A raw HTTP/1.1 engine: health checks get a 200, generation requests their id's script. */
class RawEngine {
  readonly #listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  readonly url = `http://127.0.0.1:${this.#listener.addr.port}`;
  readonly scripts = new Map<string, Script>();
  readonly seen: string[] = [];
  readonly #conns = new Set<Deno.Conn>();
  readonly #loop = this.#accept();

  async #accept(): Promise<void> {
    for await (const conn of this.#listener) {
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
    const head = await readHead(conn);
    if (head === null) return;
    if (head.startsWith("GET")) {
      await writeAll(conn, "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
      return;
    }
    const id = /\r\nx-request-id: *(\S+)/i.exec(head)?.[1] ?? "";
    this.seen.push(id);
    const script = this.scripts.get(id);
    if (script === undefined) throw new Error(`no script for ${id}`);
    await script(conn);
  }

  async stop(): Promise<void> {
    this.#listener.close();
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

/** Reads a request's head and its Content-Length body; the head's text, or null at EOF. */
async function readHead(conn: Deno.Conn): Promise<string | null> {
  let text = "";
  const buf = new Uint8Array(64 * 1024);
  while (!text.includes("\r\n\r\n")) {
    const n = await conn.read(buf);
    if (n === null) return null;
    text += dec.decode(buf.subarray(0, n));
  }
  const end = text.indexOf("\r\n\r\n") + 4;
  const length = Number(/\r\ncontent-length: *(\d+)/i.exec(text)?.[1] ?? "0");
  while (enc.encode(text).length - end < length) {
    const n = await conn.read(buf);
    if (n === null) break;
    text += dec.decode(buf.subarray(0, n));
  }
  return text.slice(0, end);
}

async function writeAll(conn: Deno.Conn, data: string): Promise<void> {
  let bytes = enc.encode(data);
  while (bytes.length > 0) bytes = bytes.subarray(await conn.write(bytes));
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** An SSE answer written as the chunks given (each its own HTTP chunk), then `then`. */
function sse(chunks: string[], then: "end" | "cut" | "stall"): Script {
  return async (conn) => {
    await writeAll(
      conn,
      "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" +
        "connection: close\r\n\r\n",
    );
    for (const c of chunks) {
      await writeAll(conn, `${enc.encode(c).length.toString(16)}\r\n${c}\r\n`);
      await sleep(20);
    }
    if (then === "end") await writeAll(conn, "0\r\n\r\n");
    if (then === "stall") await sleep(5_000);
  };
}

/** A JSON answer with the given status and body (its Content-Length the body's). */
function json(status: number, body: string): Script {
  return async (conn) => {
    await writeAll(
      conn,
      `HTTP/1.1 ${status} X\r\ncontent-type: application/json\r\ncontent-length: ` +
        `${enc.encode(body).length}\r\nconnection: close\r\n\r\n${body}`,
    );
  };
}

const EVENT = (text: string) =>
  `data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,` +
  `"text":"${text}","finish_reason":null}]}\n\n`;

interface ErrorBody {
  error: { message: string; type: string; code: string };
}

/** The events of an SSE text: each must be a `data:` line of JSON or `[DONE]`. */
function events(text: string): unknown[] {
  return text.split("\n\n").filter((e) => e.trim() !== "").map((e) => {
    assert.ok(e.startsWith("data: "), `an SSE data event: ${JSON.stringify(e)}`);
    const data = e.slice(6);
    if (data === "[DONE]") return "[DONE]";
    try {
      return JSON.parse(data);
    } catch {
      throw new Error(`an event that is not JSON reached the client: ${JSON.stringify(e)}`);
    }
  });
}

async function post(url: string, id: string, body: Record<string, unknown>): Promise<Response> {
  return await fetch(`${url}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json", "x-request-id": id },
    body: JSON.stringify(body),
  });
}

/** Reads a body to its end: the text and the read error, if any (a cut body). */
async function readAll(res: Response): Promise<{ text: string; error: unknown }> {
  const reader = res.body!.getReader();
  let text = "";
  try {
    for (let r = await reader.read(); !r.done; r = await reader.read()) text += dec.decode(r.value);
    return { text, error: null };
  } catch (e) {
    return { text, error: e };
  }
}

Deno.test("a shutdown that cuts requests in flight tells their clients so, by request id", async () => {
  const [p0, p1, d] = await Promise.all([
    spawnBackend("P-slow"),
    spawnBackend("P"),
    spawnBackend("D"),
  ]);
  const router = await spawnRouter([
    "--prefill",
    p0.url,
    "--prefill",
    p1.url,
    "--decode",
    d.url,
    "--workers",
    "1",
    "--health-interval",
    "1h",
    "--log-level",
    "debug",
  ]);
  try {
    await p0.control({ delayMs: 60_000 });
    await d.control({ chunks: 3, stallAfter: 1 });
    // The first request waits in P-slow's prefill; the second goes to the idle P (fewest in
    // flight), then D sends its first event and goes silent.
    const inPrefill = post(router.url, "cut-in-prefill", { model: "m", prompt: "x" });
    await waitFor("P-slow has the request", async () => (await p0.requests()).length === 1);
    const stream = await post(router.url, "cut-mid-stream", {
      model: "m",
      prompt: "x",
      stream: true,
    });
    assert.equal(stream.status, 200);
    const reading = readAll(stream);
    await waitFor("D sent its first event", async () => (await d.requests())[0]?.chunksSent === 1);

    Deno.kill(router.pid, "SIGTERM");
    // The grace period (10 s) ends; both are cut.
    const res = await inPrefill;
    const body = await res.json() as ErrorBody;
    assert.equal(res.status, 503, JSON.stringify(body));
    assert.equal(res.headers.get("x-request-id"), "cut-in-prefill");
    assert.equal(body.error.code, "router_shutting_down");
    assert.ok(body.error.message.includes(p0.url), `names P: ${body.error.message}`);
    assert.ok(
      body.error.message.includes("cut-in-prefill"),
      `names the request: ${body.error.message}`,
    );

    const { text, error } = await reading;
    assert.equal(error, null, `the stream ends cleanly after an error event: ${error}`);
    const got = events(text);
    assert.equal(got.length, 2, text);
    const last = (got[1] as ErrorBody).error;
    assert.equal(last.code, "router_shutting_down");
    assert.ok(last.message.includes(d.url), `names D: ${last.message}`);
    assert.ok(last.message.includes("cut-mid-stream"), `names the request: ${last.message}`);

    assert.equal((await router.status).code, 0);
    await waitFor("P-slow saw its request cut", async () => (await p0.requests())[0].cancelled);
    await waitFor("D saw its request cut", async () => (await d.requests())[0].cancelled);
    const log = router.stderr();
    assert.doesNotMatch(log, /unhandled error in request handler/, log);
    // Neither is counted as a client that left.
    assert.doesNotMatch(log, /"msg":"client disconnected"/, log);
    assert.doesNotMatch(log, /"outcome":"client_gone"/, log);
    assert.match(log, /"msg":"request failed","request_id":"cut-in-prefill","status":503/);
  } finally {
    await Promise.all([router.stop(), p0.stop(), p1.stop(), d.stop()]);
  }
});

for (const inspecting of [false, true]) {
  Deno.test(
    `a decode engine that breaks off in the middle of an SSE event: the client reads the error (${
      inspecting ? "--stream-idle-timeout" : "default relay"
    })`,
    async () => {
      const p = await spawnBackend("P");
      const d = new RawEngine();
      const router = await spawnRouter([
        "--prefill",
        p.url,
        "--decode",
        d.url,
        "--health-interval",
        "1h",
        ...(inspecting ? ["--stream-idle-timeout", "500ms"] : []),
      ]);
      const openai = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: "k", maxRetries: 0 });
      const half = EVENT("b").slice(0, 40);
      try {
        // D dies half-way through its second event.
        d.scripts.set("half-event", sse([EVENT("a"), half], "cut"));
        const stream = await openai.completions.create({ model: "m", prompt: "x", stream: true }, {
          headers: { "X-Request-Id": "half-event" },
        });
        const texts: string[] = [];
        const err = await (async () => {
          for await (const c of stream) texts.push(c.choices[0].text);
        })().then(() => assert.fail("expected the stream to fail"), (e) => e);
        assert.deepEqual(texts, ["a"]);
        assert.ok(err instanceof OpenAI.APIError, `an APIError naming D, got ${err}`);
        assert.ok(String(err.message).includes(d.url), String(err.message));
        assert.ok(String(err.message).includes("half-event"), String(err.message));

        // The same over plain fetch: every event the client gets is whole.
        d.scripts.set("half-event-2", sse([EVENT("a"), half], "cut"));
        const { text } = await readAll(
          await post(router.url, "half-event-2", { model: "m", prompt: "x", stream: true }),
        );
        const got = events(text);
        assert.equal((got.at(-1) as ErrorBody).error.code, "decode_failed", text);

        if (inspecting) {
          // D goes silent half-way through an event: the idle timeout's event is whole too.
          d.scripts.set("half-stall", sse([EVENT("a"), half], "stall"));
          const res = await post(router.url, "half-stall", {
            model: "m",
            prompt: "x",
            stream: true,
          });
          const stalled = events((await readAll(res)).text);
          assert.equal((stalled.at(-1) as ErrorBody).error.code, "decode_idle_timeout");
        }

        // An event split over two chunks still arrives, whole and once.
        d.scripts.set(
          "split",
          sse([EVENT("a").slice(0, 30), EVENT("a").slice(30), "data: [DO", "NE]\n\n"], "end"),
        );
        const split = await readAll(
          await post(router.url, "split", { model: "m", prompt: "x", stream: true }),
        );
        assert.equal(split.error, null);
        assert.equal(split.text, EVENT("a") + "data: [DONE]\n\n");
      } finally {
        await router.stop();
        await Promise.all([p.stop(), d.stop()]);
      }
    },
  );
}

Deno.test("a decode stream that ends without [DONE] ends with an error event naming D and the request", async () => {
  const p = await spawnBackend("P");
  const d = new RawEngine();
  const router = await spawnRouter([
    "--prefill",
    p.url,
    "--decode",
    d.url,
    "--health-interval",
    "1h",
  ]);
  try {
    d.scripts.set("no-done", sse([EVENT("a"), EVENT("b")], "end"));
    const res = await post(router.url, "no-done", { model: "m", prompt: "x", stream: true });
    const { text, error } = await readAll(res);
    assert.equal(error, null);
    const got = events(text);
    assert.equal(got.length, 3, text);
    const e = (got[2] as ErrorBody).error;
    assert.equal(e.code, "decode_incomplete");
    assert.ok(e.message.includes(d.url) && e.message.includes("no-done"), e.message);

    // An openai client reads it as an error, not as a complete answer.
    d.scripts.set("no-done-2", sse([EVENT("a")], "end"));
    const openai = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: "k", maxRetries: 0 });
    const stream = await openai.completions.create({ model: "m", prompt: "x", stream: true }, {
      headers: { "X-Request-Id": "no-done-2" },
    });
    const err = await (async () => {
      for await (const _ of stream) { /* read on */ }
    })().then(() => null, (e) => e);
    assert.ok(err instanceof OpenAI.APIError, `an APIError, got ${err}`);

    const m = await router.metrics();
    assert.equal(
      metricValue(m, "pegaflow_router_upstream_failures_total", {
        role: "decode",
        reason: "incomplete",
      }),
      2,
      m,
    );
    assert.match(router.stderr(), /decode stream ended without \[DONE\].*no-done/);
  } finally {
    await router.stop();
    await Promise.all([p.stop(), d.stop()]);
  }
});

Deno.test("valid vLLM requests survive the prefill copy: min_tokens, integers past 2^53", async () => {
  const [p, d] = await Promise.all([spawnBackend("P"), spawnBackend("D")]);
  const router = await spawnRouter([
    "--prefill",
    p.url,
    "--decode",
    d.url,
    "--health-interval",
    "1h",
  ]);
  try {
    // vLLM refuses min_tokens above max_tokens; P is asked for one token.
    const res = await post(router.url, "min-tokens", {
      model: "m",
      prompt: "x",
      max_tokens: 20,
      min_tokens: 5,
    });
    assert.equal(res.status, 200, await res.clone().text());
    await res.body?.cancel();
    const [pBody] = (await p.requests()).map((r) => r.body);
    const [dBody] = (await d.requests()).map((r) => r.body);
    assert.equal(pBody.max_tokens, 1);
    assert.ok((pBody.min_tokens as number) <= 1, `P's min_tokens: ${pBody.min_tokens}`);
    assert.equal(dBody.min_tokens, 5, "D gets the client's min_tokens");

    // A 64-bit seed is not a JavaScript number: P and D get the digits the client sent.
    const seed = "12345678901234567891";
    const raw = `{"model":"m","prompt":"x","seed":${seed},"logit_bias":{"50256":-1e400}}`;
    const r2 = await fetch(`${router.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", "x-request-id": "big-seed" },
      body: raw,
    });
    assert.equal(r2.status, 200, await r2.clone().text());
    await r2.body?.cancel();
    const pRaw = (await p.requests()).find((r) => r.requestId === "big-seed")!.raw;
    const dRaw = (await d.requests()).find((r) => r.requestId === "big-seed")!.raw;
    for (const [who, sent] of [["P", pRaw], ["D", dRaw]]) {
      assert.ok(sent.includes(`"seed":${seed}`), `${who} got the seed as sent: ${sent}`);
      assert.ok(sent.includes("-1e400"), `${who} got the number as sent: ${sent}`);
    }
    assert.ok(dRaw.startsWith(raw.slice(0, -1)), `D got the client's bytes: ${dRaw}`);
    assert.ok(dRaw.includes('"kv_transfer_params":{'), `D got P's kv_transfer_params: ${dRaw}`);
  } finally {
    await router.stop();
    await Promise.all([p.stop(), d.stop()]);
  }
});

Deno.test("the router's errors name the backend and the request", async (t) => {
  const p = new RawEngine();
  const [d, down] = await Promise.all([spawnBackend("D"), spawnBackend("D-down")]);
  await down.control({ healthStatus: 503 });
  const router = await spawnRouter([
    "--prefill",
    p.url,
    "--decode",
    d.url,
    "--health-interval",
    "1h",
  ]);
  const routerNoD = await spawnRouter([
    "--prefill",
    p.url,
    "--decode",
    down.url,
    "--health-interval",
    "1h",
  ]);
  const errorOf = async (res: Response) => (await res.json() as ErrorBody).error;
  try {
    await t.step("P's answer cut short is named as P's answer, not the client's body", async () => {
      p.scripts.set("p-cut", async (conn) => {
        await writeAll(
          conn,
          "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n" +
            'connection: close\r\n\r\n{"kv_transfer_params":',
        );
      });
      const res = await post(router.url, "p-cut", { model: "m", prompt: "x" });
      assert.equal(res.status, 502);
      const e = await errorOf(res);
      assert.equal(e.code, "prefill_unavailable");
      assert.doesNotMatch(e.message, /request body/, "the client's request was fine");
      assert.match(e.message, /prefill answer/);
      assert.ok(e.message.includes(p.url) && e.message.includes("p-cut"), e.message);
    });
    await t.step("P answering something that is not JSON", async () => {
      p.scripts.set("p-not-json", json(200, "<html>hi</html>"));
      const res = await post(router.url, "p-not-json", { model: "m", prompt: "x" });
      assert.equal(res.status, 502);
      const e = await errorOf(res);
      assert.equal(e.code, "prefill_bad_response");
      assert.ok(e.message.includes(p.url) && e.message.includes("p-not-json"), e.message);
    });
    await t.step("no decode backend in service", async () => {
      const res = await post(routerNoD.url, "no-d", { model: "m", prompt: "x" });
      assert.equal(res.status, 503);
      const e = await errorOf(res);
      assert.equal(e.code, "no_decode_backend");
      assert.ok(e.message.includes(down.url) && e.message.includes("no-d"), e.message);
      assert.deepEqual(p.seen.filter((id) => id === "no-d"), [], "nothing went to P");
    });
  } finally {
    await Promise.all([router.stop(), routerNoD.stop()]);
    await Promise.all([p.stop(), d.stop(), down.stop()]);
  }
});
