/**
 * A small levelled logger writing one JSON object per line to stderr.
 *
 * JSON lines because routers run under supervisors that ship logs to an indexer; stderr because
 * stdout stays free for whoever embeds the process. The level check comes first so a disabled
 * debug line costs one comparison on the hot path.
 *
 * @module
 */

/** Log levels, most severe first. */
export const LOG_LEVELS = ["error", "warn", "info", "debug"] as const;

/** One of {@link LOG_LEVELS}. */
export type LogLevel = typeof LOG_LEVELS[number];

/** Structured fields attached to a log line. */
export type LogFields = Record<string, string | number | boolean | null | undefined>;

/** A levelled logger. */
export interface Logger {
  error(msg: string, fields?: LogFields): void;
  warn(msg: string, fields?: LogFields): void;
  info(msg: string, fields?: LogFields): void;
  debug(msg: string, fields?: LogFields): void;
  /** Whether `level` would be written (to skip building expensive fields). */
  enabled(level: LogLevel): boolean;
}

/**
 * Creates a logger that writes lines at `level` and more severe; `base` fields go on every line
 * (a router worker's number, say).
 *
 * @example
 * ```ts
 * const log = createLogger("info");
 * log.info("listening", { port: 8080 });
 * ```
 */
export function createLogger(
  level: LogLevel,
  write: (line: string) => void = writeStderr,
  base?: LogFields,
): Logger {
  const threshold = LOG_LEVELS.indexOf(level);
  const emit = (lvl: LogLevel, msg: string, fields?: LogFields) => {
    if (LOG_LEVELS.indexOf(lvl) > threshold) return;
    write(JSON.stringify({ ts: new Date().toISOString(), level: lvl, msg, ...base, ...fields }));
  };
  return {
    error: (msg, fields) => emit("error", msg, fields),
    warn: (msg, fields) => emit("warn", msg, fields),
    info: (msg, fields) => emit("info", msg, fields),
    debug: (msg, fields) => emit("debug", msg, fields),
    enabled: (lvl) => LOG_LEVELS.indexOf(lvl) <= threshold,
  };
}

const encoder = new TextEncoder();

function writeStderr(line: string): void {
  const bytes = encoder.encode(line + "\n");
  // writeSync may write part of the buffer when stderr is a full pipe; finish the line.
  let off = 0;
  while (off < bytes.length) off += Deno.stderr.writeSync(bytes.subarray(off));
}
