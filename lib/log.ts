/**
 * The one logger of PegaFlow (server, engine, SSD tier, block index,
 * router): one JSON object per line on stderr, a short message plus fields,
 * so every line carries the ids needed to act on it (instance, rank, layer,
 * request id, path, block) and a log indexer can query them.
 *
 * Stderr, not stdout: stdout of `main.ts` is reserved for the one
 * "listening" announcement that tests and supervisors parse. The level
 * check comes first, so a disabled line costs one comparison; `enabled()`
 * lets a hot path skip building expensive fields.
 *
 * @module
 */

/** Log levels, lowest first. */
export const LOG_LEVELS = ["debug", "info", "warn", "error"] as const;
/** One of {@link LOG_LEVELS}. */
export type LogLevel = typeof LOG_LEVELS[number];

/** An error's message as a log field's text (what was thrown need not be an Error). */
export function errorText(e: unknown): string {
  return e instanceof Error ? e.message : String(e);
}

/** Fields attached to a log line (ids, sizes, durations). */
export type LogFields = Record<string, string | number | boolean | bigint | null | undefined>;

/**
 * A logger bound to fixed fields; `child()` adds more (a component, a
 * router worker's number, an instance). `sink` receives each line without
 * its newline (tests pass one that collects lines).
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

  /** Whether a line at `level` would be written. */
  enabled(level: LogLevel): boolean {
    return LOG_LEVELS.indexOf(level) >= this.#min;
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
  const bytes = encoder.encode(line + "\n");
  // writeSync may write part of the buffer when stderr is a full pipe; finish the line.
  let off = 0;
  while (off < bytes.length) off += Deno.stderr.writeSync(bytes.subarray(off));
}
