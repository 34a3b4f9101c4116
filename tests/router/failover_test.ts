/**
 * What the router does when backends misbehave: retries, health take-out and put-back, no
 * backend at all, timeouts, and a client that goes away. Real processes on loopback.
 */

import assert from "node:assert/strict";
import OpenAI from "openai";
import { metricValue, spawnBackend, spawnRouter, waitFor } from "./harness.ts";

const client = (url: string) => new OpenAI({ baseURL: `${url}/v1`, apiKey: "k", maxRetries: 0 });
const ids = async (b: { requests(): Promise<{ requestId: string | null }[]> }) =>
  (await b.requests()).map((r) => r.requestId);

Deno.test("router survives failing, slow and vanishing backends", async (t) => {
  const [p0, p1, d0, d1] = await Promise.all(
    ["P0", "P1", "D0", "D1"].map((n) => spawnBackend(n)),
  );
  const router = await spawnRouter([
    "--prefill",
    p0.url,
    "--prefill",
    p1.url,
    "--decode",
    d0.url,
    "--decode",
    d1.url,
    "--health-interval",
    "100ms",
    "--health-timeout",
    "1s",
    "--prefill-timeout",
    "2s",
    "--decode-timeout",
    "2s",
    "--stream-idle-timeout",
    "1500ms",
  ]);
  const openai = client(router.url);
  const health = async () => await (await fetch(`${router.url}/health`)).json();
  const healthyUrls = async (role: "prefill" | "decode") =>
    ((await health())[role].backends as { url: string; healthy: boolean }[])
      .filter((b) => b.healthy).map((b) => b.url);
  try {
    await t.step(
      "a 503 from P is retried once, on the other P, under the same request id",
      async () => {
        await p0.control({ failNext: 1, failStatus: 503 });
        // Which P is tried first is the pool's choice: send until P0 has failed once.
        for (let i = 0; i < 4 && (await p0.requests()).length === 0; i++) {
          const r = await openai.completions.create({ model: "m", prompt: "x" }, {
            headers: { "X-Request-Id": `retry-${i}` },
          });
          assert.match(r.choices[0].text, /^D[01] says hello$/);
        }
        const failed = (await p0.requests())[0];
        assert.ok(failed, "P0 was tried");
        assert.ok((await ids(p1)).includes(failed.requestId), "the same id was retried on P1");
        assert.ok(
          (await ids(d0)).includes(failed.requestId) || (await ids(d1)).includes(failed.requestId),
          "the retried request reached D",
        );
        const m = await router.metrics();
        assert.equal(
          metricValue(m, "pegaflow_router_retries_total", { role: "prefill", reason: "http_503" }),
          1,
        );
      },
    );

    await t.step(
      "requests spread over both decode backends (least inflight, ties rotate)",
      async () => {
        await Promise.all([d0.reset(), d1.reset()]);
        for (let i = 0; i < 6; i++) {
          await openai.completions.create({ model: "m", prompt: "spread" });
        }
        assert.equal((await d0.requests()).length, 3);
        assert.equal((await d1.requests()).length, 3);
      },
    );

    await t.step(
      "a failing health check takes a decode backend out; passing puts it back",
      async () => {
        await d0.control({ healthStatus: 503 });
        await waitFor(
          "D0 out of service",
          async () => !(await healthyUrls("decode")).includes(d0.url),
        );
        assert.equal(
          metricValue(await router.metrics(), "pegaflow_router_backend_healthy", {
            backend: d0.url,
          }),
          0,
        );
        await Promise.all([d0.reset(), d1.reset()]);
        for (let i = 0; i < 4; i++) {
          await openai.completions.create({ model: "m", prompt: "out" });
        }
        assert.equal((await d0.requests()).length, 0, "nothing sent to the backend out of service");
        assert.equal((await d1.requests()).length, 4);

        await d0.control({ healthStatus: 200 });
        await waitFor(
          "D0 back in service",
          async () => (await healthyUrls("decode")).includes(d0.url),
        );
        for (let i = 0; i < 4; i++) {
          await openai.completions.create({ model: "m", prompt: "back" });
        }
        assert.equal((await d0.requests()).length, 2, "D0 serves again");
      },
    );

    await t.step(
      "no healthy decode backend: 503 with an OpenAI error, and nothing sent upstream",
      async () => {
        await Promise.all([d0.control({ healthStatus: 500 }), d1.control({ healthStatus: 500 })]);
        await waitFor("router unhealthy", async () => (await health()).status === "unavailable");
        await Promise.all([p0.reset(), p1.reset(), d0.reset(), d1.reset()]);
        const err = await openai.completions.create({ model: "m", prompt: "x" }).then(
          () => assert.fail("expected 503"),
          (e) => e,
        );
        assert.ok(err instanceof OpenAI.APIError);
        assert.equal(err.status, 503);
        assert.equal(err.code, "no_decode_backend");
        assert.equal(err.type, "server_error");
        assert.match(err.message, /no healthy decode backend/);
        for (const b of [p0, p1, d0, d1]) {
          assert.equal((await b.requests()).length, 0);
        }
        assert.equal((await fetch(`${router.url}/health`)).status, 503);
        await Promise.all([d0.control({ healthStatus: 200 }), d1.control({ healthStatus: 200 })]);
        await waitFor("router healthy", async () => (await health()).status === "ok");
      },
    );

    await t.step(
      "a prefill that outlasts --prefill-timeout: 504, P's request cancelled, D not called",
      async () => {
        await Promise.all([p0.control({ delayMs: 5000 }), p1.control({ delayMs: 5000 })]);
        await Promise.all([p0.reset(), p1.reset(), d0.reset(), d1.reset()]);
        const err = await openai.completions.create({ model: "m", prompt: "slow" }).then(
          () => assert.fail("expected 504"),
          (e) => e,
        );
        assert.equal(err.status, 504);
        assert.equal(err.code, "prefill_timeout");
        const tried = [...await p0.requests(), ...await p1.requests()];
        assert.equal(tried.length, 1, "a timeout is not retried");
        await waitFor(
          "P sees the cancellation",
          async () => [...await p0.requests(), ...await p1.requests()].every((r) => r.cancelled),
        );
        assert.equal((await d0.requests()).length + (await d1.requests()).length, 0);
        await Promise.all([p0.control({ delayMs: 0 }), p1.control({ delayMs: 0 })]);
      },
    );

    await t.step("a decode that sends no headers within --decode-timeout: 504", async () => {
      await Promise.all([d0.control({ delayMs: 5000 }), d1.control({ delayMs: 5000 })]);
      const err = await openai.completions.create({ model: "m", prompt: "slow" }).then(
        () => assert.fail("expected 504"),
        (e) => e,
      );
      assert.equal(err.status, 504);
      assert.equal(err.code, "decode_timeout");
      await Promise.all([d0.control({ delayMs: 0 }), d1.control({ delayMs: 0 })]);
    });

    await t.step(
      "a decode stream that stalls past --stream-idle-timeout ends with an error event",
      async () => {
        await Promise.all([d0.reset(), d1.reset()]);
        await Promise.all([d0.control({ stallAfter: 2 }), d1.control({ stallAfter: 2 })]);
        const stream = await openai.completions.create({
          model: "m",
          prompt: "stall",
          stream: true,
        });
        const got: string[] = [];
        const err = await (async () => {
          for await (const c of stream) got.push(c.choices[0].text);
        })().then(() => assert.fail("expected the stream to fail"), (e) => e);
        assert.deepEqual(got, ["tok0 ", "tok1 "]);
        assert.match(String(err.message), /sent nothing for 1500 ms/);
        await waitFor(
          "D's stream cancelled",
          async () => [...await d0.requests(), ...await d1.requests()].some((r) => r.cancelled),
        );
        await Promise.all([d0.control({ stallAfter: -1 }), d1.control({ stallAfter: -1 })]);
      },
    );

    await t.step(
      "the inspecting relay (idle timeout on) also delivers each chunk as it comes",
      async () => {
        await Promise.all([
          d0.control({ chunks: 3, gate: true }),
          d1.control({ chunks: 3, gate: true }),
        ]);
        const stream = await openai.completions.create({
          model: "m",
          prompt: "gate",
          stream: true,
        });
        const it = stream[Symbol.asyncIterator]();
        const first = await it.next();
        assert.equal(first.value?.choices[0].text, "tok0 ");
        await Promise.all([d0.release(), d1.release()]);
        let n = 1;
        for (let r = await it.next(); !r.done; r = await it.next()) n++;
        assert.equal(n, 3);
        await Promise.all([
          d0.control({ chunks: 5, gate: false }),
          d1.control({ chunks: 5, gate: false }),
        ]);
      },
    );

    await t.step("a client that leaves mid-stream cancels D's generation", async () => {
      await Promise.all([d0.reset(), d1.reset()]);
      await Promise.all([
        d0.control({ chunks: 200, chunkDelayMs: 20 }),
        d1.control({ chunks: 200, chunkDelayMs: 20 }),
      ]);
      const stream = await openai.completions.create({ model: "m", prompt: "long", stream: true });
      const it = stream[Symbol.asyncIterator]();
      assert.equal((await it.next()).done, false);
      stream.controller.abort();
      await waitFor(
        "D's stream cancelled",
        async () => [...await d0.requests(), ...await d1.requests()].some((r) => r.cancelled),
      );
      const rec = [...await d0.requests(), ...await d1.requests()][0];
      assert.ok(rec.chunksSent < 200, `D stopped early (sent ${rec.chunksSent})`);
      await waitFor(
        "499 counted",
        async () =>
          metricValue(await router.metrics(), "pegaflow_router_requests_total", {
            route: "/v1/completions",
            status: "499",
          }) === 1,
      );
      await Promise.all([
        d0.control({ chunks: 5, chunkDelayMs: 0 }),
        d1.control({ chunks: 5, chunkDelayMs: 0 }),
      ]);
    });

    await t.step(
      "a client that leaves during prefill cancels P and D is never called",
      async () => {
        await Promise.all([p0.reset(), p1.reset(), d0.reset(), d1.reset()]);
        await Promise.all([p0.control({ delayMs: 1500 }), p1.control({ delayMs: 1500 })]);
        const ac = new AbortController();
        const pending = openai.completions.create({ model: "m", prompt: "bye" }, {
          signal: ac.signal,
        })
          .then(() => "answered", (e) => e);
        await waitFor(
          "P received the request",
          async () => (await p0.requests()).length + (await p1.requests()).length === 1,
        );
        ac.abort();
        assert.ok((await pending) instanceof Error);
        await waitFor(
          "P's request cancelled",
          async () => [...await p0.requests(), ...await p1.requests()].every((r) => r.cancelled),
        );
        // Past P's delay: a router that kept going would have called D by now.
        await new Promise((r) => setTimeout(r, 1600));
        assert.equal((await d0.requests()).length + (await d1.requests()).length, 0);
        await Promise.all([p0.control({ delayMs: 0 }), p1.control({ delayMs: 0 })]);
      },
    );
  } finally {
    await Promise.all([router.stop(), p0.stop(), p1.stop(), d0.stop(), d1.stop()]);
  }
});

