/**
 * A completions `prompt` holding several prompts (`["a","b"]`, `[[1,2],[3,4]]`) cannot be split
 * between prefill and decode: vLLM's prefill answers a batch with one `kv_transfer_params` (its
 * first prompt's), so D would read the first prompt's KV for every prompt. The router refuses such
 * a batch before anything goes upstream; one prompt in any shape (a string, a token-id list, a
 * batch of one) still goes P → D. A real router process between fake engine processes.
 */

import assert from "node:assert/strict";
import OpenAI from "openai";
import { spawnBackend, spawnRouter } from "./harness.ts";

interface ErrorBody {
  error: { message: string; type: string; param: string | null; code: string };
}

/** Each of these is one prompt: P then D, D getting P's `kv_transfer_params`. */
const ONE_PROMPT: unknown[] = ["a", ["a"], [1, 2, 3], [[1, 2]]];
/** Each of these is a batch of several prompts. */
const BATCHES: Array<{ prompt: unknown; count: number }> = [
  { prompt: ["a", "b"], count: 2 },
  { prompt: [[1, 2], [3, 4], [5]], count: 3 },
];

Deno.test("a batch of several prompts is refused before P; one prompt in any shape goes P → D", async (t) => {
  const [p, d] = await Promise.all([spawnBackend("P"), spawnBackend("D")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url, "--workers", "1"]);
  const post = (id: string, body: unknown) =>
    fetch(`${router.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", "x-request-id": id },
      body: JSON.stringify(body),
    });
  try {
    for (const stream of [false, true]) {
      await t.step(
        `batches are a 400 naming 'prompt', nothing sent (stream: ${stream})`,
        async () => {
          for (const [i, { prompt, count }] of BATCHES.entries()) {
            const id = `batch-${stream}-${i}`;
            const res = await post(id, { model: "m", prompt, stream, max_tokens: 4 });
            const body = await res.json() as ErrorBody;
            assert.equal(res.status, 400, JSON.stringify(body));
            assert.equal(res.headers.get("x-request-id"), id);
            assert.equal(body.error.type, "invalid_request_error");
            assert.equal(body.error.param, "prompt");
            assert.equal(body.error.code, "unsupported_prompt_batch");
            assert.match(body.error.message, new RegExp(`batch of ${count} prompts`));
            assert.match(body.error.message, /one prompt per request/);
          }
          assert.deepEqual(await p.requests(), []);
          assert.deepEqual(await d.requests(), []);
        },
      );
    }

    await t.step(
      "an array mixing prompt shapes is a 400 invalid_prompt, nothing sent",
      async () => {
        for (const prompt of [[1, "a"], ["a", [1, 2]]]) {
          const res = await post("mixed", { model: "m", prompt });
          const body = await res.json() as ErrorBody;
          assert.equal(res.status, 400, JSON.stringify(body));
          assert.equal(body.error.param, "prompt");
          assert.equal(body.error.code, "invalid_prompt");
        }
        assert.deepEqual(await p.requests(), []);
        assert.deepEqual(await d.requests(), []);
      },
    );

    await t.step("the openai client sees a batch as a BadRequestError on 'prompt'", async () => {
      const openai = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: "k", maxRetries: 0 });
      const err = await openai.completions.create({ model: "m", prompt: ["a", "b"] })
        .then(() => assert.fail("expected a 400"), (e) => e);
      assert.ok(err instanceof OpenAI.BadRequestError, String(err));
      assert.equal(err.param, "prompt");
      assert.equal(err.code, "unsupported_prompt_batch");
      assert.deepEqual(await p.requests(), []);
    });

    await t.step("n > 1 is still refused as n, not as a batch", async () => {
      const res = await post("n2", { model: "m", prompt: "a", n: 2 });
      const body = await res.json() as ErrorBody;
      assert.equal(res.status, 400);
      assert.equal(body.error.code, "unsupported_n");
      assert.deepEqual(await p.requests(), []);
    });

    for (const stream of [false, true]) {
      await t.step(`one prompt in every shape goes P → D (stream: ${stream})`, async () => {
        for (const [i, prompt] of ONE_PROMPT.entries()) {
          await Promise.all([p.reset(), d.reset()]);
          const id = `one-${stream}-${i}`;
          const res = await post(id, { model: "m", prompt, stream, n: 1 });
          const text = await res.text();
          assert.equal(res.status, 200, `${JSON.stringify(prompt)}: ${text}`);
          if (stream) assert.match(text, /data: \[DONE\]/);
          const [pr, dr] = [await p.requests(), await d.requests()];
          assert.equal(pr.length, 1, JSON.stringify(prompt));
          assert.equal(dr.length, 1, JSON.stringify(prompt));
          assert.deepEqual(pr[0].body.prompt, prompt);
          assert.equal(
            (pr[0].body.kv_transfer_params as Record<string, unknown>).do_remote_decode,
            true,
          );
          assert.deepEqual(dr[0].body.prompt, prompt);
          const kv = dr[0].body.kv_transfer_params as Record<string, unknown>;
          assert.equal(kv.remote_engine_id, "P");
          assert.equal(kv.remote_request_id, id);
        }
      });
    }

    await t.step("a chat conversation of several messages is one request, P → D", async () => {
      await Promise.all([p.reset(), d.reset()]);
      const messages = [
        { role: "system", content: "be brief" },
        { role: "user", content: "a" },
        { role: "assistant", content: "b" },
        { role: "user", content: "c" },
      ];
      const res = await fetch(`${router.url}/v1/chat/completions`, {
        method: "POST",
        body: JSON.stringify({ model: "m", messages }),
      });
      assert.equal(res.status, 200, await res.clone().text());
      await res.body?.cancel();
      assert.equal((await p.requests()).length, 1);
      assert.deepEqual((await d.requests())[0].body.messages, messages);
    });
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});
