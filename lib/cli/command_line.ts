/**
 * Running a commander program the way every PegaFlow command does (the KV
 * server's `main.ts`, the router's `router.ts`): parse without letting
 * commander exit the process, and end every usage error — an unknown flag, a
 * missing value, a bad value, a refused combination — with exit status 2
 * (the shell convention for "wrong usage") and a message naming the flag.
 * `--help` exits 0. Left to itself commander exits 1 on an unknown option,
 * which a supervisor cannot tell from a crash.
 *
 * @module
 */

import { Command, CommanderError } from "commander";

/** Exit status of a command line that could not be used. */
export const EXIT_USAGE = 2;

/** The outcome of parsing: go on, or print `output` and exit with `code`. */
export type CommandLineResult =
  | { kind: "parsed" }
  | { kind: "exit"; code: number; output: string };

/**
 * What a command's `parse…Args(argv)` returns: the validated configuration
 * to start with, or text to print and an exit code (0 for `--help`, 2 for a
 * usage error). Parsing never starts anything and never exits.
 */
export type ParsedArgs<C> =
  | { kind: "config"; config: C }
  | { kind: "exit"; code: number; output: string };

/**
 * A commander program set up the way every PegaFlow command is: no excess
 * arguments, and a usage error followed by a pointer to `--help`. Options
 * come from {@link envOption} (lib/cli/flags.ts): each flag is also a
 * `PEGAFLOW_*` environment variable.
 *
 * @example
 * ```ts
 * const cmd = newCommand("pegaflow-serve", "PegaFlow KV server")
 *   .addOption(envOption("--pool-size <size>", "pinned pool size", "POOL_SIZE"));
 * ```
 */
export function newCommand(name: string, description: string): Command {
  return new Command(name)
    .description(description)
    .showHelpAfterError("(run with --help for usage)")
    .allowExcessArguments(false);
}

/**
 * The exit result of a usage error found after commander parsed (a value
 * valid alone but refused by the configuration's rules); `message` names
 * the flag, e.g. `--port: expected 0..65535, got '70000'`.
 */
export function usageExit(message: string): { kind: "exit"; code: number; output: string } {
  return { kind: "exit", code: EXIT_USAGE, output: `error: ${message}\n` };
}

/**
 * Parses `argv` (without the program name) into `cmd` and the environment
 * variables its options name. Never exits: a usage error becomes
 * `{kind: "exit", code: 2}` with commander's message (which names the flag),
 * `--help` `{kind: "exit", code: 0}` with the help text.
 *
 * @example
 * ```ts
 * const r = parseCommandLine(cmd, Deno.args);
 * if (r.kind === "exit") exitWith(r);
 * const opts = cmd.opts();
 * ```
 */
export function parseCommandLine(cmd: Command, argv: string[]): CommandLineResult {
  let output = "";
  cmd.exitOverride().configureOutput({
    writeOut: (s) => output += s,
    writeErr: (s) => output += s,
  });
  try {
    cmd.parse(argv, { from: "user" });
  } catch (e) {
    if (!(e instanceof CommanderError)) throw e;
    const help = e.code === "commander.helpDisplayed" || e.code === "commander.help" ||
      e.code === "commander.version";
    return { kind: "exit", code: help ? 0 : EXIT_USAGE, output };
  }
  return { kind: "parsed" };
}

/**
 * Prints a parse result's text (help on stdout, an error on stderr) and exits
 * with its code.
 *
 * @example
 * ```ts
 * const r = parseCommandLine(cmd, Deno.args);
 * if (r.kind === "exit") exitWith(r);
 * ```
 */
export function exitWith(result: { code: number; output: string }): never {
  (result.code === 0 ? console.log : console.error)(result.output.trimEnd());
  Deno.exit(result.code);
}

/**
 * Ends the process with exit status 2 for a usage error found after parsing
 * (a value valid alone but not here); `message` names the flag, e.g.
 * `--workers: ...`.
 *
 * @example
 * ```ts
 * if (workers > 1 && !reusePort) usageError("--workers: needs --unstable-net");
 * ```
 */
export function usageError(message: string): never {
  console.error(`error: ${message}`);
  Deno.exit(EXIT_USAGE);
}
