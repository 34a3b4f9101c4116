/**
 * A small OpenAI-compatible engine for router tests and the router benchmark: it answers
 * `/v1/completions` and `/v1/chat/completions` (streaming and not), `/v1/models` and `/health`,
 * behaves like a vLLM prefill node when asked for `do_remote_decode`, and records everything it
 * received so tests can assert what the router sent.
 *
 * Run: `deno run --allow-net tests/router/fake_backend.ts --port 0 [--name P0] [--no-record]`.
 * It prints one JSON line `{"port": N}` on stdout once listening.
 *
 * Control endpoints (test-only):
 * - `GET /_record` — `{ requests: Recorded[], healthChecks: number, modelsCalls: number }`
 * - `POST /_control` — merge a {@link Behaviour} patch
 * - `POST /_release` — let streams waiting at the gate send the rest of their chunks
 * - `POST /_reset` — forget the record
 *
 * @module
 */

/** How the fake engine behaves; changed at run time through `POST /_control`. */
export interface Behaviour {
  /** Status answered on GET /health. */
  healthStatus: number;
  /** Fail this many of the next generation requests with `failStatus`. */
  failNext: number;
  failStatus: number;
  /** Wait this long before answering a generation request (before headers). */
  delayMs: number;
  /** Number of content chunks in a streamed answer. */
  chunks: number;
  /** Pause between two streamed chunks. */
  chunkDelayMs: number;
  /** After the first streamed chunk, wait for `POST /_release` before sending the rest. */
  gate: boolean;
  /** Stop after this many chunks and keep the stream open without sending anything (-1: never). */
  stallAfter: number;
  /** Model id served. */
  model: string;
  /**
   * Engine-step mode (benchmark): when > 0, the first chunk goes out at once and then one shared
   * timer emits the next chunk of every open stream each `stepMs`, the way a batching engine
   * decodes one token for all running requests per step. Overrides `chunkDelayMs`.
   */
  stepMs: number;
}

/** One generation request as received. */
export interface Recorded {
  seq: number;
  path: string;
  requestId: string | null;
  authorization: string | null;
  body: Record<string, unknown>;
  /** The body's text exactly as received (numbers JavaScript would round included). */
  raw: string;
  /** Wall-clock ms (performance.timeOrigin + now) when the request arrived. */
  receivedAt: number;
  /** When the last byte of the answer was handed to the server, or null. */
  finishedAt: number | null;
  chunksSent: number;
  /** The client (the router) went away before the answer was complete. */
  cancelled: boolean;
}

const args = Deno.args;
const argValue = (flag: string) => {
  const i = args.indexOf(flag);
  return i >= 0 ? args[i + 1] : undefined;
};
const port = Number(argValue("--port") ?? "0");
const name = argValue("--name") ?? "fake";
const record = !args.includes("--no-record");

const behaviour: Behaviour = {
  healthStatus: 200,
  failNext: 0,
  failStatus: 503,
  delayMs: 0,
  chunks: 5,
  chunkDelayMs: 0,
  gate: false,
  stallAfter: -1,
  model: "fake-model",
  stepMs: 0,
};
let requests: Recorded[] = [];
let healthChecks = 0;
let modelsCalls = 0;
let seq = 0;
let gateWaiters: Array<() => void> = [];

