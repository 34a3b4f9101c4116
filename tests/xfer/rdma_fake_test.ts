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

/** Runs case `name` of `_rdma_fake_cases.ts` in a child process: it alone runs, and passes. */
async function runCase(name: string): Promise<void> {
  const out = await new Deno.Command(Deno.execPath(), {
    args: ["test", "--allow-all", "--filter", name, decodeURIComponent(CASES.pathname)],
    stdout: "piped",
    stderr: "piped",
  }).output();
  const text = new TextDecoder().decode(out.stdout) + new TextDecoder().decode(out.stderr);
  // deno-lint-ignore no-control-regex -- the colour codes of deno test's output
  const clean = text.replace(/\x1b\[[0-9;]*m/g, "");
  assert.equal(out.code, 0, clean);
  assert.match(clean, /ok \| 1 passed \| 0 failed/, `exactly this case ran:\n${clean}`);
}

/** The `pf-fake-ibverbs-*` entries of the temp directory (where Deno.makeTempDir makes them). */
async function fakeTempDirs(): Promise<string[]> {
  const tmp = Deno.env.get("TMPDIR") || "/tmp";
  const found: string[] = [];
  for await (const e of Deno.readDir(tmp)) {
    if (e.name.startsWith("pf-fake-ibverbs-")) found.push(`${tmp}/${e.name}`);
  }
  return found;
}

Deno.test("the stand-in's cases are found", () => {
  assert.ok(names.length >= 10, `found ${names.length} cases in ${CASES.pathname}`);
});

Deno.test("a case's child leaves no pf-fake-ibverbs-* directory in the temp directory", async () => {
  const name = "a bad PEGAFLOW_RDMA_FLUSH_WAIT_MS refuses the RDMA endpoint naming it";
  assert.ok(names.includes(name), `no case "${name}"`);
  const before = new Set(await fakeTempDirs());
  await runCase(name); // it builds (or finds) the stand-in and loads it
  // Before: every child compiled the stand-in into a new temp directory that
  // was never removed (18 per run of this file).
  const left = (await fakeTempDirs()).filter((d) => !before.has(d));
  assert.deepEqual(left, [], "directories the child left behind");
});

for (const name of names) {
  Deno.test(`verbs stand-in: ${name}`, () => runCase(name));
}
