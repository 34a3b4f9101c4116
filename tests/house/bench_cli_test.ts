// The bench scripts' command line: `deno bench` runs only files of Deno.bench cases, every script
// answers --help (exit 0, its usage, where it writes) and refuses an unknown flag (exit 2, naming
// it) without running, and a benchmark that fails early leaves no temp directory behind. A
// script that ignored --help would overwrite committed results, so bench/results/ is snapshotted
// first and put back (contents and mtimes) before a failure is reported.
import assert from "node:assert/strict";

const ROOT = new URL("../../", import.meta.url).pathname;
const BENCH = `${ROOT}bench/`;
const RESULTS = `${BENCH}results`;
const PYTHON = "/usr/bin/python3";
/** Per run: --help and a refused flag return at once; a failing start-up within seconds. */
const RUN_TIMEOUT_MS = 15_000;
/** Runs at once (the test machine has few cores). */
const PARALLEL = 4;
/** Shared pieces that bench scripts import; not entry points. */
const MODULES = new Set([
  "cli.ts",
  "micro.ts",
  "stats.ts",
  "ssd_lib.ts",
  "native_copy.ts",
  "in_process.ts",
  "thread_cpu.ts",
  "host_kv.py",
]);
const SCRIPT_EXT = /\.(ts|tsx|mts|js|jsx|mjs)$/;

/** Deno's rule for a bench module: `bench.ts`, `*_bench.ts` or `*.bench.ts`. */
function isBenchModuleName(name: string): boolean {
  if (!SCRIPT_EXT.test(name)) return false;
  const stem = name.replace(SCRIPT_EXT, "");
  return stem === "bench" || stem.endsWith("_bench") || stem.endsWith(".bench");
}

function walk(dir: string): string[] {
  const out: string[] = [];
  for (const e of Deno.readDirSync(dir)) {
    const p = `${dir}/${e.name}`;
    if (e.isDirectory) out.push(...walk(p));
    else if (e.isFile) out.push(p);
  }
  return out.sort();
}

/** The entry points: bench/*.ts that are not Deno.bench modules, and bench/*.py; not MODULES. */
function entryPoints(): string[] {
  return [...Deno.readDirSync(BENCH)]
    .filter((e) => e.isFile && /\.(ts|py)$/.test(e.name) && !MODULES.has(e.name))
    .filter((e) => !isBenchModuleName(e.name))
    .map((e) => e.name)
    .sort();
}

interface Saved {
  bytes: Uint8Array;
  mtime: Date;
}

interface Snapshot {
  files: Map<string, Saved>;
  /** Every directory under bench/results/, empty ones too (bench/results/tmp is scratch). */
  dirs: Set<string>;
}

function dirsUnder(dir: string): string[] {
  return [...Deno.readDirSync(dir)].filter((e) => e.isDirectory).flatMap((e) => [
    `${dir}/${e.name}`,
    ...dirsUnder(`${dir}/${e.name}`),
  ]);
}

function snapshot(): Snapshot {
  const files = new Map<string, Saved>();
  for (const p of walk(RESULTS)) {
    files.set(p, { bytes: Deno.readFileSync(p), mtime: Deno.statSync(p).mtime! });
  }
  return { files, dirs: new Set(dirsUnder(RESULTS)) };
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

/** What under bench/results/ was made, changed or removed since `before`; puts it all back. */
function restore(before: Snapshot): string[] {
  const changed: string[] = [];
  const now = new Set(walk(RESULTS));
  const putBack = (p: string, b: Saved) => {
    Deno.writeFileSync(p, b.bytes);
    Deno.utimeSync(p, b.mtime, b.mtime);
  };
  for (const p of now) {
    const b = before.files.get(p);
    if (!b) {
      changed.push(`${p} (new)`);
      Deno.removeSync(p);
    } else if (
      Deno.statSync(p).mtime!.getTime() !== b.mtime.getTime() ||
      !sameBytes(Deno.readFileSync(p), b.bytes)
    ) {
      changed.push(`${p} (rewritten)`);
      putBack(p, b);
    }
  }
  for (const [p, b] of before.files) {
    if (!now.has(p)) {
      changed.push(`${p} (removed)`);
      putBack(p, b);
    }
  }
  for (const d of dirsUnder(RESULTS).reverse()) {
    if (!before.dirs.has(d)) {
      changed.push(`${d}/ (new directory)`);
      Deno.removeSync(d, { recursive: true });
    }
  }
  return changed;
}

interface Ran {
  script: string;
  code: number;
  stdout: string;
  stderr: string;
  timedOut: boolean;
}

/** Runs bench/`script` with `args` (Python scripts under /usr/bin/python3), killed after the timeout. */
async function run(
  script: string,
  args: string[],
  env: Record<string, string> = {},
): Promise<Ran> {
  const py = script.endsWith(".py");
  const cmd = new Deno.Command(py ? PYTHON : Deno.execPath(), {
    args: py
      ? [`${BENCH}${script}`, ...args]
      : ["run", "-A", "--cached-only", `${BENCH}${script}`, ...args],
    cwd: ROOT,
    env: { NO_COLOR: "1", ...env },
    stdout: "piped",
    stderr: "piped",
  });
  const child = cmd.spawn();
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    child.kill("SIGKILL");
  }, RUN_TIMEOUT_MS);
  const out = await child.output();
  clearTimeout(timer);
  const dec = new TextDecoder();
  return {
    script,
    code: out.code,
    stdout: dec.decode(out.stdout),
    stderr: dec.decode(out.stderr),
    timedOut,
  };
}

