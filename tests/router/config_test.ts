/** Command-line values: what is accepted, and that a refusal names the flag. */

import assert from "node:assert/strict";
import {
  ConfigError,
  DEFAULTS,
  parseBackendUrl,
  parseBytes,
  parseDurationMs,
  parsePort,
  parseWorkers,
  resolveConfig,
} from "../../lib/router/config.ts";

Deno.test("durations take ms, s, m, h and bare milliseconds", () => {
  assert.equal(parseDurationMs("--x", "250"), 250);
  assert.equal(parseDurationMs("--x", "250ms"), 250);
  assert.equal(parseDurationMs("--x", "1.5s"), 1500);
  assert.equal(parseDurationMs("--x", "2m"), 120_000);
  assert.equal(parseDurationMs("--x", "1h"), 3_600_000);
  for (const bad of ["", "-1", "0", "fast", "1d", "1e3"]) {
    assert.throws(
      () => parseDurationMs("--prefill-timeout", bad),
      (e) => e instanceof ConfigError && e.flag === "--prefill-timeout",
    );
  }
  assert.throws(() => parseDurationMs("--x", "1000h"), /--x: must be at most/);
});

Deno.test("sizes take binary units and bare bytes", () => {
  assert.equal(parseBytes("--max-body", "1024"), 1024);
  assert.equal(parseBytes("--max-body", "512kb"), 512 * 1024);
  assert.equal(parseBytes("--max-body", "16MB"), 16 * 1024 * 1024);
  assert.equal(parseBytes("--max-body", "1g"), 1024 ** 3);
  assert.throws(() => parseBytes("--max-body", "0"), /--max-body: must be greater than zero/);
  assert.throws(() => parseBytes("--max-body", "lots"), /--max-body: expected a size/);
});

Deno.test("ports and backend URLs", () => {
  assert.equal(parsePort("--port", "0"), 0);
  assert.equal(parsePort("--port", "65535"), 65535);
  assert.throws(() => parsePort("--port", "65536"), /--port/);
  assert.throws(() => parsePort("--port", "80a"), /--port/);
  assert.equal(parseBackendUrl("--prefill", "http://10.0.0.5:8000/"), "http://10.0.0.5:8000");
  assert.equal(parseBackendUrl("--decode", "https://d.example/vllm/"), "https://d.example/vllm");
  assert.throws(() => parseBackendUrl("--decode", "d:8000"), /--decode: expected an http/);
  assert.throws(() => parseBackendUrl("--decode", "not a url"), /--decode: expected a URL/);
  assert.throws(() => parseBackendUrl("--decode", "http://d:1/?x=1"), /query or fragment/);
});

Deno.test("defaults resolve; a repeated backend is refused", () => {
  const base = { ...DEFAULTS, prefill: ["http://p:1"], decode: ["http://d:1", "http://e:1/"] };
  const cfg = resolveConfig(base);
  assert.equal(cfg.host, "127.0.0.1");
  assert.equal(cfg.port, 8080);
  assert.deepEqual(cfg.decode, ["http://d:1", "http://e:1"]);
  assert.equal(cfg.prefillTimeoutMs, 60_000);
  assert.equal(cfg.maxBodyBytes, 16 * 1024 * 1024);
  assert.equal(cfg.logLevel, "info");
  assert.equal(cfg.shutdownGraceMs, 10_000);
  assert.equal(resolveConfig({ ...base, shutdownGrace: "250ms" }).shutdownGraceMs, 250);
  assert.throws(
    () => resolveConfig({ ...base, shutdownGrace: "later" }),
    (e) => e instanceof ConfigError && e.flag === "--shutdown-grace",
  );
  assert.throws(
    () => resolveConfig({ ...base, decode: ["http://d:1", "http://d:1/"] }),
    /--decode: backend http:\/\/d:1 is listed twice/,
  );
});

Deno.test("workers: auto is min(4, CPU cores); otherwise a whole number 1-256", () => {
  const auto = Math.min(4, navigator.hardwareConcurrency);
  assert.equal(parseWorkers("--workers", "auto"), auto);
  assert.equal(
    resolveConfig({ ...DEFAULTS, prefill: ["http://p:1"], decode: ["http://d:1"] }).workers,
    auto,
  );
  assert.equal(parseWorkers("--workers", "1"), 1);
  assert.equal(parseWorkers("--workers", " 16 "), 16);
  for (const bad of ["", "0", "-1", "2.5", "257", "many", "1e2"]) {
    assert.throws(
      () => parseWorkers("--workers", bad),
      (e: unknown) => e instanceof ConfigError && e.flag === "--workers",
      `'${bad}' should be refused`,
    );
  }
});
