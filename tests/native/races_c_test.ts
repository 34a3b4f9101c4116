/**
 * Races in the C library that need a thread stopped at one exact point:
 * the programs in `tests/native/c/` force each interleaving (a hook, or a
 * replay through the library's own internal calls), built here with
 * AddressSanitizer and UBSan against `csrc/`, and must exit 0. Each one
 * failed on the code before its fix (docs/native.md, "Lifetimes" and
 * "Transfer batches end once").
 */
import assert from "node:assert/strict";

const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);
const LIBURING = [
  "/usr/lib/x86_64-linux-gnu/liburing.a",
  "/usr/lib/aarch64-linux-gnu/liburing.a",
  "/usr/lib/liburing.a",
  "/usr/local/lib/liburing.a",
];
const FLAGS = [
  "-O1",
  "-g",
  "-std=gnu11",
  "-pthread",
  "-fsanitize=address,undefined",
  "-fno-sanitize-recover=undefined",
  "-fno-omit-frame-pointer",
  `-I${ROOT}csrc`,
  `-I${ROOT}tests/native/c`,
];

async function run(cmd: string, args: string[], what: string): Promise<string> {
  const out = await new Deno.Command(cmd, {
    args,
    stdout: "piped",
    stderr: "piped",
    // The programs leave their test scaffolding allocated at exit: leaks are not what they test.
    env: { ASAN_OPTIONS: "detect_leaks=0:abort_on_error=0", UBSAN_OPTIONS: "print_stacktrace=1" },
  }).output();
  const text = new TextDecoder().decode(out.stdout) + new TextDecoder().decode(out.stderr);
  assert.equal(out.code, 0, `${what} exited ${out.code}:\n${text}`);
  return text;
}

/** Builds csrc/*.c with the sanitizers once; each program links all but the files it includes. */
async function objects(dir: string): Promise<Map<string, string>> {
  const objs = new Map<string, string>();
  const jobs: Promise<string>[] = [];
  for await (const e of Deno.readDir(`${ROOT}csrc`)) {
    if (!e.isFile || !e.name.endsWith(".c")) continue;
    const o = `${dir}/${e.name.replace(/\.c$/, ".o")}`;
    objs.set(e.name, o);
    jobs.push(run("gcc", [...FLAGS, "-c", `${ROOT}csrc/${e.name}`, "-o", o], `gcc ${e.name}`));
  }
  await Promise.all(jobs);
  return objs;
}

async function liburing(): Promise<string> {
  for (const p of LIBURING) {
    if (await Deno.stat(p).then(() => true, () => false)) return p;
  }
  throw new Error(`liburing.a not found in ${LIBURING.join(", ")} (make liburing)`);
}

async function build(
  dir: string,
  objs: Map<string, string>,
  name: string,
  includes: string[],
): Promise<string> {
  const exe = `${dir}/${name}`;
  const linked = [...objs].filter(([c]) => !includes.includes(c)).map(([, o]) => o);
  await run(
    "gcc",
    [...FLAGS, "-o", exe, `${ROOT}tests/native/c/${name}.c`, ...linked, await liburing(), "-ldl"],
    `link ${name}`,
  );
  return exe;
}

Deno.test("C races: a landed part counts against its own batch, a broken peer ends a late-armed batch, a close waits for a submit or sync past its lookup", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-races-" });
  try {
    const objs = await objects(dir);
    const [parts, broken, close] = await Promise.all([
      build(dir, objs, "xfer_parts", ["pf_tcp.c"]),
      build(dir, objs, "xfer_broken", []),
      build(dir, objs, "uring_close", ["pf_uring.c"]),
    ]);

    for (const mode of ["", "ack"]) {
      const out = await run(parts, mode ? [mode] : [], `xfer_parts ${mode}`);
      assert.match(out, /after 1 of B's 2 parts: B still in flight \(correct\)/);
      assert.match(out, /after B's 2nd part: B ended PF_OK \(correct\)/);
    }
    assert.match(
      await run(broken, [], "xfer_broken"),
      /^0 of 2000 peer failures left a batch in flight/m,
    );
    const file = `${dir}/uring_close.dat`;
    const submit = await run(close, [file, "submit"], "uring_close submit");
    assert.match(submit, /call: -\d+ pf_io_submit: .*is closing/, "the racing submit is refused");
    const sync = await run(close, [file, "sync-uring"], "uring_close sync-uring");
    assert.match(sync, /call: 0 /, "the sync the close waited for succeeded");
    const fileClose = await run(close, [file, "sync-file"], "uring_close sync-file");
    assert.match(fileClose, /file close during sync: -6/, "PF_EBUSY while the sync holds the file");
    for (const out of [submit, sync, fileClose]) {
      assert.match(out, /pf_uring_close: 0/);
      assert.match(out, /pool destroy 0, ring destroy 0/);
    }
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
