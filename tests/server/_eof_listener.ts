/** Test listeners for the framed RPC tests (tests/server/local_rpc_review*_test.ts). */
/**
 * A unix listener whose connections report when the server read their end of stream
 * (`onEof`) and, given `onClose`, each close of a connection.
 */
export function eofReportingListener(path: string, onEof: () => void, onClose?: () => void) {
  const real = Deno.listen({ transport: "unix", path });
  const wrap = (conn: Deno.UnixConn) =>
    new Proxy(conn, {
      get(target, prop) {
        if (prop === "read") {
          return async (p: Uint8Array) => {
            const n = await target.read(p);
            if (n === null) onEof();
            return n;
          };
        }
        if (prop === "close" && onClose) {
          return () => {
            onClose();
            target.close();
          };
        }
        const v = Reflect.get(target, prop, target);
        return typeof v === "function" ? v.bind(target) : v;
      },
    });
  // What serveLocalRpc uses of a listener: accept, close, addr.
  const listener = {
    accept: async () => wrap(await real.accept()),
    close: () => real.close(),
    addr: real.addr,
  };
  return listener as unknown as Deno.Listener<Deno.UnixConn, Deno.UnixAddr>;
}
