// `make compile` (the single binary): Deno 2.9.6's compile aborted with a stack overflow while
// packaging one npm package's test data (bintrees, under prom-client), so no binary could be built
// even where the denort runtime is at hand. The runtime cannot be fetched here; a stand-in runtime
// file lets the compile step itself run to the end (the binary it writes is not runnable).
import assert from "node:assert/strict";

const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);

Deno.test("make compile packages the server into one file without crashing", async () => {
  const out = `${ROOT}build/pegaflow-serve`;
  try {
    const r = await new Deno.Command("make", {
      args: ["-s", "compile"],
      cwd: ROOT,
      env: { DENORT_BIN: "/bin/true" },
      stdout: "piped",
      stderr: "piped",
    }).output();
    const text = new TextDecoder().decode(r.stderr).slice(-3000) +
      new TextDecoder().decode(r.stdout).slice(-1000);
    assert.equal(r.code, 0, `make compile failed:\n${text}`);
    assert.ok(Deno.statSync(out).size > 10 << 20, "the server's code and npm packages are in it");
  } finally {
    try {
      Deno.removeSync(out);
    } catch { /* not written */ }
  }
});
