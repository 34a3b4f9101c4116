/**
 * The C test programs' build: csrc/*.c compiled once with AddressSanitizer and
 * UBSan (or, for data races, ThreadSanitizer), and a program in tests/native/c/
 * linked against those objects (all but the library files the program includes
 * itself, to hook them). Used by races_c_test.ts, tsan_c_test.ts and
 * fuzz_c_review_test.ts.
 */
import assert from "node:assert/strict";

const ROOT = decodeURIComponent(new URL("../../", import.meta.url).pathname);
const LIBURING = [
  "/usr/lib/x86_64-linux-gnu/liburing.a",
  "/usr/lib/aarch64-linux-gnu/liburing.a",
  "/usr/lib/liburing.a",
  "/usr/local/lib/liburing.a",
];
const COMMON = [
  "-O1",
  "-g",
  "-std=gnu11",
  "-pthread",
  "-fno-omit-frame-pointer",
  `-I${ROOT}csrc`,
  `-I${ROOT}tests/native/c`,
];
/** Which sanitizers a build uses: ASan + UBSan (the default), or ThreadSanitizer (data races). */
export type Sanitizer = "address" | "thread";
const FLAGS: Record<Sanitizer, string[]> = {
  address: [...COMMON, "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"],
  thread: [...COMMON, "-fsanitize=thread"],
};

/**
 * Runs `cmd`; its stdout and stderr together, asserting exit 0. `leaks`: with
 * LeakSanitizer (the race programs leave their scaffolding allocated at exit,
 * so they run without it).
 */
export async function run(
  cmd: string,
  args: string[],
  what: string,
  leaks = false,
): Promise<string> {
  const out = await new Deno.Command(cmd, {
    args,
    stdout: "piped",
    stderr: "piped",
    env: {
      ASAN_OPTIONS: `detect_leaks=${leaks ? 1 : 0}:abort_on_error=0`,
      UBSAN_OPTIONS: "print_stacktrace=1",
      // A data race fails the program (exit 66) at its first report.
      TSAN_OPTIONS: "halt_on_error=1:exitcode=66",
    },
  }).output();
  const text = new TextDecoder().decode(out.stdout) + new TextDecoder().decode(out.stderr);
  assert.equal(out.code, 0, `${what} exited ${out.code}:\n${text}`);
  return text;
}

/** Builds csrc/*.c with the sanitizers into `dir`, once: file name → object. */
export async function objects(
  dir: string,
  sanitizer: Sanitizer = "address",
): Promise<Map<string, string>> {
  const objs = new Map<string, string>();
  const jobs: Promise<string>[] = [];
  for await (const e of Deno.readDir(`${ROOT}csrc`)) {
    if (!e.isFile || !e.name.endsWith(".c")) continue;
    const o = `${dir}/${e.name.replace(/\.c$/, ".o")}`;
    objs.set(e.name, o);
    jobs.push(
      run("gcc", [...FLAGS[sanitizer], "-c", `${ROOT}csrc/${e.name}`, "-o", o], `gcc ${e.name}`),
    );
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

/**
 * Links tests/native/c/`name`.c (or `source`) with `objs` but the library files it includes
 * itself.
 */
export async function build(
  dir: string,
  objs: Map<string, string>,
  name: string,
  includes: string[] = [],
  sanitizer: Sanitizer = "address",
  source = `${ROOT}tests/native/c/${name}.c`,
): Promise<string> {
  const exe = `${dir}/${name}`;
  const linked = [...objs].filter(([c]) => !includes.includes(c)).map(([, o]) => o);
  await run(
    "gcc",
    [
      ...FLAGS[sanitizer],
      "-o",
      exe,
      source,
      ...linked,
      await liburing(),
      "-ldl",
    ],
    `link ${name}`,
  );
  return exe;
}
