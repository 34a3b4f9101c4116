/**
 * One CLI shape for `main.ts` and `router.ts`: both parse through lib/cli/command_line.ts, so
 * --help exits 0, every usage error exits 2 naming the flag with a pointer to --help, and every
 * flag is also a PEGAFLOW_* environment variable.
 */
import assert from "node:assert/strict";
import { parseServeArgs } from "../../lib/server/config.ts";
import { parseRouterArgs } from "../../lib/router/config.ts";

const BACKENDS = ["--prefill", "http://p:8000", "--decode", "http://d:8001"];

Deno.test("server and router: --help exits 0 and lists each flag's environment variable", () => {
  const s = parseServeArgs(["--help"]);
  const r = parseRouterArgs(["--help"]);
  assert.ok(s.kind === "exit" && s.code === 0);
  assert.ok(r.kind === "exit" && r.code === 0);
  assert.match(s.output.replace(/\s+/g, " "), /env: PEGAFLOW_POOL_SIZE/);
  assert.match(r.output.replace(/\s+/g, " "), /env: PEGAFLOW_ROUTER_PORT/);
});

Deno.test("server and router: an unknown flag exits 2 naming it, with a pointer to --help", () => {
  for (const res of [parseServeArgs(["--no-such-flag"]), parseRouterArgs(["--no-such-flag"])]) {
    assert.ok(res.kind === "exit");
    assert.equal(res.code, 2);
    assert.match(res.output, /unknown option '--no-such-flag'/);
    assert.match(res.output, /\(run with --help for usage\)/);
  }
});

Deno.test("router: a value refused by the configuration rules exits 2 naming the flag", () => {
  const missing = parseRouterArgs(["--decode", "http://d:8001"]);
  assert.ok(missing.kind === "exit" && missing.code === 2);
  assert.match(missing.output, /^error: --prefill: at least one prefill backend URL is required/);
  const size = parseRouterArgs([...BACKENDS, "--max-body", "lots"]);
  assert.ok(size.kind === "exit" && size.code === 2);
  assert.match(size.output, /--max-body: expected a size like 1048576, 512kb or 16mb, got 'lots'/);
});

Deno.test("router: flags and PEGAFLOW_ROUTER_* variables reach the configuration", () => {
  Deno.env.set("PEGAFLOW_ROUTER_PORT", "9123");
  try {
    const r = parseRouterArgs([...BACKENDS, "--max-body", "2mib", "--workers", "auto"]);
    assert.ok(r.kind === "config");
    if (r.kind !== "config") return;
    assert.equal(r.config.port, 9123);
    assert.equal(r.config.maxBodyBytes, 2 * 1024 ** 2);
    assert.equal(r.config.workersAuto, true);
    assert.deepEqual(r.config.prefill, ["http://p:8000"]);
  } finally {
    Deno.env.delete("PEGAFLOW_ROUTER_PORT");
  }
  const one = parseRouterArgs([...BACKENDS, "--workers", "1"]);
  assert.ok(one.kind === "config" && one.config.workers === 1 && !one.config.workersAuto);
});
