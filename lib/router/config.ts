/**
 * The router's command line: its flags (each also a `PEGAFLOW_ROUTER_*` environment variable),
 * the validated shape the router runs on, and the parsers that turn the strings into it.
 * `router.ts` only calls {@link parseRouterArgs} and starts the router, as `main.ts` does with the
 * server's lib/server/config.ts: both build their program with lib/cli/command_line.ts
 * (`newCommand`, `parseCommandLine`: --help exits 0, every usage error exits 2 naming the flag).
 *
 * Parsing lives here rather than in `router.ts` so every rule is unit-testable and so a bad value is
 * refused before anything listens, with an error that names the flag and what was expected.
 *
 * @module
 */

import type { Command, Option } from "commander";
import { newCommand, parseCommandLine, type ParsedArgs, usageExit } from "../cli/command_line.ts";
import { envOption, parseSize } from "../cli/flags.ts";
import type { LogLevel } from "../log.ts";
import { LOG_LEVELS } from "../log.ts";
import { MAX_TIMER_MS } from "../timer_limit.ts";

/** Everything the router needs to run. Durations are milliseconds, sizes are bytes. */
export interface RouterConfig {
  /** Interface to listen on. */
  host: string;
  /** TCP port; 0 picks an ephemeral port (tests). */
  port: number;
  /** Prefill backend base URLs (no trailing slash). */
  prefill: string[];
  /** Decode backend base URLs (no trailing slash). */
  decode: string[];
  /** Whole prefill request (P computes one token, so it is short). */
  prefillTimeoutMs: number;
  /** From sending the request to D until D's response headers arrive. */
  decodeTimeoutMs: number;
  /**
   * Longest silence allowed between two body chunks from D, or `null` (the default) for none.
   * Enforcing it needs a look at every chunk in JavaScript; without it D's body is piped to the
   * client natively, which is what keeps the router's added latency low (docs/router.md).
   */
  streamIdleTimeoutMs: number | null;
  /** Period of the active health checks. */
  healthIntervalMs: number;
  /** Timeout of one health check request. */
  healthTimeoutMs: number;
  /** Path probed by health checks (`/health` on vLLM; `/v1/models` works on any OpenAI server). */
  healthPath: string;
  /** Largest accepted request body. */
  maxBodyBytes: number;
  /** Least severe level that is logged. */
  logLevel: LogLevel;
  /** On SIGINT/SIGTERM, how long open requests may run on before they are cut (503). */
  shutdownGraceMs: number;
  /**
   * Threads serving the port (Deno Workers with SO_REUSEPORT, lib/router/cluster.ts); 1 serves
   * from the main thread alone.
   */
  workers: number;
  /** `--workers auto` chose {@link RouterConfig.workers} (one thread is then an allowed fallback). */
  workersAuto: boolean;
  /**
   * The flags whose value came from their `PEGAFLOW_ROUTER_*` variable rather than the command
   * line, flag → variable (set by {@link parseRouterArgs}), so a refusal found later names it.
   */
  envVars?: Record<string, string>;
}

/** Defaults; each is the value a flag takes when neither it nor its env var is given. */
export const DEFAULTS = {
  host: "127.0.0.1",
  port: "8080",
  prefillTimeout: "60s",
  // Non-streaming D answers only when generation is done, so its header wait must cover a long
  // generation; streaming requests are guarded by the idle timeout instead.
  decodeTimeout: "300s",
  // Off: see RouterConfig.streamIdleTimeoutMs.
  streamIdleTimeout: "off",
  healthInterval: "5s",
  healthTimeout: "2s",
  healthPath: "/health",
  // 16 MiB fits a ~1M-token prompt sent as token ids; anything larger is almost surely a mistake.
  maxBody: "16mb",
  logLevel: "info",
  // Long enough for most non-streamed answers and short streams to end; a supervisor's own kill
  // deadline (Kubernetes: 30 s) should exceed it plus the ~2 s close wait.
  shutdownGrace: "10s",
  // auto = min(4, CPU cores): see defaultWorkers.
  workers: "auto",
} as const;

/**
 * Most workers `auto` picks: enough to split the streams' native piping over a few threads (the
 * tail the single thread had, docs/router.md) without taking every core from co-located engines.
 */
const AUTO_WORKERS_MAX = 4;
/** A sanity bound on --workers: far more threads than any host has cores is a typo. */
const MAX_WORKERS = 256;

/** `auto`'s worker count on this host: min(4, CPU cores). */
export function defaultWorkers(): number {
  return Math.max(1, Math.min(AUTO_WORKERS_MAX, navigator.hardwareConcurrency || 1));
}