const now = () => performance.timeOrigin + performance.now();
const encoder = new TextEncoder();
const sleep = (ms: number, signal: AbortSignal) =>
  new Promise<void>((resolve, reject) => {
    if (signal.aborted) return reject(signal.reason);
    const t = setTimeout(() => {
      signal.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(t);
      reject(signal.reason);
    };
    signal.addEventListener("abort", onAbort, { once: true });
  });

function completionJson(
  path: string,
  id: string,
  model: string,
  text: string,
  extra: Record<string, unknown>,
) {
  const created = Math.floor(Date.now() / 1000);
  const usage = { prompt_tokens: 3, completion_tokens: 1, total_tokens: 4 };
  if (path === "/v1/chat/completions") {
    return {
      id,
      object: "chat.completion",
      created,
      model,
      choices: [{
        index: 0,
        message: { role: "assistant", content: text },
        finish_reason: "length",
        logprobs: null,
      }],
      usage,
      ...extra,
    };
  }
  return {
    id,
    object: "text_completion",
    created,
    model,
    choices: [{ index: 0, text, finish_reason: "length", logprobs: null }],
    usage,
    ...extra,
  };
}

/**
 * vLLM's own check of a request's sampling parameters that the router's changes could trip
 * (`SamplingParams._verify_args`): `min_tokens` may not exceed the token limit. Null when fine.
 */
function samplingRefusal(body: Record<string, unknown>): string | null {
  const max = body.max_completion_tokens ?? body.max_tokens;
  const min = body.min_tokens;
  if (typeof max === "number" && typeof min === "number" && min > max) {
    return `min_tokens must be less than or equal to max_tokens=${max}, got ${min}.`;
  }
  return null;
}

function chunkJson(path: string, id: string, model: string, i: number, last: boolean) {
  const created = Math.floor(Date.now() / 1000);
  const text = `tok${i} `;
  if (path === "/v1/chat/completions") {
    return {
      id,
      object: "chat.completion.chunk",
      created,
      model,
      choices: [{
        index: 0,
        delta: i === 0 ? { role: "assistant", content: text } : { content: text },
        finish_reason: last ? "length" : null,
      }],
    };
  }
  return {
    id,
    object: "text_completion",
    created,
    model,
    choices: [{ index: 0, text, finish_reason: last ? "length" : null }],
  };
}

async function generate(req: Request, path: string): Promise<Response> {
  const raw = await req.text();
  const body = JSON.parse(raw) as Record<string, unknown>;
  const requestId = req.headers.get("x-request-id");
  const rec: Recorded = {
    seq: seq++,
    path,
    requestId,
    authorization: req.headers.get("authorization"),
    body,
    raw,
    receivedAt: now(),
    finishedAt: null,
    chunksSent: 0,
    cancelled: false,
  };
  if (record) requests.push(rec);
  const signal = req.signal;
  const onAbort = () => {
    if (rec.finishedAt === null) rec.cancelled = true;
  };
  signal.addEventListener("abort", onAbort, { once: true });

  if (behaviour.delayMs > 0) {
    try {
      await sleep(behaviour.delayMs, signal);
    } catch {
      // The router gave up (timeout or its client left): `cancelled` is already recorded.
      return new Response(null, { status: 499 });
    }
  }
  const refusal = samplingRefusal(body);
  if (refusal !== null) {
    rec.finishedAt = now();
    return Response.json({
      error: { message: refusal, type: "BadRequestError", param: null, code: 400 },
    }, { status: 400 });
  }
  if (behaviour.failNext > 0) {
    behaviour.failNext--;
    rec.finishedAt = now();
    return Response.json({
      error: {
        message: `${name} is failing on purpose (HTTP ${behaviour.failStatus})`,
        type: "server_error",
        param: null,
        code: null,
      },
    }, { status: behaviour.failStatus });
  }

  const id = `cmpl-${requestId ?? "none"}`;
  const headers: Record<string, string> = {};
  if (requestId !== null) headers["x-request-id"] = requestId;
  const kv = body.kv_transfer_params as Record<string, unknown> | undefined;
  // A vLLM prefill node asked for a remote decode answers with where D can find the KV.
  const extra: Record<string, unknown> = kv?.do_remote_decode === true
    ? {
      kv_transfer_params: {
        do_remote_prefill: true,
        do_remote_decode: false,
        remote_engine_id: name,
        remote_block_ids: [rec.seq, rec.seq + 1000],
        remote_host: "127.0.0.1",
        remote_port: listenPort,
        remote_request_id: requestId,
      },
    }
    : {};
  const model = typeof body.model === "string" ? body.model : behaviour.model;

  if (body.stream !== true) {
    rec.chunksSent = 1;
    rec.finishedAt = now();
    return Response.json(completionJson(path, id, model, `${name} says hello`, extra), { headers });
  }

  if (behaviour.stepMs > 0) {
    // Like an engine, generate max_tokens tokens when the request says how many.
    const n = Number.isInteger(body.max_tokens) ? body.max_tokens as number : behaviour.chunks;
    return steppedStream(path, id, model, rec, headers, signal, n);
  }

  const { chunks, chunkDelayMs, gate, stallAfter } = behaviour;
  const stream = new ReadableStream<Uint8Array>({
    async start(controller) {
      try {
        for (let i = 0; i < chunks; i++) {
          if (i === stallAfter) await sleep(2 ** 30, signal);
          if (i > 0 && chunkDelayMs > 0) await sleep(chunkDelayMs, signal);
          if (i === 1 && gate) await new Promise<void>((r) => gateWaiters.push(r));
          if (signal.aborted) throw signal.reason;
          const data = JSON.stringify(chunkJson(path, id, model, i, i === chunks - 1));
          controller.enqueue(encoder.encode(`data: ${data}\n\n`));
          rec.chunksSent++;
        }
        controller.enqueue(encoder.encode("data: [DONE]\n\n"));
        rec.finishedAt = now();
        controller.close();
      } catch (e) {
        rec.cancelled = true;
        controller.error(e);
      }
    },
    cancel() {
      rec.cancelled = true;
    },
  });
  return new Response(stream, {
    headers: { ...headers, "content-type": "text/event-stream", "cache-control": "no-cache" },
  });
}

/** A stream served in engine-step mode. */
interface Stepped {
  next: number;
  emit: (i: number) => boolean;
}
const stepped = new Set<Stepped>();
let stepTimer: ReturnType<typeof setInterval> | undefined;

function stepAll(): void {
  for (const s of stepped) {
    if (!s.emit(s.next++)) stepped.delete(s);
  }
  if (stepped.size === 0) {
    clearInterval(stepTimer);
    stepTimer = undefined;
  }
}

/** Each chunk carries `sent_at` (wall ms, µs precision) so a client can time its delivery. */
function steppedStream(
  path: string,
  id: string,
  model: string,
  rec: Recorded,
  headers: Record<string, string>,
  signal: AbortSignal,
  chunks: number,
): Response {
  let controller!: ReadableStreamDefaultController<Uint8Array>;
  let open = true;
  const idJson = JSON.stringify(id);
  const modelJson = JSON.stringify(model);
  const created = Math.floor(Date.now() / 1000);
  const object = path === "/v1/chat/completions" ? "chat.completion.chunk" : "text_completion";
  const s: Stepped = {
    next: 0,
    emit(i) {
      if (!open) return false;
      if (i >= chunks) {
        controller.enqueue(encoder.encode("data: [DONE]\n\n"));
        controller.close();
        rec.finishedAt = now();
        open = false;
        return false;
      }
      // A template instead of JSON.stringify: this path serves thousands of chunks per second in
      // the benchmark, and the instrument must not be what limits the measurement.
      const fin = i === chunks - 1 ? '"length"' : "null";
      const text = path === "/v1/chat/completions"
        ? `"delta":{"content":"tok${i} "}`
        : `"text":"tok${i} "`;
      controller.enqueue(encoder.encode(
        `data: {"id":${idJson},"object":"${object}","created":${created},"model":${modelJson},` +
          `"choices":[{"index":0,${text},"finish_reason":${fin}}],"sent_at":${now()}}\n\n`,
      ));
      rec.chunksSent++;
      return true;
    },
  };
  signal.addEventListener("abort", () => {
    open = false;
  }, { once: true });
  const stream = new ReadableStream<Uint8Array>({
    start(c) {
      controller = c;
      s.emit(s.next++);
      stepped.add(s);
      stepTimer ??= setInterval(stepAll, behaviour.stepMs);
    },
    cancel() {
      open = false;
      rec.cancelled = true;
    },
  });
  return new Response(stream, {
    headers: { ...headers, "content-type": "text/event-stream", "cache-control": "no-cache" },
  });
}

let listenPort = 0;
Deno.serve({
  hostname: "127.0.0.1",
  port,
  onListen: (addr) => {
    listenPort = addr.port;
    console.log(JSON.stringify({ port: addr.port, name }));
  },
}, async (req) => {
  const path = new URL(req.url).pathname;
  switch (`${req.method} ${path}`) {
    case "POST /v1/completions":
    case "POST /v1/chat/completions":
      return await generate(req, path);
    case "GET /v1/models":
      modelsCalls++;
      return Response.json({
        object: "list",
        data: [{ id: behaviour.model, object: "model", created: 0, owned_by: name }],
      });
    case "GET /health":
      healthChecks++;
      return new Response(null, { status: behaviour.healthStatus });
    case "GET /_record":
      return Response.json({ requests, healthChecks, modelsCalls });
    case "POST /_control":
      Object.assign(behaviour, await req.json());
      return Response.json(behaviour);
    case "POST /_release": {
      const waiters = gateWaiters;
      gateWaiters = [];
      for (const w of waiters) w();
      return Response.json({ released: waiters.length });
    }
    case "POST /_reset":
      requests = [];
      healthChecks = 0;
      modelsCalls = 0;
      return Response.json({ ok: true });
    default:
      return new Response("not found", { status: 404 });
  }
});
