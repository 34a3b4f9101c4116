/**
 * The copy-path flags: `--help` says what `auto` really does, the
 * calibration cache is configurable (or off), recalibration can be forced,
 * and a server on the host backend starts without measuring or writing a
 * cache.
 */
import assert from "node:assert/strict";
import { join } from "node:path";
import { parseServeArgs } from "../../lib/server/config.ts";
import { startServer } from "./harness.ts";

const ROOT = new URL("../../", import.meta.url).pathname;

Deno.test("--help says auto is chosen per batch from a calibration, and where the cache lives", async () => {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", "main.ts", "--help"],
    cwd: ROOT,
    env: { XDG_CACHE_HOME: "/tmp/pf-xdg" },
    stdout: "piped",
    stderr: "piped",
  }).output();
  const text = new TextDecoder().decode(out.stdout).replace(/\s+/g, " ");
  assert.equal(out.code, 0);
  assert.match(
    text,
    /--transfer-path <path> cuda copy path: auto = chosen per batch from its mean segment size/,
  );
  assert.match(text, /measured at start-up or read from --calibration-file/);
  assert.match(
    text,
    /--calibration-file <path>.*\(default: "\/tmp\/pf-xdg\/pegaflow\/calibration\.json"/,
  );
  assert.match(text, /--recalibrate/);
  assert.doesNotMatch(text, /32 ?KiB/);
});

Deno.test("the calibration flags and their env vars reach the config; none turns the cache off", () => {
  const r = parseServeArgs(["--calibration-file", "/var/cache/pf.json", "--recalibrate"]);
  assert.equal(r.kind, "config");
  if (r.kind !== "config") return;
  assert.equal(r.config.calibrationFile, "/var/cache/pf.json");
  assert.equal(r.config.recalibrate, true);
  const off = parseServeArgs(["--calibration-file", "none"]);
  assert.ok(off.kind === "config" && off.config.calibrationFile === undefined);
  Deno.env.set("PEGAFLOW_RECALIBRATE", "true");
  Deno.env.set("PEGAFLOW_CALIBRATION_FILE", "/tmp/pf-env.json");
  try {
    const env = parseServeArgs([]);
    assert.ok(env.kind === "config");
    if (env.kind !== "config") return;
    assert.equal(env.config.recalibrate, true);
    assert.equal(env.config.calibrationFile, "/tmp/pf-env.json");
  } finally {
    Deno.env.delete("PEGAFLOW_RECALIBRATE");
    Deno.env.delete("PEGAFLOW_CALIBRATION_FILE");
  }
  const bad = parseServeArgs(["--recalibrate", "maybe"]);
  assert.ok(bad.kind === "exit" && bad.code === 2 && /--recalibrate/.test(bad.output));
});

Deno.test("a host-backend server copies with memcpy: it measures nothing and writes no cache", async () => {
  const dir = Deno.makeTempDirSync({ prefix: "pf-calib-srv-" });
  const file = join(dir, "calibration.json");
  const srv = await startServer(["--calibration-file", file, "--transfer-path", "kernel"]);
  try {
    assert.equal((await srv.client.health()).backend, "host");
    assert.throws(() => Deno.statSync(file), Deno.errors.NotFound);
  } finally {
    await srv.stop();
    Deno.removeSync(dir, { recursive: true });
  }
});
