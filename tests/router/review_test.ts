/**
 * Review findings on the multi-threaded router (`--workers N`) and its environment variables:
 * every worker's `/health` (and the 503 a request gets) says why a backend is out, also when it was
 * out from the start or when only the reason changed; a refused value read from a
 * `PEGAFLOW_ROUTER_*` variable names that variable.
 */

import assert from "node:assert/strict";
import { parseRouterArgs } from "../../lib/router/config.ts";
import { fresh, runRouterCli, spawnBackend, spawnRouter, waitFor } from "./harness.ts";

/** Fresh connections: with 2 workers, all 12 on one worker is 2·2^-12 ≈ 5e-4. */
const PROBES = 12;

interface HealthBody {
  prefill: { backends: Array<{ healthy: boolean; error: string | null }> };
  decode: { backends: Array<{ healthy: boolean; error: string | null }> };
}

/** `PROBES` answers of /health, each on a new connection (so from both workers). */
async function healthViews(url: string): Promise<HealthBody[]> {
  const views: HealthBody[] = [];
  for (let i = 0; i < PROBES; i++) views.push(await (await fresh(`${url}/health`)).json());
  return views;
}

Deno.test("--workers 2: backends down from the start show why on every worker, round after round", async () => {
  // Nothing listens on ports 1 and 2 of loopback: every probe is refused.
  const router = await spawnRouter([
    "--prefill",
    "http://127.0.0.1:1",
    "--decode",
    "http://127.0.0.1:2",
    "--workers",
    "2",
    "--health-interval",
    "100ms",
  ]);
  try {
    const check = async (when: string) => {
      for (const h of await healthViews(router.url)) {
        for (const b of [h.prefill.backends[0], h.decode.backends[0]]) {
          assert.equal(b.healthy, false, when);
          assert.match(String(b.error), /health check \/health failed: /, when);
        }
      }
    };
    await check("right after start");
    // Later rounds see the same failure (no change of state): the reason must stay.
    await new Promise((r) => setTimeout(r, 400));
    await check("after several rounds");
    for (let i = 0; i < PROBES; i++) {
      const res = await fresh(`${router.url}/v1/completions`, {
        method: "POST",
        body: JSON.stringify({ model: "m", prompt: "x" }),
      });
      assert.equal(res.status, 503);
      const err = (await res.json()).error;
      assert.equal(err.code, "no_prefill_backend");
      assert.match(err.message, /127\.0\.0\.1:1 \(health check \/health failed: /, err.message);
    }
  } finally {
    await router.stop();
  }
});

Deno.test("--workers 2: a changed reason and a backend's return reach every worker", async () => {
  const [p, d] = await Promise.all([spawnBackend("P0"), spawnBackend("D0")]);
  const router = await spawnRouter([
    "--prefill",
    p.url,
    "--decode",
    d.url,
    "--workers",
    "2",
    "--health-interval",
    "100ms",
  ]);
  const everyWorker = async (what: string, ok: (h: HealthBody) => boolean) => {
    // Each answer may come from either worker: wait until a whole series agrees.
    await waitFor(what, async () => (await healthViews(router.url)).every(ok), 5_000);
  };
  try {
    // A change of state: every worker is told (this part worked before).
    await d.control({ healthStatus: 500 });
    await everyWorker(
      "D out with HTTP 500 on every worker",
      (h) => !h.decode.backends[0].healthy && /HTTP 500/.test(String(h.decode.backends[0].error)),
    );
    // Still out, for another reason: no change of state, but /health must say the new one.
    await d.control({ healthStatus: 503 });
    await everyWorker(
      "D out with HTTP 503 on every worker",
      (h) => !h.decode.backends[0].healthy && /HTTP 503/.test(String(h.decode.backends[0].error)),
    );
    await d.control({ healthStatus: 200 });
    await everyWorker(
      "D back, its error cleared on every worker",
      (h) => h.decode.backends[0].healthy && h.decode.backends[0].error === null,
    );
  } finally {
    await Promise.all([router.stop(), p.stop(), d.stop()]);
  }
});

const BACKENDS = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"];

/** parseRouterArgs with `env` set for the call. */
function parseWithEnv(args: string[], env: Record<string, string>) {
  for (const [k, v] of Object.entries(env)) Deno.env.set(k, v);
  try {
    return parseRouterArgs(args);
  } finally {
    for (const k of Object.keys(env)) Deno.env.delete(k);
  }
}

Deno.test("a bad value from a PEGAFLOW_ROUTER_* variable names the variable and the flag", () => {
  const cases: Array<[flag: string, env: string, value: string]> = [
    ["--host", "HOST", "a b"],
    ["--port", "PORT", "x"],
    ["--prefill", "PREFILL", "ftp://p"],
    ["--decode", "DECODE", "not a url"],
    ["--prefill-timeout", "PREFILL_TIMEOUT", "soon"],
    ["--decode-timeout", "DECODE_TIMEOUT", "0"],
    ["--stream-idle-timeout", "STREAM_IDLE_TIMEOUT", "never"],
    ["--health-interval", "HEALTH_INTERVAL", "-1"],
    ["--health-timeout", "HEALTH_TIMEOUT", "1d"],
    ["--health-path", "HEALTH_PATH", "health"],
    ["--max-body", "MAX_BODY", "lots"],
    ["--log-level", "LOG_LEVEL", "loud"],
    ["--workers", "WORKERS", "0"],
  ];
  for (const [flag, env, value] of cases) {
    const name = `PEGAFLOW_ROUTER_${env}`;
    // The backends come from the command line, except the one under test.
    const args = flag === "--prefill"
      ? BACKENDS.slice(2)
      : flag === "--decode"
      ? BACKENDS.slice(0, 2)
      : BACKENDS;
    const r = parseWithEnv(args, { [name]: value });
    assert.ok(r.kind === "exit" && r.code === 2, `${name}=${value} is refused`);
    assert.match(r.output, new RegExp(`^error: ${flag}: `), r.output);
    assert.ok(r.output.includes(name), `${name}: ${r.output}`);
    assert.ok(r.output.includes(`'${value}'`), `${name}: ${r.output}`);
  }
  // The same value on the command line names the flag alone, even with the variable set too.
  const r = parseWithEnv([...BACKENDS, "--port", "x"], { PEGAFLOW_ROUTER_PORT: "8081" });
  assert.ok(r.kind === "exit" && r.code === 2);
  assert.match(r.output, /^error: --port: .*got 'x'/);
  assert.ok(!r.output.includes("PEGAFLOW_ROUTER_PORT"), r.output);
});

Deno.test("the router CLI names the variable of a bad environment value", async () => {
  const { code, stderr } = await runRouterCli(BACKENDS, { PEGAFLOW_ROUTER_PORT: "x" });
  assert.equal(code, 2, stderr);
  assert.match(stderr, /error: --port: .*got 'x'.*PEGAFLOW_ROUTER_PORT/);
});

Deno.test("--workers 2 from PEGAFLOW_ROUTER_WORKERS without --unstable-net names the variable", async () => {
  const routerMain = new URL("../../router.ts", import.meta.url).pathname;
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", routerMain, ...BACKENDS, "--port", "0"],
    env: { PEGAFLOW_ROUTER_WORKERS: "2" },
    stdout: "piped",
    stderr: "piped",
  }).output();
  const err = new TextDecoder().decode(out.stderr);
  assert.equal(out.code, 2, err);
  assert.match(err, /error: --workers: .*--unstable-net/);
  assert.match(err, /PEGAFLOW_ROUTER_WORKERS/);
});

Deno.test("a port in use from PEGAFLOW_ROUTER_PORT names the variable", async () => {
  const taken = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  try {
    const { code, stderr } = await runRouterCli([...BACKENDS, "--health-timeout", "200ms"], {
      PEGAFLOW_ROUTER_PORT: String(taken.addr.port),
      PEGAFLOW_ROUTER_WORKERS: "1",
    });
    assert.equal(code, 2, stderr);
    assert.match(stderr, /error: --host\/--port: cannot listen on 127\.0\.0\.1:/);
    assert.match(stderr, /PEGAFLOW_ROUTER_PORT/);
  } finally {
    taken.close();
  }
});
