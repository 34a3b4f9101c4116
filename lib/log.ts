/**
 * Structured logging: one JSON object per line on stderr, so that every line
 * carries the ids needed to act on it (instance, rank, layer, request id).
 *
 * Stderr, not stdout: stdout of `main.ts` is reserved for the one
 * "listening" announcement that tests and supervisors parse.
 *
 * @module
 */

/** Log levels, lowest first. */
export const LOG_LEVELS = ["debug", "info", "warn", "error"] as const;
/** One of {@link LOG_LEVELS}. */
export type LogLevel = typeof LOG_LEVELS[number];

/** Fields attached to a log line (ids, sizes, durations). */
export type LogFields = Record<string, string | number | boolean | bigint | null | undefined>;

/**
 * A logger bound to fixed fields; `child()` adds more.
 *
 * @example
 * ```ts
 * const log = new Logger("info").child({ instance: "vllm-0", rank: 1 });
 * log.warn("save dropped", { reason: "pool exhausted", blocks: 12 });
 * ```
 */
export class Logger {
  readonly #min: number;
  readonly #fields: LogFields;
  readonly #sink: (line: string) => void;

  constructor(
    level: LogLevel = "info",
    fields: LogFields = {},
    sink: (line: string) => void = writeStderr,
  ) {
    this.#min = LOG_LEVELS.indexOf(level);
    this.#fields = fields;
    this.#sink = sink;
  }

  /** A logger that adds `fields` to every line. */
  child(fields: LogFields): Logger {
    return new Logger(LOG_LEVELS[this.#min], { ...this.#fields, ...fields }, this.#sink);
  }

  debug(msg: string, fields?: LogFields): void {
    this.#emit(0, msg, fields);
  }
  info(msg: string, fields?: LogFields): void {
    this.#emit(1, msg, fields);
  }
  warn(msg: string, fields?: LogFields): void {
    this.#emit(2, msg, fields);
  }
  error(msg: string, fields?: LogFields): void {
    this.#emit(3, msg, fields);
  }

  #emit(level: number, msg: string, fields?: LogFields): void {
    if (level < this.#min) return;
    const rec: Record<string, unknown> = {
      ts: new Date().toISOString(),
      level: LOG_LEVELS[level],
      msg,
    };
    for (const [k, v] of Object.entries({ ...this.#fields, ...fields })) {
      if (v === undefined) continue;
      rec[k] = typeof v === "bigint" ? v.toString() : v;
    }
    this.#sink(JSON.stringify(rec));
  }
}

const encoder = new TextEncoder();
function writeStderr(line: string): void {
  Deno.stderr.writeSync(encoder.encode(line + "\n"));
}
