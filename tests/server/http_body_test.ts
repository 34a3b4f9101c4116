/**
 * Request bodies on the server's HTTP endpoints are held to 64 KiB while they
 * are read: an upload far over it (chunked, or announced by Content-Length)
 * is a 413 before the rest is read, the server's peak memory does not grow
 * with it, and the server keeps serving. A broken chunked body is a 400.
 */
import assert from "node:assert/strict";
import { startServer } from "./harness.ts";
import { brokenChunkedRequest, peakRssBytes, streamUpload } from "../http/raw_http.ts";

/**
 * The upload: four thousand times the limit. The server answers after the
 * first 64 KiB; the rest is headroom for a loaded machine, where the answer
 * can take a while to reach the writer (at 64 MiB, the suite on a loaded
 * 2-core machine once sent it all first).
 */
const UPLOAD_BYTES = 256 * 1024 * 1024;
/**
 * Peak memory may grow by this much at most. Reading the upload whole would
 * add ≥ 256 MiB (the old reader added ~2× the body); the bound leaves room for
 * the allocator and JIT noise, not for the body.
 */
const PEAK_GROWTH_BOUND = 32 * 1024 * 1024;

Deno.test("an oversized body on any HTTP endpoint is a 413 while it is read, and memory stays flat", async () => {
  const srv = await startServer();
  try {
    const port = Number(srv.http.slice(srv.http.lastIndexOf(":") + 1));
    // Warm the HTTP path so the baseline includes what serving itself costs.
    assert.equal((await srv.http_post("/instances/cleanup", { all: true })).status, 200);
    const before = peakRssBytes(srv.pid);
    for (
      const [path, chunked] of [
        ["/instances/cleanup", true],
        ["/instances/cleanup", false],
        ["/cache/memory/cleanup", true],
        ["/health", true],
      ] as const
    ) {
      const r = await streamUpload({ port, path, totalBytes: UPLOAD_BYTES, chunked });
      const what = `${path} (${chunked ? "chunked" : "Content-Length"})`;
      assert.ok(r.answer, `${what}: the server answered`);
      assert.equal(r.answer.status, 413, `${what}: ${r.answer.body}`);
      const body = JSON.parse(r.answer.body);
      assert.equal(body.code, "body_too_large");
      assert.match(body.error, /larger than the limit of 65536 bytes/);
      assert.equal(r.answer.headers["connection"], "close", `${what}: the connection ends`);
      assert.ok(r.sentBytes < UPLOAD_BYTES, `${what}: the server stopped the upload early`);
    }
    const growth = peakRssBytes(srv.pid) - before;
    assert.ok(
      growth < PEAK_GROWTH_BOUND,
      `peak memory grew by ${(growth / 2 ** 20).toFixed(1)} MiB for 256 MiB uploads`,
    );
    // Still serving, and a body within the limit still works.
    const h = await srv.http_get("/health");
    assert.equal(h.status, 200);
    await h.body?.cancel();
    const ok = await srv.http_post("/instances/cleanup", { all: true, pad: "x".repeat(60_000) });
    assert.equal(ok.status, 200, await ok.text());
    assert.equal((await srv.client.health()).status, "ok");
    assert.ok(srv.logs().some((l) => l.includes('"http request body refused"')));
  } finally {
    await srv.stop();
  }
});

Deno.test("a broken chunked body on the server's HTTP side is a 400, not a 500", async () => {
  const srv = await startServer();
  try {
    const port = Number(srv.http.slice(srv.http.lastIndexOf(":") + 1));
    const a = await brokenChunkedRequest(port, "/instances/cleanup");
    assert.equal(a.status, 400, a.body);
    assert.equal(JSON.parse(a.body).code, "malformed_body");
    const refused = srv.logs().filter((l) => l.includes('"http request body refused"'));
    assert.equal(refused.length, 1);
    assert.equal(JSON.parse(refused[0]).level, "warn");
    assert.ok(!srv.logs().some((l) => l.includes('"http handler failed"')));
    const h = await srv.http_get("/health");
    assert.equal(h.status, 200);
    await h.body?.cancel();
  } finally {
    await srv.stop();
  }
});

Deno.test("SIGTERM with a client stalled mid-upload: the server stops within the HTTP close wait and exits 0", async () => {
  const srv = await startServer();
  const port = Number(srv.http.slice(srv.http.lastIndexOf(":") + 1));
  // Headers and the start of a body, then silence: the HTTP layer waits for the other 90 bytes.
  const conn = await Deno.connect({ hostname: "127.0.0.1", port });
  let timer: ReturnType<typeof setTimeout> | undefined;
  try {
    await conn.write(
      new TextEncoder().encode(
        "POST /instances/cleanup HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n" +
          'content-length: 100\r\n\r\n{"all":',
      ),
    );
    await new Promise((r) => setTimeout(r, 300)); // the handler is reading that body
    Deno.kill(srv.pid, "SIGTERM");
    // The close wait (2 s) and the rest of the shutdown, with room for a loaded machine.
    const exited = await Promise.race([
      srv.status,
      new Promise<"hung">((r) => timer = setTimeout(() => r("hung"), 20_000)),
    ]);
    assert.notEqual(exited, "hung", "the server did not exit");
    assert.equal((exited as Deno.CommandStatus).code, 0);
    assert.ok(
      srv.logs().some((l) => l.includes('"msg":"HTTP connections still open at shutdown')),
      "the stalled connection is logged",
    );
  } finally {
    clearTimeout(timer);
    conn.close();
    await srv.stop();
  }
});
