/**
 * Waiting for an HTTP server to close, with a deadline: the one wait both the
 * KV server (lib/server/server.ts) and the router (lib/router/server.ts) use
 * when they stop.
 *
 * A client that stopped sending in the middle of its request body keeps its
 * connection open: Deno's `HttpServer.shutdown()` waits for the rest of that
 * body (the handler has long given up on it) and no abort reaches it, so an
 * unbounded `await server.shutdown()` never returns and the process never
 * exits on SIGTERM. Past {@link HTTP_CLOSE_WAIT_MS} the caller stops without
 * that connection.
 *
 * @module
 */
import { LATE, within } from "../timer_limit.ts";

/** How long closing an HTTP server's last connections may take once nothing is served. */
export const HTTP_CLOSE_WAIT_MS = 2_000;

/**
 * Whether `p` settles within `ms` (a rejection of `p` is thrown).
 *
 * @example
 * ```ts
 * if (!(await settlesWithin(server.shutdown(), HTTP_CLOSE_WAIT_MS))) log.warn("still open");
 * ```
 */
export async function settlesWithin(p: Promise<unknown>, ms: number): Promise<boolean> {
  return await within(p, ms) !== LATE;
}
