/**
 * Command-line flag plumbing shared by the KV server (lib/server/config.ts),
 * its SSD tier flags (lib/ssd/flags.ts) and the router (router.ts): the
 * `PEGAFLOW_*` environment-variable option, the byte-size and integer
 * parsers, and the commander argument parsers built on them.
 *
 * The argument parsers throw commander's `InvalidArgumentError`, so commander
 * prefixes the message with the option (and, for a value read from the
 * environment, the variable's name): the text here only says what was wrong.
 *
 * @module
 */

import { InvalidArgumentError, Option } from "commander";

/** Prefix of every environment variable that stands for a flag. */
export const ENV_PREFIX = "PEGAFLOW_";

/**
 * A commander option that is also read from the environment variable
 * `PEGAFLOW_<env>`.
 *
 * @example
 * ```ts
 * command.addOption(envOption("--pool-size <size>", "pinned pool size", "POOL_SIZE"));
 * // PEGAFLOW_POOL_SIZE=2gb now counts like --pool-size 2gb
 * ```
 */
export function envOption(flags: string, description: string, env: string): Option {
  return new Option(flags, description).env(`${ENV_PREFIX}${env}`);
}

const SIZE_UNITS: Record<string, number> = {
  "": 1,
  b: 1,
  kb: 1024,
  k: 1024,
  kib: 1024,
  mb: 1024 ** 2,
  m: 1024 ** 2,
  mib: 1024 ** 2,
  gb: 1024 ** 3,
  g: 1024 ** 3,
  gib: 1024 ** 3,
  tb: 1024 ** 4,
  t: 1024 ** 4,
  tib: 1024 ** 4,
};

/**
 * Parses a byte size: a number with an optional unit kb/mb/gb/tb (binary
 * multiples; kib/mib/... and k/m/g/t also accepted, case-insensitive).
 *
 * @example
 * ```ts
 * parseSize("30gb"); // 32212254720
 * parseSize("1.5mb"); // 1572864
 * ```
 */
export function parseSize(text: string): number {
  const m = /^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$/.exec(text);
  if (!m) throw new Error(`"${text}" is not a size (expected e.g. 512mb, 30gb, 1tb)`);
  const unit = SIZE_UNITS[m[2].toLowerCase()];
  if (unit === undefined) {
    throw new Error(`"${text}" has an unknown unit "${m[2]}" (use kb, mb, gb or tb)`);
  }
  const bytes = Math.floor(Number(m[1]) * unit);
  if (!Number.isSafeInteger(bytes)) throw new Error(`"${text}" is too large`);
  return bytes;
}

/**
 * The shortest text {@link parseSize} reads back as exactly `bytes`: the
 * largest unit that divides it (so a default's label in `--help` is derived
 * from the value instead of written a second time).
 *
 * @example
 * ```ts
 * formatSize(512 * 1024 ** 3); // "512gb"
 * formatSize(1536); // "1536"
 * ```
 */
export function formatSize(bytes: number): string {
  for (const unit of ["tb", "gb", "mb", "kb"]) {
    const n = SIZE_UNITS[unit];
    if (bytes >= n && bytes % n === 0) return `${bytes / n}${unit}`;
  }
  return String(bytes);
}

/**
 * A commander argument parser for a byte size of at least `min` bytes
 * (see {@link parseSize}); `flag` names the option in the error.
 *
 * @example
 * ```ts
 * envOption("--ssd-segment-size <size>", "SSD segment", "SSD_SEGMENT_SIZE")
 *   .argParser(sizeArg("--ssd-segment-size", 8192));
 * ```
 */
export function sizeArg(flag: string, min: number): (value: string) => number {
  return (value: string): number => {
    let n: number;
    try {
      n = parseSize(value);
    } catch (e) {
      throw new InvalidArgumentError((e as Error).message);
    }
    if (n < min) throw new InvalidArgumentError(`${flag} must be at least ${min} bytes, got ${n}`);
    return n;
  };
}

/**
 * A commander argument parser for a whole number in `min..max` (digits only:
 * no sign, no fraction, no exponent); `flag` names the option in the error.
 * Every integer flag uses it, so a refusal always reads the same way.
 *
 * @example
 * ```ts
 * envOption("--xfer-streams <n>", "TCP streams per peer", "XFER_STREAMS")
 *   .argParser(intArg("--xfer-streams", 1, 64));
 * // --xfer-streams 0 → "--xfer-streams must be an integer in 1..64, got "0""
 * ```
 */
export function intArg(flag: string, min: number, max: number): (value: string) => number {
  return (value: string): number => {
    const text = value.trim();
    const n = Number(text);
    if (!/^\d+$/.test(text) || n < min || n > max) {
      throw new InvalidArgumentError(
        `${flag} must be an integer in ${min}..${max}, got "${value}"`,
      );
    }
    return n;
  };
}

/**
 * A commander argument parser for an optional boolean value
 * (`--flag`, `--flag true`, `PEGAFLOW_FLAG=0`): 1/true/yes/on and
 * 0/false/no/off/empty, case-insensitive.
 *
 * @example
 * ```ts
 * envOption("--ssd-reset [bool]", "start empty", "SSD_RESET")
 *   .default(false).preset(true).argParser(boolArg);
 * ```
 */
export function boolArg(value: string | boolean): boolean {
  // commander hands the preset (true) through the parser when no value follows.
  if (typeof value === "boolean") return value;
  const v = value.toLowerCase();
  if (["1", "true", "yes", "on"].includes(v)) return true;
  if (["0", "false", "no", "off", ""].includes(v)) return false;
  throw new InvalidArgumentError(`"${value}" is not a boolean (true/false/1/0)`);
}
