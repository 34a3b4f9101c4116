/**
 * Test scaffolding: N server "nodes" on one machine, each in its own network
 * namespace, joined by veth pairs to a bridge in the test's namespace (which
 * holds 10.<k>.0.254 and runs the one redis-server), so every node reaches
 * Redis and every other node only over its veth. Made and removed by the
 * test (root). Where `ip netns` is unavailable the nodes fall back to
 * loopback with distinct ports, and `mode`/`why` say so.
 */

import { ip } from "../xfer/_harness.ts";
import { type ServerProc, startServer } from "../server/harness.ts";
import { type RedisProcess, startRedis } from "../index/_redis.ts";

/** Where the nodes live. */
export interface Cluster {
  mode: "netns" | "loopback";
  /** Why netns could not be used (loopback mode). */
  why?: string;
  redis: RedisProcess;
  /** The namespace of node i (netns mode) and the address it binds. */
  nodeNs(i: number): string | undefined;
  nodeAddr(i: number): string;
  /** Starts node i's server with the cluster's index flags plus `flags`; stopped by remove(). */
  start(i: number, flags?: string[], env?: Record<string, string>): Promise<ServerProc>;
  /** Runs `fn` in remove(), before the servers stop (latest first): engines, probes. */
  defer(fn: () => void | Promise<void>): void;
  /** Runs the deferred cleanups, stops the servers, kills Redis, removes the namespaces and the bridge. */
  remove(): Promise<void>;
}

/** Best effort (cleanup): a missing `ip` binary or a failed command is ignored. */
async function quietIp(...args: string[]): Promise<void> {
  try {
    await new Deno.Command("ip", { args, stdout: "null", stderr: "null" }).output();
  } catch {
    // nothing to remove without `ip`
  }
}

/** Second octets of the 10.X.0.0/24 routes this (root) namespace has now. */
async function usedOctets(): Promise<Set<number>> {
  const out = await new Deno.Command("ip", { args: ["-4", "route"], stdout: "piped" }).output();
  const used = new Set<number>();
  for (const m of new TextDecoder().decode(out.stdout).matchAll(/^10\.(\d+)\.0\.0\/24/gm)) {
    used.add(Number(m[1]));
  }
  return used;
}

/** Test files run in parallel in one process: the subnet starts from the tag, skips taken ones. */
function tagHash(tag: string): number {
  let h = 0;
  for (const ch of tag) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return h;
}

/** Makes the namespaces and the bridge, or returns why it could not. */
async function makeNetns(n: number, tag: string) {
  const id = `${tag}${Deno.pid}`.slice(0, 9);
  let used: Set<number>;
  try {
    used = await usedOctets();
  } catch (e) {
    // No `ip` binary (a container without iproute2): loopback, saying why.
    return `cannot run ip: ${(e as Error).message}`;
  }
  let octet = 100 + (tagHash(tag) % 150);
  while (used.has(octet)) octet = 100 + ((octet - 100 + 1) % 150);
  const br = `pfbr${id}`.slice(0, 15);
  const ns = Array.from({ length: n }, (_, i) => `pfn${i}${id}`);
  const remove = async () => {
    for (const x of ns) await quietIp("netns", "del", x);
    await quietIp("link", "del", br);
  };
  try {
    await ip("link", "add", br, "type", "bridge");
    await ip("addr", "add", `10.${octet}.0.254/24`, "dev", br);
    // Another cluster made at the same moment may have taken the subnet: give up clearly.
    const routes = new TextDecoder().decode(
      (await new Deno.Command("ip", { args: ["-4", "route"], stdout: "piped" }).output()).stdout,
    );
    if (routes.split("\n").filter((l) => l.startsWith(`10.${octet}.0.0/24 `)).length > 1) {
      throw new Error(`subnet 10.${octet}.0.0/24 is taken by another bridge`);
    }
    await ip("link", "set", br, "up");
    for (let i = 0; i < n; i++) {
      const inside = `pv${i}${id}`.slice(0, 15), outside = `ph${i}${id}`.slice(0, 15);
      await ip("netns", "add", ns[i]);
      await ip("link", "add", inside, "type", "veth", "peer", "name", outside);
      await ip("link", "set", inside, "netns", ns[i]);
      await ip("link", "set", outside, "master", br);
      await ip("link", "set", outside, "up");
      await ip("-n", ns[i], "addr", "add", `10.${octet}.0.${i + 1}/24`, "dev", inside);
      await ip("-n", ns[i], "link", "set", inside, "up");
      await ip("-n", ns[i], "link", "set", "lo", "up");
    }
    return { ns, hub: `10.${octet}.0.254`, addr: (i: number) => `10.${octet}.0.${i + 1}`, remove };
  } catch (e) {
    await remove();
    return (e as Error).message;
  }
}

/**
 * A cluster of `n` node slots and one Redis; nodes start with {@link Cluster.start}.
 *
 * @example
 * ```ts
 * const c = await makeCluster(2, "fetch");
 * const a = await c.start(0), b = await c.start(1);
 * ```
 */
export async function makeCluster(n: number, tag: string): Promise<Cluster> {
  const net = await makeNetns(n, tag);
  const netns = typeof net === "string" ? undefined : net;
  if (!netns) {
    console.log(`ip netns unavailable (${net}): the nodes run on loopback with distinct ports`);
  }
  let redis: RedisProcess;
  try {
    redis = await startRedis(netns ? netns.hub : "127.0.0.1");
  } catch (e) {
    await netns?.remove();
    throw e;
  }
  const addr = (i: number) => netns ? netns.addr(i) : "127.0.0.1";
  const servers: ServerProc[] = [];
  const deferred: (() => void | Promise<void>)[] = [];
  const attempt = async (what: string, fn: () => void | Promise<void>) => {
    try {
      await fn();
    } catch (e) {
      console.error(`cluster cleanup (${what}): ${(e as Error).message}`);
    }
  };
  return {
    mode: netns ? "netns" : "loopback",
    why: typeof net === "string" ? net : undefined,
    redis,
    nodeNs: (i) => netns?.ns[i],
    nodeAddr: addr,
    defer: (fn) => void deferred.push(fn),
    async start(i, flags = [], env = {}) {
      const srv = await startServer(
        [
          "--addr",
          `${addr(i)}:0`,
          "--http-addr",
          `${addr(i)}:0`,
          "--index-redis",
          redis.url,
          "--node-id",
          `node-${i}`,
          "--transport",
          "tcp",
          "--index-timeout-ms",
          "500",
          "--index-node-ttl-ms",
          "2000",
          ...flags,
        ],
        env,
        netns?.ns[i],
      );
      servers.push(srv);
      return srv;
    },
    async remove() {
      // Engines and probes first (latest first), then the servers, Redis, the network.
      for (const fn of deferred.reverse()) await attempt("deferred", fn);
      for (const srv of servers) await attempt("server", () => srv.stop());
      await attempt("redis", () => redis.stop());
      await netns?.remove();
    },
  };
}
