/**
 * Test scaffolding: a real 3-master Redis Cluster (no replicas) on free ports in a temp dir,
 * persistence off, made with `redis-cli --cluster create`, killed (and its dir removed) by
 * `stop()` — call it in a `finally`. `restart(i)` starts master `i` again, empty but with its
 * `nodes.conf`, so it takes its slots back (a crash and restart without persistence).
 */

import { Redis } from "ioredis";
import { waitFor } from "./_redis.ts";

const REDIS_BIN = Deno.env.get("PEGAFLOW_REDIS_SERVER") ?? "redis-server";
const REDIS_CLI = Deno.env.get("PEGAFLOW_REDIS_CLI") ?? "redis-cli";
const MASTERS = 3;
/** The cluster bus listens on port + 10000; ports stay below 55536 so that it exists. */
const BUS_OFFSET = 10_000;
/** Long enough that a master restarted within it is never voted failed (no replicas anyway). */
const NODE_TIMEOUT_MS = 5_000;

export interface RedisCluster {
  ports: number[];
  /** The seed list `--index-redis` takes: `redis://127.0.0.1:P1,redis://127.0.0.1:P2,...`. */
  url: string;
  /** A plain client to master `i` (KEYS, MONITOR...); closed by stop(). */
  admin(i: number): Redis;
  /** Which master (index into `ports`) serves `key`'s slot. */
  masterOf(key: string): Promise<number>;
  /** SIGKILL master `i`. */
  kill(i: number): Promise<void>;
  /** Starts master `i` again (empty, same node id and slots) and waits for cluster_state:ok. */
  restart(i: number): Promise<void>;
  stop(): Promise<void>;
}

function canBind(port: number): boolean {
  try {
    Deno.listen({ hostname: "127.0.0.1", port }).close();
    return true;
  } catch (_e) {
    return false;
  }
}

/** A free port whose bus port (+10000) is free too. */
function freeClusterPort(taken: number[]): number {
  for (let tries = 0; tries < 200; tries++) {
    const port = 20_000 + Math.floor(Math.random() * 30_000);
    if (!taken.includes(port) && canBind(port) && canBind(port + BUS_OFFSET)) return port;
  }
  throw new Error("no free port pair (port, port+10000) found for a cluster node");
}

async function clusterOk(port: number): Promise<boolean> {
  const c = new Redis({ port, host: "127.0.0.1", lazyConnect: true, maxRetriesPerRequest: 0 });
  c.on("error", () => {});
  try {
    await c.connect();
    return /cluster_state:ok/.test(String(await c.call("CLUSTER", "INFO")));
  } catch (_e) {
    return false; // not up yet
  } finally {
    c.disconnect(false);
  }
}

/** Cluster starts tried before the error goes up (see {@link startRedisCluster}). */
const START_ATTEMPTS = 3;

/**
 * Starts the cluster and waits until every master says cluster_state:ok. A node can lose its
 * port, or its bus port (port + 10000, inside the kernel's ephemeral range), to another socket
 * between the check and its bind: such a start is tried again on new ports.
 */
export async function startRedisCluster(): Promise<RedisCluster> {
  for (let attempt = 1;; attempt++) {
    try {
      return await startOnce();
    } catch (e) {
      if (attempt >= START_ATTEMPTS) throw e;
    }
  }
}

async function startOnce(): Promise<RedisCluster> {
  const dir = await Deno.makeTempDir({ prefix: "pf-redis-cluster-test-" });
  const ports: number[] = [];
  for (let i = 0; i < MASTERS; i++) ports.push(freeClusterPort(ports));
  const children: (Deno.ChildProcess | undefined)[] = [];
  const admins: Redis[] = [];
  const spawn = async (i: number) => {
    const nodeDir = `${dir}/${ports[i]}`;
    await Deno.mkdir(nodeDir, { recursive: true });
    // deno-fmt-ignore
    children[i] = new Deno.Command(REDIS_BIN, {
      args: ["--port", String(ports[i]), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", String(NODE_TIMEOUT_MS),
        "--save", "", "--appendonly", "no", "--dir", nodeDir],
      stdout: "null",
      stderr: "null",
    }).spawn();
    await waitFor(`redis-server on ${ports[i]}`, () => !canBind(ports[i]));
  };
  const kill = async (i: number) => {
    const p = children[i];
    if (!p) return;
    children[i] = undefined;
    try {
      p.kill("SIGKILL");
    } catch { /* it had exited (a node that failed to start) */ }
    await p.status;
  };
  const stop = async () => {
    for (const a of admins) a.disconnect(false);
    for (let i = 0; i < MASTERS; i++) await kill(i);
    await Deno.remove(dir, { recursive: true });
  };
  const allOk = async () => (await Promise.all(ports.map(clusterOk))).every(Boolean);
  try {
    for (let i = 0; i < MASTERS; i++) await spawn(i);
    const create = await new Deno.Command(REDIS_CLI, {
      args: [
        "--cluster",
        "create",
        ...ports.map((p) => `127.0.0.1:${p}`),
        "--cluster-replicas",
        "0",
        "--cluster-yes",
      ],
      stdout: "piped",
      stderr: "piped",
    }).output();
    if (!create.success) {
      throw new Error(
        `redis-cli --cluster create failed: ${new TextDecoder().decode(create.stdout)}`,
      );
    }
    await waitFor("cluster_state:ok on every master", allOk, 20_000);
  } catch (e) {
    await stop();
    throw e;
  }
  const admin = (i: number) => {
    const r = new Redis({ port: ports[i], host: "127.0.0.1", maxRetriesPerRequest: 1 });
    r.on("error", () => {}); // the test kills masters under it on purpose
    admins.push(r);
    return r;
  };
  const probe = admin(0);
  return {
    ports,
    url: ports.map((p) => `redis://127.0.0.1:${p}`).join(","),
    admin,
    async masterOf(key) {
      const slot = Number(await probe.call("CLUSTER", "KEYSLOT", key));
      const ranges = await probe.call("CLUSTER", "SLOTS") as [number, number, [string, number]][];
      const r = ranges.find(([lo, hi]) => slot >= lo && slot <= hi);
      if (!r) throw new Error(`slot ${slot} of ${key} is served by no master`);
      return ports.indexOf(Number(r[2][1]));
    },
    kill,
    async restart(i) {
      await kill(i);
      await spawn(i);
      await waitFor("cluster_state:ok after a restart", allOk, 20_000);
    },
    stop,
  };
}
