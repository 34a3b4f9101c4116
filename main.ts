/**
 * `deno task serve`: parses the command line, then starts the KV server.
 * Nothing else lives here (lib/server/ has the server, lib/server/config.ts
 * the flags). A bad flag value exits with status 2 before anything starts.
 *
 * @module
 */
import { exitWith } from "./lib/cli/command_line.ts";
import { parseServeArgs } from "./lib/server/config.ts";
import { Logger } from "./lib/log.ts";
import type { RunningServer } from "./lib/server/server.ts";

if (import.meta.main) {
  const parsed = parseServeArgs(Deno.args);
  if (parsed.kind === "exit") exitWith(parsed);
  const cfg = parsed.config;
  const log = new Logger(cfg.logLevel);
  let server: RunningServer | undefined;
  /** SIGINT/SIGTERM on a started server: a graceful stop, exit 0 (1 when it could not finish). */
  const stop = async (running: RunningServer, sig: string) => {
    log.info("signal received", { signal: sig });
    try {
      await running.close();
    } catch (e) {
      // A stop that could not finish (what it left is in the log lines before this one).
      log.error("stop failed", { signal: sig, error: (e as Error)?.stack ?? String(e) });
      Deno.exit(1);
    }
    Deno.exit(0);
  };
  // Listened for from before the first bind: a signal while the pool is built
  // stops the start, closing what was bound (its socket files removed) at once.
  const starting = new AbortController();
  const onSignal = (sig: string) => {
    if (server) return void stop(server, sig);
    if (starting.signal.aborted) return;
    log.info("signal received during start-up", { signal: sig });
    starting.abort(new Error(`${sig} received during start-up`));
  };
  Deno.addSignalListener("SIGINT", () => onSignal("SIGINT"));
  Deno.addSignalListener("SIGTERM", () => onSignal("SIGTERM"));
  try {
    // Loaded only after the flags are valid: --help and refusals never touch the native library.
    const { startServer } = await import("./lib/server/server.ts");
    server = await startServer(cfg, log, starting.signal);
  } catch (e) {
    if (starting.signal.aborted && e === starting.signal.reason) {
      log.info("start-up stopped: every socket bound so far is closed", {
        reason: (e as Error).message,
      });
      Deno.exit(0);
    }
    log.error("start-up failed", { error: (e as Error).message });
    Deno.exit(1);
  }
  // The one stdout line: tests and supervisors parse the bound ports from it.
  console.log(
    JSON.stringify({
      listening: {
        grpc: server.grpcAddr,
        uds: server.udsPath ?? null,
        http: server.httpAddr ?? null,
      },
    }),
  );
}
