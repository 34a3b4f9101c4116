/**
 * `deno task router`: the P/D router's command line. Parses flags (each also read from a
 * `PEGAFLOW_ROUTER_*` environment variable), refuses bad values before anything starts, then runs
 * the router until SIGINT/SIGTERM. Everything else lives in lib/router/.
 *
 * @example
 * ```sh
 * deno task router --prefill http://p0:8000 --decode http://d0:8001 --decode http://d1:8001
 * ```
 *
 * @module
 */

import { Command, type Option } from "commander";
import { exitWith, parseCommandLine, usageError } from "./lib/cli/command_line.ts";
import { envOption } from "./lib/cli/flags.ts";
import {
  ConfigError,
  DEFAULTS,
  type RawRouterOptions,
  resolveConfig,
  type RouterConfig,
} from "./lib/router/config.ts";
import { startRouter } from "./lib/router/server.ts";
import { startRouterCluster } from "./lib/router/cluster.ts";

/** Repeatable flags accumulate; an env var may list several URLs separated by commas. */
function collect(value: string, previous: string[] | undefined): string[] {
  const items = value.split(",").map((s) => s.trim()).filter((s) => s !== "");
  return [...(previous ?? []), ...items];
}

function opt(flags: string, description: string, env: string, fallback?: string): Option {
  const o = envOption(flags, description, `ROUTER_${env}`);
  return fallback === undefined ? o : o.default(fallback);
}

const program = new Command("router")
  .description(
    "PegaFlow P/D router: an OpenAI-compatible HTTP front that sends each request to a prefill " +
      "backend (max_tokens=1) and then to a decode backend, relaying the decode answer.",
  )
  .addOption(opt("--host <host>", "interface to listen on", "HOST", DEFAULTS.host))
  .addOption(opt("--port <port>", "port to listen on (0 = any free port)", "PORT", DEFAULTS.port))
  .addOption(
    opt("--prefill <url>", "prefill backend base URL (repeatable; env: comma-separated)", "PREFILL")
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
      "--workers <n>",
      "threads serving the port (SO_REUSEPORT); auto = min(4, CPU cores); 1 = the main thread only",
      "WORKERS",
      DEFAULTS.workers,
    ),
  )
  .showHelpAfterError("(run with --help for usage)")
  .allowExcessArguments(false);

// Every usage error (an unknown flag included) exits 2 naming the flag, as the server's do.
const parsed = parseCommandLine(program, Deno.args);
if (parsed.kind === "exit") exitWith(parsed);
const raw = program.opts<Partial<RawRouterOptions>>();

/** The validated configuration, or exit with status 2 and a message naming the bad flag. */
function configOrExit(): RouterConfig {
  try {
    return resolveConfig({
      ...DEFAULTS,
      ...raw,
      prefill: raw.prefill ?? [],
      decode: raw.decode ?? [],
    } as RawRouterOptions);
  } catch (e) {
    if (!(e instanceof ConfigError)) throw e;
    return usageError(e.message);
  }
}

/**
 * Several workers share the port with SO_REUSEPORT, which Deno only offers under --unstable-net
 * (`deno task router` passes it); without that flag its net APIs, listenDatagram among them, are
 * absent.
 */
const REUSE_PORT_AVAILABLE =
  typeof (Deno as unknown as { listenDatagram?: unknown }).listenDatagram === "function";

/** The configuration, with `auto` workers cut to 1 (with a warning) where SO_REUSEPORT is off. */
function withUsableWorkers(config: RouterConfig): RouterConfig {
  if (config.workers === 1 || REUSE_PORT_AVAILABLE) return config;
  if (String(raw.workers ?? DEFAULTS.workers).trim().toLowerCase() === "auto") {
    console.error(JSON.stringify({
      ts: new Date().toISOString(),
      level: "warn",
      msg: "serving from one thread: several workers need Deno's --unstable-net (SO_REUSEPORT); " +
        "deno task router passes it",
    }));
    return { ...config, workers: 1 };
  }
  return usageError(
    `--workers: ${config.workers} workers share the port with SO_REUSEPORT, which Deno ` +
      `enables with --unstable-net (deno task router passes it); run with it or use --workers 1`,
  );
}

const config = withUsableWorkers(configOrExit());
// One thread serves with --workers 1; more share the port (lib/router/cluster.ts).
const start = config.workers === 1 ? startRouter(config) : startRouterCluster(config);
const router = await start.catch((e) => {
  if (e instanceof Deno.errors.AddrInUse || e instanceof Deno.errors.AddrNotAvailable) {
    return usageError(
      `--host/--port: cannot listen on ${config.host}:${config.port}: ${e.message}`,
    );
  }
  throw e;
});
// Signals are handled before the line goes out: a supervisor may stop the router as soon as it
// has read it.
for (const sig of ["SIGINT", "SIGTERM"] as const) {
  Deno.addSignalListener(sig, () => {
    router.shutdown().then(() => Deno.exit(0));
  });
}
// One machine-readable line on stdout, whatever the log level (after every worker listens), so
// supervisors and tests learn the bound address (useful with --port 0).
console.log(JSON.stringify({ event: "listening", url: router.url, port: router.port }));
await router.finished;
