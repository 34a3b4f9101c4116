/**
 * The shared body reader (lib/http/body.ts) in process: the limit holds while
 * reading, a declared length over it is refused before any byte is read, and
 * a body that fails to arrive is a 400, not an internal error.
 */
import assert from "node:assert/strict";
import { BodyError, readBodyLimited } from "../../lib/http/body.ts";

/** A body of `chunks` × 100 bytes that counts how many chunks were pulled. */
function countingBody(chunks: number) {
  const seen = { pulled: 0 };
  const body = new ReadableStream<Uint8Array>({
    pull(c) {
      seen.pulled++;
      c.enqueue(new Uint8Array(100).fill(0x20));
      if (seen.pulled === chunks) c.close();
    },
  });
  return { body, seen };
}

Deno.test("a body without a length is refused with 413 once it passes the limit", async () => {
  const { body, seen } = countingBody(1000);
  const req = new Request("http://x/", { method: "POST", body });
  await assert.rejects(readBodyLimited(req, { maxBytes: 250, hint: "raise it with --x" }), (e) => {
    assert.ok(e instanceof BodyError);
    assert.equal(e.status, 413);
    assert.equal(e.code, "body_too_large");
    assert.match(
      e.message,
      /at least 300 bytes, larger than the limit of 250 bytes \(raise it with --x\)/,
    );
    return true;
  });
  assert.ok(
    seen.pulled < 10,
    `pulled ${seen.pulled} chunks of a 100 kB body with a 250-byte limit`,
  );
});

Deno.test("a Content-Length over the limit is refused before any byte is read", async () => {
  const { body, seen } = countingBody(1000);
  const req = new Request("http://x/", {
    method: "POST",
    body,
    headers: { "content-length": "100000" },
  });
  const pulledBefore = seen.pulled; // a ReadableStream pulls once when it is built
  await assert.rejects(
    readBodyLimited(req, { maxBytes: 250 }),
    (e) =>
      e instanceof BodyError && e.status === 413 &&
      /100000 bytes \(Content-Length\)/.test(e.message),
  );
  assert.equal(seen.pulled, pulledBefore);
});

Deno.test("bodies within the limit come back whole; no body is empty", async () => {
  const { body } = countingBody(3);
  const got = await readBodyLimited(new Request("http://x/", { method: "POST", body }), {
    maxBytes: 300,
  });
  assert.equal(got.byteLength, 300);
  const one = await readBodyLimited(new Request("http://x/", { method: "POST", body: "{}" }), {
    maxBytes: 2,
  });
  assert.equal(new TextDecoder().decode(one), "{}");
  const none = await readBodyLimited(new Request("http://x/"), { maxBytes: 0 });
  assert.equal(none.byteLength, 0);
});

Deno.test("a body that fails while arriving is a 400 malformed_body naming the cause", async () => {
  let n = 0;
  const body = new ReadableStream<Uint8Array>({
    pull(c) {
      if (n++ === 0) c.enqueue(new Uint8Array(10));
      else c.error(new Error("invalid chunk size line"));
    },
  });
  await assert.rejects(
    readBodyLimited(new Request("http://x/", { method: "POST", body }), { maxBytes: 1000 }),
    (e) =>
      e instanceof BodyError && e.status === 400 && e.code === "malformed_body" &&
      /invalid chunk size line/.test(e.message),
  );
});

Deno.test("a body that stalls mid-upload is a 408 body_timeout at its deadline, not a wait for ever", async () => {
  const stalled = new ReadableStream<Uint8Array>({
    start(c) {
      c.enqueue(new Uint8Array(10)); // then nothing more, and no end
    },
  });
  const req = new Request("http://x/", { method: "POST", body: stalled });
  await assert.rejects(
    readBodyLimited(req, { maxBytes: 1 << 20, timeoutMs: 50 }),
    (e: unknown) =>
      e instanceof BodyError && e.status === 408 && e.code === "body_timeout" &&
      /not received within 50 ms/.test(e.message),
  );
  await req.body?.cancel().catch(() => {}); // the stream is still locked by the abandoned read
});
