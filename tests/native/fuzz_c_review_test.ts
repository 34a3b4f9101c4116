/**
 * The batch entry points under a seeded fuzz: `tests/native/c/fuzz_descriptors.c`
 * feeds pf_copy_submit, pf_io_submit, pf_pool_crc32c, pf_pool_checksums and
 * pf_xfer_submit random bytes and valid descriptors with one field broken,
 * and the text/struct calls (file paths, region handles, peer addresses, a
 * listener that stalls mid-hello, ring waits) bad input, on the host backend
 * with a uring over a temp file and a TCP endpoint pair on loopback. Built
 * with AddressSanitizer, UBSan and LeakSanitizer against `csrc/` (as
 * races_c_test.ts builds its programs); every seed must exit 0: each
 * malformed call refused with a PF_E* and no completion record, valid batches
 * byte-exact afterwards, every object closed, nothing leaked.
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
/** Seeds run by every test run (fixed: a failure names its seed and case and replays). */
const SEEDS = ["1", "0x5eed", "20240611"];
const ROUNDS = "2000";

async function run(cmd: string, args: string[], what: string): Promise<string> {
  const out = await new Deno.Command(cmd, {
    args,
    stdout: "piped",
    stderr: "piped",
    env: {
      ASAN_OPTIONS: "detect_leaks=1:abort_on_error=0",
      UBSAN_OPTIONS: "print_stacktrace=1",
    },
  }).output();
  const text = new TextDecoder().decode(out.stdout) + new TextDecoder().decode(out.stderr);
  assert.equal(out.code, 0, `${what} exited ${out.code}:\n${text}`);
  return text;
}

async function liburing(): Promise<string> {
  for (const p of LIBURING) {
    if (await Deno.stat(p).then(() => true, () => false)) return p;
  }
  throw new Error(`liburing.a not found in ${LIBURING.join(", ")} (make liburing)`);
}

/** csrc/*.c and the fuzz program, with the sanitizers, into one executable. */
async function build(dir: string): Promise<string> {
  const objs: string[] = [];
  const jobs: Promise<string>[] = [];
  for await (const e of Deno.readDir(`${ROOT}csrc`)) {
    if (!e.isFile || !e.name.endsWith(".c")) continue;
    const o = `${dir}/${e.name.replace(/\.c$/, ".o")}`;
    objs.push(o);
    jobs.push(run("gcc", [...FLAGS, "-c", `${ROOT}csrc/${e.name}`, "-o", o], `gcc ${e.name}`));
  }
  await Promise.all(jobs);
  const exe = `${dir}/fuzz_descriptors`;
  await run(
    "gcc",
    [
      ...FLAGS,
      "-o",
      exe,
      `${ROOT}tests/native/c/fuzz_descriptors.c`,
      ...objs,
      await liburing(),
      "-ldl",
    ],
    "link fuzz_descriptors",
  );
  return exe;
}

Deno.test("C fuzz: every malformed batch, path, handle and address is refused with a PF_E* and no completion, a stalled hello times out, and valid batches still move exact bytes", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-fuzz-" });
  try {
    const exe = await build(dir);
    for (const seed of SEEDS) {
      const out = await run(exe, [seed, ROUNDS, dir], `fuzz_descriptors seed ${seed}`);
      assert.match(out, new RegExp(`^fuzz seed ${seed}: ${ROUNDS} rounds, \\d+ refused`, "m"));
      assert.match(out, /every object closed/);
    }
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
