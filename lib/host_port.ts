/**
 * `host:port` addresses, split in one place: the flags that take one
 * (`--addr`, `--http-addr`, `--advertise-addr`) and the peer RPC address
 * another node hands over (lib/peer/link.ts). Each caller adds its own
 * checks (port range, wildcards) and words its own error.
 *
 * @module
 */

/**
 * The host (as written, brackets of an IPv6 literal kept) and the decimal
 * port of `addr`, or undefined when it is not `host:port`.
 *
 * @example
 * ```ts
 * splitHostPort("10.0.0.7:50055"); // { host: "10.0.0.7", port: 50055 }
 * splitHostPort("[fd00::7]:1"); // { host: "[fd00::7]", port: 1 }
 * splitHostPort("nohost"); // undefined
 * ```
 */
export function splitHostPort(addr: string): { host: string; port: number } | undefined {
  const m = /^(.+):(\d+)$/.exec(addr);
  return m ? { host: m[1], port: Number(m[2]) } : undefined;
}