Deno.test("a backend that dies between health checks is failed over at once and taken out", async () => {
  const [pDying, pLive, dDying, dLive] = await Promise.all(
    ["Px", "P1", "Dx", "D1"].map((n) => spawnBackend(n)),
  );
  // Health checks far apart: only the request path can notice the dead backends.
  const router = await spawnRouter([
    "--prefill",
    pDying.url,
    "--prefill",
    pLive.url,
    "--decode",
    dDying.url,
    "--decode",
    dLive.url,
    "--health-interval",
    "60s",
  ]);
  try {
    await Promise.all([pDying.stop(), dDying.stop()]);
    const openai = client(router.url);
    for (let i = 0; i < 3; i++) {
      const r = await openai.completions.create({ model: "m", prompt: "x" });
      assert.equal(r.choices[0].text, "D1 says hello");
    }
    assert.equal((await pLive.requests()).length, 3);
    const m = await router.metrics();
    assert.equal(
      metricValue(m, "pegaflow_router_retries_total", { role: "prefill", reason: "connect" }),
      1,
    );
    assert.equal(
      metricValue(m, "pegaflow_router_retries_total", { role: "decode", reason: "connect" }),
      1,
    );
    assert.equal(
      metricValue(m, "pegaflow_router_backend_healthy", { role: "prefill", backend: pDying.url }),
      0,
    );
    assert.equal(
      metricValue(m, "pegaflow_router_backend_healthy", { role: "decode", backend: dDying.url }),
      0,
    );
  } finally {
    await Promise.all([router.stop(), pLive.stop(), dLive.stop()]);
  }
});

