// `deno run` does not type-check: a server, router or benchmark path that no test imports could
// read a property its type lacks and get `undefined` at run time. Every program the README runs is
// type-checked here, as `deno test` checks the tests' own imports.
import assert from "node:assert/strict";

const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);

Deno.test("every entry point type-checks: main.ts, router.ts, the benchmarks, the demo", async () => {
  const bench = [...Deno.readDirSync(`${ROOT}bench`)]
    .filter((e) => e.isFile && e.name.endsWith(".ts"))
    .map((e) => `bench/${e.name}`)
    .sort();
  assert.ok(bench.length > 5, `bench/ has ${bench.length} TypeScript files`);
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["check", "--quiet", "main.ts", "router.ts", "lib/client/demo.ts", ...bench],
    cwd: ROOT,
    stdout: "piped",
    stderr: "piped",
  }).output();
  const text = new TextDecoder().decode(out.stderr) + new TextDecoder().decode(out.stdout);
  assert.equal(out.code, 0, `deno check failed:\n${text}`);
});
