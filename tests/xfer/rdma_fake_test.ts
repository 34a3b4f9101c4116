/**
 * The RDMA transport over the software stand-in for libibverbs
 * (`fake_ibverbs.c`; the cases are in `_rdma_fake_cases.ts`), each case in a
 * child process. The stand-in is loaded through `PEGAFLOW_LIBIBVERBS`, which
 * is process-wide (the environment, and the library's one table of verbs):
 * loaded in this process, it changed what `rdma_test.ts` found on the machine,
 * and a test of another file running at the same time (`--parallel`) could
 * have had its verbs swapped under it.
 */
import assert from "node:assert/strict";

const CASES = new URL("./_rdma_fake_cases.ts", import.meta.url);
const names = [...(await Deno.readTextFile(CASES)).matchAll(/^Deno\.test\("([^"]+)"/gm)].map((m) =>
  m[1]
);

Deno.test("the stand-in's cases are found", () => {
  assert.ok(names.length >= 10, `found ${names.length} cases in ${CASES.pathname}`);
});

for (const name of names) {
  Deno.test(`verbs stand-in: ${name}`, async () => {
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["test", "--allow-all", "--filter", name, decodeURIComponent(CASES.pathname)],
      stdout: "piped",
      stderr: "piped",
    }).output();
    const text = new TextDecoder().decode(out.stdout) + new TextDecoder().decode(out.stderr);
    const clean = text.replace(/\x1b\[[0-9;]*m/g, "");
    assert.equal(out.code, 0, clean);
    assert.match(clean, /ok \| 1 passed \| 0 failed/, `exactly this case ran:\n${clean}`);
  });
}