/** Parses `--workers`: `auto` or an integer 1–256. */
export function parseWorkers(flag: string, value: string): number {
  const v = value.trim().toLowerCase();
  if (v === "auto") return defaultWorkers();
  const n = Number(v);
  if (!/^\d+$/.test(v) || !Number.isSafeInteger(n) || n < 1 || n > MAX_WORKERS) {
    throw new ConfigError(
      flag,
      `expected 'auto' or a whole number of worker threads from 1 to ${MAX_WORKERS}, got '${value}'`,
    );
  }
  return n;
}

/** A configuration value that cannot be used; `flag` names the CLI flag it came from. */
export class ConfigError extends Error {
  /** The flag at fault, e.g. `"--port"`. */
  readonly flag: string;

  constructor(flag: string, message: string) {
    super(`${flag}: ${message}`);
    this.name = "ConfigError";
    this.flag = flag;
  }
}

const MAX_PORT = 65535;
const DURATION_RE = /^(\d+(?:\.\d+)?)\s*(ms|s|m|h)?$/;
const DURATION_UNIT_MS: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000 };

/**
 * Parses a TCP port (0–65535).
 *
 * @example
 * ```ts
 * parsePort("--port", "8080"); // 8080
 * ```
 */
export function parsePort(flag: string, value: string): number {
  const trimmed = value.trim();
  if (!/^\d+$/.test(trimmed)) {
    throw new ConfigError(flag, `expected a port number 0-${MAX_PORT}, got '${value}'`);
  }
  const port = Number(trimmed);
  if (port > MAX_PORT) {
    throw new ConfigError(flag, `expected a port number 0-${MAX_PORT}, got ${port}`);
  }
  return port;
}

/**
 * Parses a duration: a number with an optional unit `ms`, `s`, `m`, `h` (no unit = milliseconds).
 * Must be positive.
 *
 * @example
 * ```ts
 * parseDurationMs("--prefill-timeout", "1.5s"); // 1500
 * parseDurationMs("--health-interval", "250"); // 250
 * ```
 */
export function parseDurationMs(flag: string, value: string): number {
  const m = DURATION_RE.exec(value.trim());
  if (m === null) {
    throw new ConfigError(
      flag,
      `expected a duration like 500ms, 30s, 2m or a number of milliseconds, got '${value}'`,
    );
  }
  const ms = Math.round(Number(m[1]) * DURATION_UNIT_MS[m[2] ?? "ms"]);
  if (ms <= 0) throw new ConfigError(flag, `must be greater than zero, got '${value}'`);
  if (ms > MAX_TIMER_MS) {
    throw new ConfigError(flag, `must be at most ${MAX_TIMER_MS} ms (~24.8 days), got '${value}'`);
  }
  return ms;
}

/**
 * Parses a byte size: a number with an optional unit `b`, `kb`/`k`/`kib`, `mb`/`m`/`mib`,
 * `gb`/`g`/`gib` (binary multiples; no unit = bytes). Must be positive.
 *
 * @example
 * ```ts
 * parseBytes("--max-body", "16mb"); // 16777216
 * ```
 */
export function parseBytes(flag: string, value: string): number {
  let bytes: number;
  try {
    bytes = parseSize(value);
  } catch {
    throw new ConfigError(flag, `expected a size like 1048576, 512kb or 16mb, got '${value}'`);
  }
  if (bytes <= 0) throw new ConfigError(flag, `must be greater than zero, got '${value}'`);
  return bytes;
}

/**
 * Parses a backend base URL (`http://host:port` or `https://…`, optionally with a path prefix).
 * The trailing slash is dropped so `/v1/...` can be appended.
 *
 * @example
 * ```ts
 * parseBackendUrl("--prefill", "http://10.0.0.5:8000/"); // "http://10.0.0.5:8000"
 * ```
 */
export function parseBackendUrl(flag: string, value: string): string {
  let url: URL;
  try {
    url = new URL(value.trim());
  } catch {
    // URL's own message ("Invalid URL") adds nothing; the flag and the value say what to fix.
    throw new ConfigError(flag, `expected a URL like http://host:8000, got '${value}'`);
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw new ConfigError(flag, `expected an http:// or https:// URL, got '${value}'`);
  }
  if (url.search !== "" || url.hash !== "") {
    throw new ConfigError(flag, `must not carry a query or fragment, got '${value}'`);
  }
  return url.href.replace(/\/+$/, "");
}

/**
 * Parses a log level.
 *
 * @example
 * ```ts
 * parseLogLevel("--log-level", "debug"); // "debug"
 * ```
 */
export function parseLogLevel(flag: string, value: string): LogLevel {
  const v = value.trim().toLowerCase();
  if (!(LOG_LEVELS as readonly string[]).includes(v)) {
    throw new ConfigError(flag, `expected one of ${LOG_LEVELS.join(", ")}, got '${value}'`);
  }
  return v as LogLevel;
}

