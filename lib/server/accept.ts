/**
 * The one accept loop of the server's own listeners (the local RPC and peer
 * RPC sockets, the GOAWAY guard's relay): a failed accept that leaves the
 * listener usable (EMFILE: the process is out of descriptors; a connection
 * reset while queued) is reported and accepting goes on after a pause. A
 * loop that stopped there once left the local RPC socket's file in place
 * while nothing accepted: every later call hung to its deadline.
 *
 * @module
 */

/** Pause after a failed accept before the next. */
export const ACCEPT_RETRY_MS = 50;

/** What {@link acceptEach} reports. */
export interface AcceptHandlers<C extends Deno.Conn> {
  /** A new connection. */
  serve(conn: C): void;
  /** An accept failed and the loop accepts again in {@link ACCEPT_RETRY_MS}. */
  retrying(e: unknown): void;
  /** The listener is gone (closed under the loop) while `closed()` was still false. */
  gone?(e: unknown): void;
}

/**
 * Accepts from `listener` until `closed()` says so or the listener is gone.
 *
 * @example
 * ```ts
 * const done = acceptEach(listener, () => stopped, {
 *   serve: (c) => handle(c),
 *   retrying: (e) => log.warn("accept failed", { error: String(e) }),
 * });
 * ```
 */
export async function acceptEach<C extends Deno.Conn>(
  listener: Deno.Listener<C>,
  closed: () => boolean,
  on: AcceptHandlers<C>,
): Promise<void> {
  while (!closed()) {
    let conn: C;
    try {
      conn = await listener.accept();
    } catch (e) {
      if (closed()) return;
      if (e instanceof Deno.errors.BadResource || e instanceof Deno.errors.Interrupted) {
        on.gone?.(e);
        return;
      }
      on.retrying(e);
      await new Promise((r) => setTimeout(r, ACCEPT_RETRY_MS));
      continue;
    }
    on.serve(conn);
  }
}
