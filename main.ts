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

if (import.meta.main) {
  const parsed = parseServeArgs(Deno.args);
  if (parsed.kind === "exit") exitWith(parsed);
  const cfg = parsed.config;
  const log = new Logger(cfg.logLevel);
  let server;
  try {
    // Loaded only after the flags are valid: --help and refusals never touch the native library.
    const { startServer } = await import("./lib/server/server.ts");
    server = await startServer(cfg, log);
  } catch (e) {
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
  const stop = async (sig: string) => {
    log.info("signal received", { signal: sig });
    try {
      await server.close();
    } catch (e) {
      // A stop that could not finish (what it left is in the log lines before this one).
      log.error("stop failed", { signal: sig, error: (e as Error)?.stack ?? String(e) });
      Deno.exit(1);
    }
    Deno.exit(0);
  };
  Deno.addSignalListener("SIGINT", () => stop("SIGINT"));
  Deno.addSignalListener("SIGTERM", () => stop("SIGTERM"));
}
