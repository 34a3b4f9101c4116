/** Request intake and the body P receives. */

import assert from "node:assert/strict";
import fc from "fast-check";
import { RouterError } from "../../lib/router/errors.ts";
import { prefillBody } from "../../lib/router/upstream_bodies.ts";
import { parseGenerationRequest, readRequestBody } from "../../lib/router/validate.ts";

const enc = (v: unknown) => new TextEncoder().encode(typeof v === "string" ? v : JSON.stringify(v));

Deno.test("one prompt in every OpenAI shape is accepted", () => {
  for (const prompt of ["hi", ["a"], [1, 2, 3], [[1, 2]]]) {
    const r = parseGenerationRequest("/v1/completions", enc({ model: "m", prompt, n: 1 }));
    assert.equal(r.stream, false);
    assert.deepEqual(r.body.prompt, prompt);
  }
  const chat = parseGenerationRequest(
    "/v1/chat/completions",
    enc({
      model: "m",
      messages: [{ role: "user", content: "x" }],
      stream: true,
    }),
  );
  assert.equal(chat.stream, true);
});

Deno.test("property: any n above 1 is refused with param 'n'", () => {
  fc.assert(fc.property(fc.integer({ min: 2, max: 1_000_000 }), (n) => {
    try {
      parseGenerationRequest("/v1/completions", enc({ model: "m", prompt: "x", n }));
      return false;
    } catch (e) {
      return e instanceof RouterError && e.status === 400 && e.param === "n" &&
        e.message.includes(`n=${n}`);
    }
  }));
});

Deno.test("property: a batch of several prompts is refused with param 'prompt', naming its size", () => {
  const batch = fc.oneof(
    fc.array(fc.string(), { minLength: 2, maxLength: 64 }),
    fc.array(fc.array(fc.nat(), { maxLength: 4 }), { minLength: 2, maxLength: 64 }),
  );
  fc.assert(fc.property(batch, (prompt) => {
    try {
      parseGenerationRequest("/v1/completions", enc({ model: "m", prompt }));
      return false;
    } catch (e) {
      return e instanceof RouterError && e.status === 400 && e.param === "prompt" &&
        e.code === "unsupported_prompt_batch" &&
        e.message.includes(`batch of ${prompt.length} prompts`);
    }
  }));
});

Deno.test("invalid UTF-8 is refused as not JSON", () => {
  assert.throws(
    () => parseGenerationRequest("/v1/completions", new Uint8Array([0x7b, 0xff, 0x7d])),
    (e) => e instanceof RouterError && e.code === "invalid_json",
  );
});

Deno.test("prefill body: one token, no stream, no stream_options, remote decode requested", () => {
  const original = {
    model: "m",
    messages: [{ role: "user", content: "x" }],
    max_completion_tokens: 50,
    stream: true,
    stream_options: { include_usage: true },
    kv_transfer_params: { do_remote_decode: false },
  };
  const copy = structuredClone(original);
  const p = prefillBody(original);
  assert.deepEqual(original, copy, "the client's body is not mutated");
  assert.equal(p.max_tokens, 1);
  assert.equal(p.max_completion_tokens, 1);
  assert.equal(p.stream, false);
  assert.equal("stream_options" in p, false);
  assert.equal((p.kv_transfer_params as Record<string, unknown>).do_remote_decode, true);
  assert.equal("max_completion_tokens" in prefillBody({ model: "m", prompt: "x" }), false);
});

Deno.test("readRequestBody stops reading once the limit is passed, with a 413", async () => {
  let pulled = 0;
  const body = new ReadableStream<Uint8Array>({
    pull(c) {
      pulled++;
      c.enqueue(new Uint8Array(100));
      if (pulled === 1000) c.close();
    },
  });
  const req = new Request("http://x/v1/completions", { method: "POST", body });
  await assert.rejects(
    readRequestBody(req, 250),
    (e) => e instanceof RouterError && e.status === 413 && e.code === "body_too_large",
  );
  assert.ok(pulled < 10, `read ${pulled} chunks of a 100 kB body with a 250-byte limit`);
});
