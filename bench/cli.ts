/**
 * The command line every bench script answers the same way: `--help` (or `-h`) prints what it
 * measures, its flags, the environment it reads and where it writes, and exits 0 before anything
 * runs or is written (a benchmark overwrites committed results under bench/results/); an unknown
 * flag or a stray argument exits 2 naming it. Scripts parsed by commander get the same contract
 * through {@link strictCommand}.
 *
 * @example
 * ```ts
 * const args = benchCli({
 *   usage: "deno run -A bench/storage.ts [--iterations N]",
 *   about: "The JS cost the KV server pays per request.",
 *   flags: { "--iterations": "timed calls per row (default 200)" },
 *   writes: "bench/results/storage.json",
 * });
 * const n = args.flags["--iterations"];
 * ```
 *
 * @module
 */
import type { Command } from "commander";
import { intArg } from "../lib/cli/flags.ts";

/** What a bench script tells `--help`, and the flags it accepts. */
export interface BenchSpec {
  /** How to run it: `deno run -A bench/x.ts [--flag N]`. */
  usage: string;
  /** What it measures, in a line or a few. */
  about: string;
  /** Flags that take a value (`--name value` or `--name=value`): flag → meaning and default. */
  flags?: Record<string, string>;
  /** Required positional arguments, in order: name → meaning. */
  positionals?: Record<string, string>;
  /** Environment variables it reads: name → meaning and default. */
  env?: Record<string, string>;
  /** What it writes and where (or that it writes nothing). */
  writes: string;
}

/** The command line, parsed. */
export interface BenchArgs {
  /** The value of each flag that was given, by its name with the dashes (`--iterations`). */
  flags: Record<string, string>;
  positionals: string[];
}

/** Parsed arguments, a request for the usage, or what is wrong with them. */
export type BenchParse = { kind: "run"; args: BenchArgs } | { kind: "help" } | {
  kind: "error";
  message: string;
};

/** The `--help` text of `spec`. */
export function usageText(spec: BenchSpec): string {
  const section = (title: string, rows: Record<string, string> | undefined) => {
    const entries = Object.entries(rows ?? {});
    if (entries.length === 0) return [];
    const w = Math.max(...entries.map(([k]) => k.length));
    return [title, ...entries.map(([k, v]) => `  ${k.padEnd(w)}  ${v}`)];
  };
  return [
    `usage: ${spec.usage}`,
    "",
    spec.about,
    "",
    ...section("arguments:", spec.positionals),
    ...section("flags:", { ...spec.flags, "-h, --help": "print this and exit" }),
    ...section("environment:", spec.env),
    `writes: ${spec.writes}`,
  ].join("\n");
}

/** Parses `args` against `spec` without side effects. */
export function parseBenchArgs(spec: BenchSpec, args: readonly string[]): BenchParse {
  if (args.includes("--help") || args.includes("-h")) return { kind: "help" };
  const known = spec.flags ?? {};
  const flags: Record<string, string> = {};
  const positionals: string[] = [];
  for (let i = 0; i < args.length; i++) {
    const a = args[i];
    if (!a.startsWith("-") || a === "-") {
      positionals.push(a);
      continue;
    }
    const eq = a.indexOf("=");
    const name = eq > 0 ? a.slice(0, eq) : a;
    if (!(name in known)) return { kind: "error", message: `unknown flag ${name}` };
    const value = eq > 0 ? a.slice(eq + 1) : args[++i];
    if (value === undefined) return { kind: "error", message: `${name} needs a value` };
    flags[name] = value;
  }
  const want = Object.keys(spec.positionals ?? {});
  if (positionals.length > want.length) {
    return { kind: "error", message: `unexpected argument '${positionals[want.length]}'` };
  }
  if (positionals.length < want.length) {
    return { kind: "error", message: `missing argument <${want[positionals.length]}>` };
  }
  return { kind: "run", args: { flags, positionals } };
}

/**
 * The script's arguments: prints the usage and exits 0 on `--help`; prints what is wrong and
 * exits 2 on an unknown flag, a flag without its value or a wrong number of arguments.
 */
export function benchCli(spec: BenchSpec, args: readonly string[] = Deno.args): BenchArgs {
  const p = parseBenchArgs(spec, args);
  if (p.kind === "help") {
    console.log(usageText(spec));
    Deno.exit(0);
  }
  if (p.kind === "error") {
    console.error(`${p.message}\nusage: ${spec.usage} (--help for more)`);
    Deno.exit(2);
  }
  return p.args;
}

/**
 * A positive integer from a flag's or an environment variable's text (`fallback` when absent);
 * exits 2 naming `what` when it is not one.
 */
export function positiveInt(what: string, given: string | undefined, fallback: number): number {
  if (given === undefined) return fallback;
  try {
    return intArg(what, 1, Number.MAX_SAFE_INTEGER)(given);
  } catch (e) {
    console.error((e as Error).message);
    Deno.exit(2);
  }
}

/**
 * Gives a commander program the bench contract: `--help` also says what it writes (and the
 * environment it reads) and exits 0; an unknown option or a bad argument exits 2 (commander's
 * own is 1) after commander's message naming it.
 */
export function strictCommand(
  cmd: Command,
  writes: string,
  env?: Record<string, string>,
): Command {
  const envRows = Object.entries(env ?? {}).map(([k, v]) => `  ${k}  ${v}`);
  const after = [
    ...(envRows.length ? ["", "Environment:", ...envRows] : []),
    "",
    `Writes: ${writes}`,
  ].join("\n");
  return cmd.addHelpText("after", after).exitOverride((e) => Deno.exit(e.exitCode === 0 ? 0 : 2));
}

/**
 * Runs `cleanup` when the script is interrupted (SIGINT: Ctrl-C; SIGTERM: `timeout`, `kill`),
 * then exits 130 or 143. For what outlives the process unless removed: network namespaces and
 * bridges, which a `finally` does not get to when a signal ends the process. Returns a function
 * that removes the listeners (call it once the normal path has cleaned up).
 */
export function cleanupOnSignal(cleanup: () => Promise<void>): () => void {
  const signals = [["SIGINT", 130], ["SIGTERM", 143]] as const;
  const handlers = signals.map(([sig, code]) => {
    const h = () => {
      console.error(`${sig}: cleaning up before exit`);
      cleanup().catch((e) => console.error(`cleanup after ${sig}: ${(e as Error).message}`))
        .finally(() => Deno.exit(code));
    };
    Deno.addSignalListener(sig, h);
    return [sig, h] as const;
  });
  return () => {
    for (const [sig, h] of handlers) Deno.removeSignalListener(sig, h);
  };
}
