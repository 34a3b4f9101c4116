/**
 * `deno task router`: the P/D router's command line. Parses flags (each also read from a
 * `PEGAFLOW_ROUTER_*` environment variable; lib/router/config.ts), refuses bad values before
 * anything starts (exit 2 naming the flag), then runs the router until SIGINT/SIGTERM. Everything
 * else lives in lib/router/.
 *
 * @example
 * ```sh
 * deno task router --prefill http://p0:8000 --decode http://d0:8001 --decode http://d1:8001
 * ```
 *
 * @module
 */

import { exitWith, usageError } from "./lib/cli/command_line.ts";
import { Logger } from "./lib/log.ts";
import { envNote, parseRouterArgs, type RouterConfig } from "./lib/router/config.ts";
import { ListenError, startRouter } from "./lib/router/server.ts";
import { startRouterCluster } from "./lib/router/cluster.ts";

const parsed = parseRouterArgs(Deno.args);
if (parsed.kind === "exit") exitWith(parsed);

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
  if (config.workersAuto) {
    new Logger(config.logLevel).warn(
      "serving from one thread: several workers need Deno's --unstable-net (SO_REUSEPORT); " +
        "deno task router passes it",
      { workers: config.workers },
    );
    return { ...config, workers: 1 };
  }
  return usageError(
    `--workers: ${config.workers} workers share the port with SO_REUSEPORT, which Deno ` +
      `enables with --unstable-net (deno task router passes it); run with it or use --workers 1` +
      envNote(config.envVars, ["--workers"]),
  );
}

const config = withUsableWorkers(parsed.config);
// One thread serves with --workers 1; more share the port (lib/router/cluster.ts).
const start = config.workers === 1 ? startRouter(config) : startRouterCluster(config);
const router = await start.catch((e) => {
  if (e instanceof ListenError) {
    return usageError(
      `--host/--port: ${e.message}${envNote(config.envVars, ["--host", "--port"])}`,
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
