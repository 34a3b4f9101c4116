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
  /** Starts node i's server with the cluster's index flags plus `flags`. */
  start(i: number, flags?: string[], env?: Record<string, string>): Promise<ServerProc>;
  /** Kills Redis and removes the namespaces and the bridge. */
  remove(): Promise<void>;
}

async function quietIp(...args: string[]): Promise<void> {
  await new Deno.Command("ip", { args, stdout: "null", stderr: "null" }).output();
}

/** Makes the namespaces and the bridge, or returns why it could not. */
async function makeNetns(n: number, tag: string) {
  const id = `${tag}${Deno.pid}`.slice(0, 9);
  const octet = 16 + (Deno.pid % 200);
  const br = `pfbr${id}`.slice(0, 15);
  const ns = Array.from({ length: n }, (_, i) => `pfn${i}${id}`);
  const remove = async () => {
    for (const x of ns) await quietIp("netns", "del", x);
    await quietIp("link", "del", br);
  };
  try {
    await ip("link", "add", br, "type", "bridge");
    await ip("addr", "add", `10.${octet}.0.254/24`, "dev", br);
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
  return {
    mode: netns ? "netns" : "loopback",
    why: typeof net === "string" ? net : undefined,
    redis,
    nodeNs: (i) => netns?.ns[i],
    nodeAddr: addr,
    start: (i, flags = [], env = {}) =>
      startServer(
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
      ),
    async remove() {
      await redis.stop();
      await netns?.remove();
    },
  };
}
