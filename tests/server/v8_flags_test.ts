/**
 * The server's V8 flags (lib/server/v8_flags.ts): read from deno.json's
 * serve task, accepted by this Deno, and doing what they are there for
 * (a per-request handler is optimized after tens of calls, not thousands).
 */
import assert from "node:assert/strict";
import { serverRunArgs, serveV8FlagsArg } from "../../lib/server/v8_flags.ts";

/**
 * Runs JavaScript `code` under `deno eval` with `v8` flags, plus natives syntax and synchronous
 * optimization (no background compile to wait for); its exit code and output.
 */
async function evalWith(v8: string[], code: string): Promise<{ code: number; out: string }> {
  const r = await new Deno.Command(Deno.execPath(), {
    args: [
      "eval",
      "--ext=js",
      `--v8-flags=${["--allow-natives-syntax", "--no-concurrent-recompilation", ...v8].join(",")}`,
      code,
    ],
    stdout: "piped",
    stderr: "piped",
  }).output();
  const td = new TextDecoder();
  return { code: r.code, out: td.decode(r.stdout) + td.decode(r.stderr) };
}

/** The serve task's V8 flags, one per element. */
const flags = serveV8FlagsArg().slice("--v8-flags=".length).split(",");

// A handler-sized function called `n` times: is it optimized by TurboFan then (status bit 5)?
const PROBE = (n: number) => `
function handler(req) { let s = 0; for (const h of req.hashes) s += h.length; return { s, id: req.id }; }
const req = { id: "r", hashes: [new Uint8Array(16), new Uint8Array(16)] };
for (let i = 0; i < ${n}; i++) handler(req);
console.log((%GetOptimizationStatus(handler) & 32) ? "optimized" : "not optimized");`;

Deno.test("the serve task's V8 flags are read from deno.json, and a task without them is named", () => {
  assert.match(
    serveV8FlagsArg(),
    /^--v8-flags=.*--invocation-count-for-turbofan=\d+/,
  );
  assert.deepEqual(serverRunArgs(), ["run", "-A", serveV8FlagsArg()]);
  assert.throws(
    () => serveV8FlagsArg({ serve: "deno run --allow-all main.ts" }),
    /tasks\.serve \("deno run --allow-all main\.ts"\) has no --v8-flags= argument/,
  );
});

Deno.test("this Deno accepts every V8 flag of the serve task (an unknown one fails every server start)", async () => {
  const r = await evalWith(flags, "console.log('ok')");
  assert.equal(r.code, 0, r.out);
  // The check can fail: Deno refuses a flag V8 does not know.
  const bad = await evalWith(["--no-such-pegaflow-flag"], "console.log('ok')");
  assert.notEqual(bad.code, 0);
  assert.match(bad.out, /did not recognize flag/);
});

Deno.test("with the serve task's V8 flags a handler is optimized after 200 calls; with V8's defaults it is not", async () => {
  const tuned = await evalWith(flags, PROBE(200));
  assert.equal(tuned.code, 0, tuned.out);
  assert.equal(tuned.out.trim(), "optimized");
  const plain = await evalWith([], PROBE(200));
  assert.equal(plain.code, 0, plain.out);
  assert.equal(plain.out.trim(), "not optimized");
});