/** `fn` over `items`, at most PARALLEL at once, in order. */
async function pool<T, R>(items: T[], fn: (t: T) => Promise<R>): Promise<R[]> {
  const out: R[] = new Array(items.length);
  let next = 0;
  await Promise.all(
    Array.from({ length: PARALLEL }, async () => {
      while (next < items.length) {
        const i = next++;
        out[i] = await fn(items[i]);
      }
    }),
  );
  return out;
}

/**
 * Runs `body` with a fresh TMPDIR and a PATH without `ip` or `redis-server` (a script that does
 * not stop early then cannot make network namespaces or start Redis), with bench/results/ put
 * back afterwards; fails naming every result file a run touched.
 */
async function guarded(body: (env: Record<string, string>) => Promise<void>): Promise<void> {
  const before = snapshot();
  const tmp = Deno.makeTempDirSync({ prefix: "pf-bench-cli-test-" });
  const env = { TMPDIR: tmp, PATH: "/nonexistent" };
  let changed: string[] = [];
  try {
    await body(env);
  } finally {
    changed = restore(before);
    Deno.removeSync(tmp, { recursive: true });
  }
  assert.deepEqual(changed, [], "bench/results/ must not change");
}

function describe(r: Ran): string {
  return `${r.script}: exit ${r.code}${r.timedOut ? " (killed: still running)" : ""}\n` +
    `stdout: ${r.stdout.slice(-600)}\nstderr: ${r.stderr.slice(-600)}`;
}

Deno.test("deno bench picks up only modules of Deno.bench cases", () => {
  const cfg = JSON.parse(Deno.readTextFileSync(`${ROOT}deno.json`));
  const include: string[] = cfg.bench?.include ?? ["."];
  const picked = include.flatMap((inc) => {
    const p = `${ROOT}${inc.replace(/\/$/, "")}`;
    return Deno.statSync(p).isDirectory ? walk(p) : [p];
  }).filter((p) => isBenchModuleName(p.slice(p.lastIndexOf("/") + 1)));
  assert.ok(picked.length > 0, "deno bench finds no bench module");
  const scripts = picked.filter((p) => !Deno.readTextFileSync(p).includes("Deno.bench("));
  assert.deepEqual(scripts, [], "files deno bench would run that hold no Deno.bench case");
});

Deno.test("every bench script answers --help with its usage, exits 0 and writes nothing", async () => {
  const scripts = entryPoints();
  assert.ok(scripts.length >= 15, `only ${scripts.length} bench scripts found`);
  await guarded(async (env) => {
    const ran = await pool(scripts, (s) => run(s, ["--help"], env));
    const bad = ran.filter((r) =>
      r.code !== 0 || !/usage/i.test(r.stdout) || !/writ/i.test(r.stdout)
    );
    assert.deepEqual(bad.map(describe), [], "scripts whose --help is wrong");
  });
});

Deno.test("every bench script refuses an unknown flag with exit 2, naming it", async () => {
  const scripts = entryPoints();
  await guarded(async (env) => {
    // The two values make a script with positional arguments meet the flag, not a missing one.
    const ran = await pool(scripts, (s) => run(s, ["--no-such-flag", "1", "2"], env));
    const bad = ran.filter((r) => r.code !== 2 || !r.stderr.includes("--no-such-flag"));
    assert.deepEqual(bad.map(describe), [], "scripts that did not refuse --no-such-flag");
  });
});

Deno.test("a benchmark that fails to start leaves no temp directory behind", async () => {
  // Each case fails early: a server that cannot start, or settings the run cannot use.
  const cases: [string, string[], Record<string, string>][] = [
    ["ttft.py", ["--backend", "host", "--skip-transformers"], { PEGAFLOW_DENO: "/bin/false" }],
    ["decode_host.py", [], { PEGAFLOW_DENO: "/bin/false" }],
    ["decode_variants.py", ["--backend", "host"], { PEGAFLOW_DENO: "/bin/false" }],
    ["query_load_latency.py", [], { PEGAFLOW_DENO: "/bin/false" }],
    ["loading_poll.py", [], { PEGAFLOW_DENO: "/bin/false" }],
    ["server.ts", ["--backend", "host", "--tokens", "1"], {}],
    ["rpc_latency.ts", ["--variants", "guard", "--python", "false"], {
      PEGAFLOW_LIB: "/nonexistent/libpegaflow.so",
    }],
    ["ssd_run.ts", [], { SSD_BENCH_QUICK: "1", SSD_BENCH_BYTES: "4096" }],
  ];
  await guarded(async (env) => {
    const ran = await pool(cases, async ([script, args, extra]) => {
      const tmp = Deno.makeTempDirSync({ dir: env.TMPDIR });
      const r = await run(script, args, { ...env, ...extra, TMPDIR: tmp });
      // The server's log file is DevServer's (python/pegaflow/devserver.py), not the script's.
      const dirs = [...Deno.readDirSync(tmp)].filter((e) => !e.isFile).map((e) => e.name);
      return { r, dirs };
    });
    const notFailed = ran.filter(({ r }) => r.code === 0 || r.timedOut).map(({ r }) => describe(r));
    assert.deepEqual(notFailed, [], "cases meant to fail early");
    const leaked = ran.filter(({ dirs }) => dirs.length > 0).map(({ r, dirs }) =>
      `${r.script}: ${dirs.join(", ")}`
    );
    assert.deepEqual(leaked, [], "temp directories left behind");
  });
});
