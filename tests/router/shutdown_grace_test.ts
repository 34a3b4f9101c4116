/**
 * `--shutdown-grace` (`PEGAFLOW_ROUTER_SHUTDOWN_GRACE`): how long open requests may finish after
 * SIGTERM before the router cuts them with a 503. Honoured by a single-threaded router and by every
 * worker of a multi-threaded one; a bad value stops the router before it listens, naming the flag.
 */

import assert from "node:assert/strict";
import { runRouterCli, spawnBackend, spawnRouter, waitFor } from "./harness.ts";

/**
 * P answers after this long: well inside the default grace (10 s), so only a shorter grace cuts
 * the request.
 */
const P_DELAY_MS = 5_000;

for (const mode of ["flag, --workers 1", "env, --workers 2"] as const) {
  Deno.test(`a short --shutdown-grace cuts a request the default grace would let finish (${mode})`, async () => {
    const [p, d] = await Promise.all([spawnBackend("P-slow"), spawnBackend("D")]);
    const viaEnv = mode.startsWith("env");
    const router = await spawnRouter(
      [
        "--prefill",
        p.url,
        "--decode",
        d.url,
        "--workers",
        viaEnv ? "2" : "1",
        "--health-interval",
        "1h",
        ...(viaEnv ? [] : ["--shutdown-grace", "300ms"]),
      ],
      viaEnv ? { PEGAFLOW_ROUTER_SHUTDOWN_GRACE: "300ms" } : {},
    );
    try {
      await p.control({ delayMs: P_DELAY_MS });
      const pending = fetch(`${router.url}/v1/completions`, {
        method: "POST",
        headers: { "x-request-id": "cut-by-short-grace" },
        body: JSON.stringify({ model: "m", prompt: "x" }),
      });
      await waitFor("P has the request", async () => (await p.requests()).length === 1);
      Deno.kill(router.pid, "SIGTERM");

      const res = await pending;
      const body = await res.json() as { error: { code: string; message: string } };
      assert.equal(res.status, 503, JSON.stringify(body));
      assert.equal(body.error.code, "router_shutting_down");
      assert.match(body.error.message, /cut-by-short-grace/);
      assert.equal((await router.status).code, 0);
      // P was cut before its answer was due: the request never reached D.
      await waitFor("P saw its request cut", async () => (await p.requests())[0].cancelled);
      assert.deepEqual(await d.requests(), []);
      assert.match(
        router.stderr(),
        /"msg":"shutdown grace period over; cutting open requests"[^\n]*"grace_ms":300[,}]/,
      );
    } finally {
      await Promise.all([router.stop(), p.stop(), d.stop()]);
    }
  });
}

Deno.test("a bad --shutdown-grace stops the router before it starts, naming the flag", async () => {
  const ok = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"];
  const cases: Array<{ args: string[]; env?: Record<string, string>; says: RegExp }> = [
    { args: [...ok, "--shutdown-grace", "soon"], says: /expected a duration.*got 'soon'/ },
    { args: [...ok, "--shutdown-grace", "0"], says: /must be greater than zero/ },
    {
      args: ok,
      env: { PEGAFLOW_ROUTER_SHUTDOWN_GRACE: "-1s" },
      says: /expected a duration.*value from env 'PEGAFLOW_ROUTER_SHUTDOWN_GRACE'/,
    },
  ];
  await Promise.all(cases.map(async (c) => {
    const { code, stderr } = await runRouterCli(c.args, c.env);
    assert.equal(code, 2, stderr);
    assert.match(stderr, /error: --shutdown-grace: /, stderr);
    assert.match(stderr, c.says, stderr);
    assert.doesNotMatch(stderr, /listening/);
  }));
  const help = await new Deno.Command(Deno.execPath(), {
    args: ["run", "--allow-all", "router.ts", "--help"],
    cwd: new URL("../../", import.meta.url).pathname,
    stdout: "piped",
    stderr: "piped",
  }).output();
  assert.equal(help.code, 0);
  const text = new TextDecoder().decode(help.stdout);
  assert.match(text, /--shutdown-grace <duration>/, text);
  assert.match(text, /PEGAFLOW_ROUTER_SHUTDOWN_GRACE/, text);
});
