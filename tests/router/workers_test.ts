/**
 * `--workers 3`: three threads serve one port and must still behave as one router. Every request
 * goes on a new connection, so Linux spreads them over the workers (each worker logs its number,
 * and the test checks that all three served). Real processes on loopback.
 */

import assert from "node:assert/strict";
import OpenAI from "openai";
import {
  type FakeBackend,
  fresh,
  metricValue,
  spawnBackend,
  spawnRouter,
  waitFor,
} from "./harness.ts";

const WORKERS = 3;
/** Enough new connections that each of 3 workers gets some: all on one is (2/3)^29·3 ≈ 2e-5. */
const SPREAD_REQUESTS = 30;

const complete = (url: string, id: string, extra: Record<string, unknown> = {}) =>
  fresh(`${url}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json", "x-request-id": id },
    body: JSON.stringify({ model: "m", prompt: "x", max_tokens: 5, ...extra }),
  });

/** Worker numbers in the router's `request done` debug lines for these request ids. */
function workersThatServed(stderr: string, ids: ReadonlySet<string>): Set<number> {
  const seen = new Set<number>();
  for (const line of stderr.split("\n")) {
    if (!line.includes('"msg":"request done"')) continue;
    const j = JSON.parse(line) as { worker?: number; request_id?: string };
    if (j.request_id !== undefined && ids.has(j.request_id) && typeof j.worker === "number") {
      seen.add(j.worker);
    }
  }
  return seen;
}

const ids = async (b: FakeBackend) => (await b.requests()).map((r) => r.requestId);

Deno.test("with --workers 3 the router still acts as one: P/D flow, metrics, health", async (t) => {
  const [p, d0, d1] = await Promise.all(["P0", "D0", "D1"].map((n) => spawnBackend(n)));
  const router = await spawnRouter([
    "--prefill",
    p.url,
    "--decode",
    d0.url,
    "--decode",
    d1.url,
    "--workers",
    String(WORKERS),
    "--health-interval",
    "100ms",
    "--log-level",
    "debug",
  ]);
  const health = async () => await (await fresh(`${router.url}/health`)).json();
  try {
    await t.step("every worker serves the P/D flow with the request's id", async () => {
      const sent = new Set<string>();
      for (let i = 0; i < SPREAD_REQUESTS; i++) {
        const id = `spread-${i}`;
        sent.add(id);
        const stream = i % 2 === 0;
        const res = await complete(router.url, id, stream ? { stream: true } : {});
        assert.equal(res.status, 200);
        assert.equal(res.headers.get("x-request-id"), id);
        const text = await res.text();
        // Streams relay D's five chunks; a plain answer names the D that made it.
        assert.match(text, stream ? /"text":"tok4 ","finish_reason":"length"/ : /D[01] says hello/);
      }
      const atP = (await p.requests()).filter((r) => sent.has(r.requestId ?? ""));
      assert.equal(atP.length, SPREAD_REQUESTS);
      for (const r of atP) {
        assert.equal(r.body.max_tokens, 1);
        assert.equal(r.body.stream, false);
      }
      const atD = [...await ids(d0), ...await ids(d1)].filter((id) => sent.has(id ?? ""));
      assert.equal(atD.length, SPREAD_REQUESTS);
      // Shared least-inflight with a shared tie cursor: sequential requests alternate over D.
      assert.ok((await ids(d0)).length > 0 && (await ids(d1)).length > 0, "both D were used");
      await waitFor(
        "every worker's 'request done' line",
        () => workersThatServed(router.stderr(), sent).size === WORKERS,
      );
    });

    await t.step("bad input is a 400 on every worker and nothing goes upstream", async () => {
      const before = (await p.requests()).length + (await d0.requests()).length +
        (await d1.requests()).length;
      for (let i = 0; i < 6; i++) {
        const res = await fresh(`${router.url}/v1/completions`, {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ model: "m", prompt: "x", n: 2 }),
        });
        assert.equal(res.status, 400);
        assert.equal((await res.json()).error.param, "n");
      }
      const after = (await p.requests()).length + (await d0.requests()).length +
        (await d1.requests()).length;
      assert.equal(after, before);
    });

    await t.step("/metrics on any worker counts the requests of all workers", async () => {
      // Each scrape lands on some worker; every one must give the whole router's counts.
      for (let i = 0; i < 6; i++) {
        const m = await (await fresh(`${router.url}/metrics`)).text();
        assert.equal(
          metricValue(m, "pegaflow_router_requests_total", {
            route: "/v1/completions",
            status: "200",
          }),
          SPREAD_REQUESTS,
        );
        assert.equal(
          metricValue(m, "pegaflow_router_requests_total", {
            route: "/v1/completions",
            status: "400",
          }),
          6,
        );
        assert.equal(
          metricValue(m, "pegaflow_router_request_duration_seconds_count", {
            route: "/v1/completions",
          }),
          SPREAD_REQUESTS + 6,
        );
        // Shared state is reported once, not once per worker.
        assert.equal(
          metricValue(m, "pegaflow_router_backend_healthy", { role: "decode", backend: d0.url }),
          1,
        );
        assert.equal(
          metricValue(m, "pegaflow_router_backend_inflight", { role: "decode", backend: d0.url }),
          0,
        );
      }
    });

    await t.step(
      "a failing health check takes D out of every worker, a passing one puts it back",
      async () => {
        await d1.control({ healthStatus: 500 });
        await waitFor("D1 out of service", async () => {
          const h = await health();
          return h.decode.backends[1].healthy === false;
        });
        const before = (await d1.requests()).length;
        const sent = new Set<string>();
        for (let i = 0; i < SPREAD_REQUESTS; i++) {
          const id = `down-${i}`;
          sent.add(id);
          const res = await complete(router.url, id);
          assert.equal(res.status, 200);
          assert.match(await res.text(), /D0 says hello/);
        }
        assert.equal((await d1.requests()).length, before, "no worker sent anything to D1");
        await waitFor(
          "all workers served while D1 was out",
          () => workersThatServed(router.stderr(), sent).size === WORKERS,
        );
        // Every worker's /health says why.
        for (let i = 0; i < 6; i++) {
          const h = await health();
          assert.equal(h.decode.backends[1].healthy, false);
          assert.match(String(h.decode.backends[1].error), /HTTP 500/);
        }
        await d1.control({ healthStatus: 200 });
        await waitFor("D1 back", async () => (await health()).decode.backends[1].healthy === true);
        for (let i = 0; i < 6; i++) {
          const res = await complete(router.url, `up-${i}`);
          assert.equal(res.status, 200);
          await res.text();
        }
        assert.ok((await d1.requests()).length > before, "D1 serves again");
      },
    );

    await t.step("a client that leaves mid-stream is counted as 499 across workers", async () => {
      await d0.control({ chunks: 500, chunkDelayMs: 10 });
      await d1.control({ chunks: 500, chunkDelayMs: 10 });
      const openai = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: "k", maxRetries: 0 });
      const stream = await openai.completions.create({ model: "m", prompt: "x", stream: true });
      const it = stream[Symbol.asyncIterator]();
      assert.equal((await it.next()).done, false);
      stream.controller.abort();
      await waitFor("499 counted and nothing left in flight", async () => {
        const m = await (await fresh(`${router.url}/metrics`)).text();
        return metricValue(m, "pegaflow_router_requests_total", {
              route: "/v1/completions",
              status: "499",
            }) === 1 &&
          metricValue(m, "pegaflow_router_inflight_requests") === 0 &&
          metricValue(m, "pegaflow_router_backend_inflight", { role: "decode", backend: d0.url }) +
                metricValue(m, "pegaflow_router_backend_inflight", {
                  role: "decode",
                  backend: d1.url,
                }) === 0;
      });
    });
  } finally {
    await Promise.all([router.stop(), p.stop(), d0.stop(), d1.stop()]);
  }
});

Deno.test("with --workers 3 a backend one worker finds dead is out for all of them", async () => {
  const [pLive, dDying, dLive] = await Promise.all(["P1", "Dx", "D1"].map((n) => spawnBackend(n)));
  // Health checks far apart: only the request path can notice the dead backend.
  const router = await spawnRouter([
    "--prefill",
    pLive.url,
    "--decode",
    dDying.url,
    "--decode",
    dLive.url,
    "--workers",
    String(WORKERS),
    "--health-interval",
    "60s",
    "--log-level",
    "debug",
  ]);
  try {
    await dDying.stop();
    const sent = new Set<string>();
    for (let i = 0; i < SPREAD_REQUESTS; i++) {
      const id = `dead-${i}`;
      sent.add(id);
      const res = await complete(router.url, id);
      assert.equal(res.status, 200);
      assert.match(await res.text(), /D1 says hello/);
    }
    await waitFor(
      "all workers served",
      () => workersThatServed(router.stderr(), sent).size === WORKERS,
    );
    const m = await (await fresh(`${router.url}/metrics`)).text();
    // One refused connection in the whole router: the worker that met it took Dx out for all.
    assert.equal(
      metricValue(m, "pegaflow_router_retries_total", { role: "decode", reason: "connect" }),
      1,
    );
    assert.equal(
      metricValue(m, "pegaflow_router_backend_healthy", { role: "decode", backend: dDying.url }),
      0,
    );
    for (let i = 0; i < 6; i++) {
      const h = await (await fresh(`${router.url}/health`)).json();
      assert.equal(h.decode.backends[0].healthy, false);
      assert.match(String(h.decode.backends[0].error), /connection failed/);
    }
  } finally {
    await Promise.all([router.stop(), pLive.stop(), dLive.stop()]);
  }
});

Deno.test("with --workers 3 SIGTERM lets an open stream finish, then the router exits 0", async () => {
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D0")]);
  const router = await spawnRouter([
    "--prefill",
    p.url,
    "--decode",
    d.url,
    "--workers",
    String(WORKERS),
  ]);
  try {
    await d.control({ chunks: 10, chunkDelayMs: 50 });
    const openai = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: "k", maxRetries: 0 });
    const stream = await openai.completions.create({ model: "m", prompt: "x", stream: true });
    const it = stream[Symbol.asyncIterator]();
    assert.equal((await it.next()).done, false);
    Deno.kill(router.pid, "SIGTERM");
    let n = 1;
    for (let r = await it.next(); !r.done; r = await it.next()) n++;
    assert.equal(n, 10, "the stream in flight was served to its end");
    const status = await router.status;
    assert.equal(status.code, 0);
    // Every worker stopped.
    assert.equal(router.stderr().match(/"msg":"stopped"/g)?.length, WORKERS);
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});

Deno.test("without --unstable-net, --workers 2 is refused and auto serves from one thread", async () => {
  const routerMain = new URL("../../router.ts", import.meta.url).pathname;
  const backends = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"];
  const refused = await new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", routerMain, ...backends, "--port", "0", "--workers", "2"],
    stdout: "piped",
    stderr: "piped",
  }).output();
  const err = new TextDecoder().decode(refused.stderr);
  assert.equal(refused.code, 2, err);
  assert.match(err, /error: --workers: .*--unstable-net/);
  assert.equal(new TextDecoder().decode(refused.stdout), "", "it never listened");

  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", routerMain, ...backends, "--port", "0", "--workers", "auto"],
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  try {
    let out = "";
    while (!out.includes("\n")) {
      const { value, done } = await reader.read();
      if (done) break;
      out += value;
    }
    assert.match(out, /"event":"listening"/);
  } finally {
    child.kill("SIGTERM");
    const [status, errOut] = await Promise.all([
      child.status,
      new Response(child.stderr).text(),
      reader.cancel(),
    ]);
    assert.match(errOut, /serving from one thread/);
    assert.equal(status.code, 0, errOut);
  }
});