/**
 * Parses the HTTP path probed by health checks.
 *
 * @example
 * ```ts
 * parseHealthPath("--health-path", "/v1/models"); // "/v1/models"
 * ```
 */
export function parseHealthPath(flag: string, value: string): string {
  const v = value.trim();
  if (!v.startsWith("/") || /\s/.test(v)) {
    throw new ConfigError(flag, `expected a path starting with '/', got '${value}'`);
  }
  return v;
}

/** The raw strings collected by the CLI, before validation. */
export interface RawRouterOptions {
  host: string;
  port: string;
  prefill: string[];
  decode: string[];
  prefillTimeout: string;
  decodeTimeout: string;
  streamIdleTimeout: string;
  healthInterval: string;
  healthTimeout: string;
  healthPath: string;
  maxBody: string;
  logLevel: string;
  shutdownGrace: string;
  workers: string;
}

/**
 * Validates every raw option and builds a {@link RouterConfig}; throws a {@link ConfigError}
 * naming the first bad flag.
 *
 * @example
 * ```ts
 * const cfg = resolveConfig({ ...DEFAULTS, prefill: ["http://p:8000"], decode: ["http://d:8001"] });
 * ```
 */
export function resolveConfig(raw: RawRouterOptions): RouterConfig {
  const host = raw.host.trim();
  if (host === "" || /[\s/]/.test(host)) {
    throw new ConfigError("--host", `expected a host name or IP address, got '${raw.host}'`);
  }
  const port = parsePort("--port", raw.port);
  if (raw.prefill.length === 0) {
    throw new ConfigError("--prefill", "at least one prefill backend URL is required");
  }
  if (raw.decode.length === 0) {
    throw new ConfigError("--decode", "at least one decode backend URL is required");
  }
  const prefill = raw.prefill.map((u) => parseBackendUrl("--prefill", u));
  const decode = raw.decode.map((u) => parseBackendUrl("--decode", u));
  for (const [flag, urls] of [["--prefill", prefill], ["--decode", decode]] as const) {
    const dup = urls.find((u, i) => urls.indexOf(u) !== i);
    if (dup !== undefined) throw new ConfigError(flag, `backend ${dup} is listed twice`);
  }
  const healthIntervalMs = parseDurationMs("--health-interval", raw.healthInterval);
  const healthTimeoutMs = parseDurationMs("--health-timeout", raw.healthTimeout);
  return {
    host,
    port,
    prefill,
    decode,
    prefillTimeoutMs: parseDurationMs("--prefill-timeout", raw.prefillTimeout),
    decodeTimeoutMs: parseDurationMs("--decode-timeout", raw.decodeTimeout),
    streamIdleTimeoutMs: raw.streamIdleTimeout.trim().toLowerCase() === "off"
      ? null
      : parseDurationMs("--stream-idle-timeout", raw.streamIdleTimeout),
    healthIntervalMs,
    healthTimeoutMs,
    healthPath: parseHealthPath("--health-path", raw.healthPath),
    maxBodyBytes: parseBytes("--max-body", raw.maxBody),
    logLevel: parseLogLevel("--log-level", raw.logLevel),
    shutdownGraceMs: parseDurationMs("--shutdown-grace", raw.shutdownGrace),
    workers: parseWorkers("--workers", raw.workers),
    workersAuto: raw.workers.trim().toLowerCase() === "auto",
  };
}

/**
 * What to add to a refusal of `flags` so it names the environment variables (of
 * {@link RouterConfig.envVars}) their values came from: `""` when all came from the command line.
 *
 * @example
 * ```ts
 * envNote({ "--port": "PEGAFLOW_ROUTER_PORT" }, ["--port"]); // " (value from env 'PEGAFLOW_ROUTER_PORT')"
 * ```
 */
export function envNote(envVars: Record<string, string> | undefined, flags: string[]): string {
  const named = flags.filter((f) => envVars?.[f] !== undefined);
  if (named.length === 0) return "";
  const parts = named.map((f) => `${flags.length === 1 ? "value" : f} from env '${envVars?.[f]}'`);
  return ` (${parts.join("; ")})`;
}

/** Repeatable flags accumulate; an env var may list several URLs separated by commas. */
function collect(value: string, previous: string[] | undefined): string[] {
  const items = value.split(",").map((s) => s.trim()).filter((s) => s !== "");
  return [...(previous ?? []), ...items];
}

function opt(flags: string, description: string, env: string, fallback?: string): Option {
  const o = envOption(flags, description, `ROUTER_${env}`);
  return fallback === undefined ? o : o.default(fallback);
}