/**
 * A "backend" that passes health checks but closes the connection on every generation request
 * without answering: what a router sees when an engine closes a keep-alive connection under it.
 */
function rudeBackend() {
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  let posts = 0;
  const serve = async (conn: Deno.Conn) => {
    const buf = new Uint8Array(64 * 1024);
    let head = "";
    while (!head.includes("\r\n\r\n")) {
      const n = await conn.read(buf);
      if (n === null) break;
      head += new TextDecoder().decode(buf.subarray(0, n));
    }
    if (head.startsWith("GET ")) {
      await conn.write(
        new TextEncoder().encode(
          "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        ),
      );
    } else if (head.startsWith("POST ")) {
      posts++;
    }
    conn.close();
  };
  const accepting = (async () => {
    for await (const conn of listener) {
      serve(conn).catch((e) => {
        // A peer that hung up first is expected here; anything else should fail the test.
        if (!(e instanceof Deno.errors.ConnectionReset) && !(e instanceof Deno.errors.BrokenPipe)) {
          throw e;
        }
      });
    }
  })();
  return {
    url: `http://127.0.0.1:${listener.addr.port}`,
    posts: () => posts,
    stop: async () => {
      listener.close();
      await accepting.catch((e) => assert.ok(e instanceof Deno.errors.BadResource, String(e)));
    },
  };
}

Deno.test("a decode connection closed before any answer is retried once on another decode", async () => {
  const rude = rudeBackend();
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D1")]);
  const router = await spawnRouter([
    "--prefill",
    p.url,
    "--decode",
    rude.url,
    "--decode",
    d.url,
    "--health-interval",
    "60s",
  ]);
  try {
    const openai = client(router.url);
    for (let i = 0; i < 3; i++) {
      const r = await openai.completions.create({ model: "m", prompt: "x" });
      assert.equal(r.choices[0].text, "D1 says hello");
    }
    assert.ok(rude.posts() >= 1, "the closing backend was tried");
    const m = await router.metrics();
    assert.equal(
      metricValue(m, "pegaflow_router_retries_total", { role: "decode", reason: "network" }),
      rude.posts(),
    );
    assert.equal((await d.requests()).length, 3);
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
    await rude.stop();
  }
});

Deno.test("with a single prefill backend a 503 is retried on the same backend", async () => {
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D0")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url]);
  try {
    await p.control({ failNext: 1, failStatus: 503 });
    const r = await client(router.url).completions.create({ model: "m", prompt: "x" }, {
      headers: { "X-Request-Id": "once-more" },
    });
    assert.equal(r.choices[0].text, "D0 says hello");
    assert.deepEqual(await ids(p), ["once-more", "once-more"]);
    // Only one retry: two 503s in a row are the client's answer.
    await p.control({ failNext: 2, failStatus: 503 });
    const err = await client(router.url).completions.create({ model: "m", prompt: "x" }).then(
      () => assert.fail("expected 503"),
      (e) => e,
    );
    assert.equal(err.status, 503);
    assert.equal(err.code, "prefill_unavailable");
    assert.match(err.message, /after 2 attempt\(s\)/);
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});

Deno.test("SIGTERM lets an open stream finish, then the router exits 0", async () => {
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D0")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url]);
  try {
    await d.control({ chunks: 10, chunkDelayMs: 50 });
    const stream = await client(router.url).completions.create({
      model: "m",
      prompt: "x",
      stream: true,
    });
    const it = stream[Symbol.asyncIterator]();
    assert.equal((await it.next()).done, false);
    Deno.kill(router.pid, "SIGTERM");
    let n = 1;
    for (let r = await it.next(); !r.done; r = await it.next()) n++;
    assert.equal(n, 10, "the stream in flight was served to its end");
    const status = await router.status;
    assert.equal(status.code, 0);
    assert.match(router.stderr(), /"msg":"stopped"/);
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});

Deno.test("SIGTERM with a client stalled mid-upload: the router cuts it after the grace and exits 0", async () => {
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D0")]);
  const router = await spawnRouter(["--prefill", p.url, "--decode", d.url]);
  // Headers and the start of a body, then silence: the HTTP layer waits for the other 90 bytes.
  const conn = await Deno.connect({ hostname: "127.0.0.1", port: router.port });
  let timer: ReturnType<typeof setTimeout> | undefined;
  try {
    await conn.write(
      new TextEncoder().encode(
        "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n" +
          'content-length: 100\r\n\r\n{"model":',
      ),
    );
    // Let the router's handler start reading that body.
    await new Promise((r) => setTimeout(r, 300));
    Deno.kill(router.pid, "SIGTERM");
    // The grace period (10 s) and the cut (2 s), plus room for a loaded machine.
    const exited = await Promise.race([
      router.status,
      new Promise<"hung">((r) => timer = setTimeout(() => r("hung"), 25_000)),
    ]);
    assert.notEqual(exited, "hung", `the router did not exit: ${router.stderr()}`);
    assert.equal((exited as Deno.CommandStatus).code, 0);
    assert.match(router.stderr(), /"msg":"shutdown grace period over; cutting open requests"/);
    assert.match(router.stderr(), /connections still open after the cut/);
  } finally {
    clearTimeout(timer);
    conn.close();
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});
