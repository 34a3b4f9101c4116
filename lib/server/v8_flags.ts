/**
 * The V8 flags the server runs with, as `deno task serve` spells them: the
 * `--v8-flags=` argument of deno.json's `serve` task, the one place they are
 * written (the Python dev server, `make compile` and the benchmarks' and
 * tests' server children read them from there).
 *
 * Why: V8 optimizes a function only after thousands of calls'
 * worth of work (`--invocation-count-for-turbofan`, default 3000), a count a
 * web page's code reaches in seconds and a KV server's per-request handlers
 * (QueryPrefetch, the load's checks, its batch) reach after thousands of
 * requests: a fresh server ran them as baseline code. Tiering after ~10
 * (Maglev) and ~40 (TurboFan) calls' worth instead cut a warm request's
 * control plane before its copy from 0.62 to 0.39 ms on the H200 host
 * (`bench/query_load_latency.py`, alternated runs) and its 10K-token TTFT from
 * 28.30 to 27.37 ms (docs/server.md). Only when code is compiled changes, not
 * what it computes; a long-running server ends up with the same code.
 *
 * Deno refuses a V8 flag it does not know ("V8 did not recognize flag"): a
 * Deno upgrade that drops one fails every server start, tests included.
 *
 * @module
 */
import denoJson from "../../deno.json" with { type: "json" };

/** The `--v8-flags=...` argument of `tasks.serve` (deno.json's by default); throws naming what is missing. */
export function serveV8FlagsArg(tasks: Record<string, string> = denoJson.tasks): string {
  const serve = tasks.serve;
  const arg = serve?.split(/\s+/).find((a) => a.startsWith("--v8-flags="));
  if (!arg) {
    throw new Error(`deno.json: tasks.serve ("${serve}") has no --v8-flags= argument`);
  }
  return arg;
}

/** `deno run` arguments that start the server as `deno task serve` does: `-A`, its V8 flags. */
export function serverRunArgs(): string[] {
  return ["run", "-A", serveV8FlagsArg()];
}