/**
 * The commander program for `deno task router` (exported for --help tests).
 */
// long function: the table of every flag, one short entry each; validation
// happens after parsing, in resolveConfig.
export function routerCommand(): Command {
  return newCommand(
    "router",
    "PegaFlow P/D router: an OpenAI-compatible HTTP front that sends each request to a prefill " +
      "backend (max_tokens=1) and then to a decode backend, relaying the decode answer.",
  )
    .addOption(opt("--host <host>", "interface to listen on", "HOST", DEFAULTS.host))
    .addOption(opt("--port <port>", "port to listen on (0 = any free port)", "PORT", DEFAULTS.port))
    .addOption(
      opt(
        "--prefill <url>",
        "prefill backend base URL (repeatable; env: comma-separated)",
        "PREFILL",
      )
        .argParser(collect),
    )
    .addOption(
      opt("--decode <url>", "decode backend base URL (repeatable; env: comma-separated)", "DECODE")
        .argParser(collect),
    )
    .addOption(
      opt(
        "--prefill-timeout <duration>",
        "deadline of one prefill request (e.g. 500ms, 30s)",
        "PREFILL_TIMEOUT",
        DEFAULTS.prefillTimeout,
      ),
    )
    .addOption(
      opt(
        "--decode-timeout <duration>",
        "deadline for the decode backend's response headers",
        "DECODE_TIMEOUT",
        DEFAULTS.decodeTimeout,
      ),
    )
    .addOption(
      opt(
        "--stream-idle-timeout <duration>",
        "longest silence allowed between decode body chunks, or 'off' (setting it makes the router inspect every chunk)",
        "STREAM_IDLE_TIMEOUT",
        DEFAULTS.streamIdleTimeout,
      ),
    )
    .addOption(
      opt(
        "--health-interval <duration>",
        "period of backend health checks",
        "HEALTH_INTERVAL",
        DEFAULTS.healthInterval,
      ),
    )
    .addOption(
      opt(
        "--health-timeout <duration>",
        "deadline of one health check",
        "HEALTH_TIMEOUT",
        DEFAULTS.healthTimeout,
      ),
    )
    .addOption(
      opt(
        "--health-path <path>",
        "path probed by health checks (/health, or /v1/models)",
        "HEALTH_PATH",
        DEFAULTS.healthPath,
      ),
    )
    .addOption(
      opt(
        "--max-body <size>",
        "largest accepted request body (e.g. 1048576, 512kb, 16mb)",
        "MAX_BODY",
        DEFAULTS.maxBody,
      ),
    )
    .addOption(
      opt("--log-level <level>", "error | warn | info | debug", "LOG_LEVEL", DEFAULTS.logLevel),
    )
    .addOption(
      opt(
        "--shutdown-grace <duration>",
        "on SIGINT/SIGTERM, how long open requests may finish before they are cut with a 503",
        "SHUTDOWN_GRACE",
        DEFAULTS.shutdownGrace,
      ),
    )
    .addOption(
      opt(
        "--workers <n>",
        "threads serving the port (SO_REUSEPORT); auto = min(4, CPU cores); 1 = the main thread only",
        "WORKERS",
        DEFAULTS.workers,
      ),
    );
}

/**
 * Parses argv (without the program name) and the `PEGAFLOW_ROUTER_*` environment into a
 * validated {@link RouterConfig}. Never starts anything and never exits: `--help` yields
 * `{kind: "exit", code: 0}`, a bad flag or value `{kind: "exit", code: 2}` naming the flag.
 *
 * @example
 * ```ts
 * const r = parseRouterArgs(["--prefill", "http://p:8000", "--decode", "http://d:8001"]);
 * if (r.kind === "config") console.log(r.config.port); // 8080
 * ```
 */
export function parseRouterArgs(argv: string[]): ParsedArgs<RouterConfig> {
  const cmd = routerCommand();
  const parsed = parseCommandLine(cmd, argv);
  if (parsed.kind === "exit") return parsed;
  const raw = cmd.opts<Partial<RawRouterOptions>>();
  const envVars: Record<string, string> = {};
  for (const o of cmd.options) {
    if (o.long && o.envVar && cmd.getOptionValueSource(o.attributeName()) === "env") {
      envVars[o.long] = o.envVar;
    }
  }
  try {
    const config = resolveConfig({
      ...DEFAULTS,
      ...raw,
      prefill: raw.prefill ?? [],
      decode: raw.decode ?? [],
    } as RawRouterOptions);
    return { kind: "config", config: { ...config, envVars } };
  } catch (e) {
    if (!(e instanceof ConfigError)) throw e;
    return usageExit(e.message + envNote(envVars, [e.flag]));
  }
}
