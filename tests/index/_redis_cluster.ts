/**
 * Test scaffolding: a real 3-master Redis Cluster on free ports in a temp dir, persistence off,
 * made with `redis-cli --cluster create`, killed (and its dir removed) by `stop()` — call it in a
 * `finally`. `restart(i)` starts node `i` again, empty but with its `nodes.conf`, so it takes its
 * slots back (a crash and restart without persistence).
 *
 * `startRedisCluster({ replicas: 1 })` gives each master one replica (6 nodes) and a short node
 * timeout, so that killing a master (`kill(i)`) fails its slots over to its replica within ~1-3 s:
 * `replicaOf(i)` names the replica before the kill, `waitPromoted(r)` waits until it serves as
 * master and every live node says cluster_state:ok. `pause(i)` / `resume(i)` (SIGSTOP / SIGCONT)
 * hold a replica back from an election, and from its master's last writes
 * (`dropReplicas(i)` first).
 *
 * `migrateSlot(key, to, between)` moves the slot of `key` to master `to` the way `redis-cli --cluster
 * reshard` does, awaiting `between` after each key it moved (the slot half on each master).
 *
 * `startRedisCluster({ tls: certs })` (certificates from `makeTestCertificates` in ./_redis.ts:
 * one certificate for 127.0.0.1 serves every node) makes each node serve TLS only, its cluster
 * bus and replication too; `url` then lists `rediss://` seeds, and `admin(i)` and the harness's
 * own queries trust the test CA.
 */

import { Redis } from "ioredis";
import { type TestCertificates, waitFor } from "./_redis.ts";

const REDIS_BIN = Deno.env.get("PEGAFLOW_REDIS_SERVER") ?? "redis-server";
const REDIS_CLI = Deno.env.get("PEGAFLOW_REDIS_CLI") ?? "redis-cli";
const MASTERS = 3;
/** The cluster bus listens on port + 10000; ports stay below 55536 so that it exists. */
const BUS_OFFSET = 10_000;
/** Long enough that a master restarted within it is never voted failed (no replicas anyway). */
const NODE_TIMEOUT_MS = 5_000;
/**
 * With replicas: a dead master is flagged failed after this, and its replica elected ~0.5-1 s
 * later. Not shorter: a node of a loaded 2-core machine must not be voted failed for a stall.
 */
const FAILOVER_NODE_TIMEOUT_MS = 1_000;
/** A test client's answer deadline: a paused or dead node must not hang a wait. */
const QUERY_TIMEOUT_MS = 1_000;

/** Options of {@link startRedisCluster}. */
export interface RedisClusterOptions {
  /** Replicas per master: 0 (default) or 1, with failover within ~1-3 s of a master's death. */
  replicas?: 0 | 1;
  /**
   * Serve TLS only (clients, cluster bus, replication) with these certificates; clients are not
   * asked for one. Default: plain TCP.
   */
  tls?: TestCertificates;
}

/** How the harness's own clients reach a node: plain TCP, or TLS trusting the test CA. */
interface NodeConnection {
  tls?: { ca: string };
}

export interface RedisCluster {
  /** Every node's port: the masters first (0..2), then the replicas, as started. */
  ports: number[];
  /**
   * The seed list `--index-redis` takes: `redis://127.0.0.1:P1,redis://127.0.0.1:P2,...`
   * (`rediss://` with `tls`).
   */
  url: string;
  /** A plain client to node `i` (KEYS, MONITOR...); closed by stop(). */
  admin(i: number): Redis;
  /** Which node (index into `ports`) serves `key`'s slot as master now. */
  masterOf(key: string): Promise<number>;
  /** The node that replicates master `i` now (with `replicas: 1`). */
  replicaOf(i: number): Promise<number>;
  /** SIGKILL node `i`. */
  kill(i: number): Promise<void>;
  /** SIGSTOP / SIGCONT node `i`: it holds its connections but does nothing (no election either). */
  pause(i: number): void;
  resume(i: number): void;
  /**
   * Master `i` closes its replicas' links: writes from then on reach no replica until one
   * reconnects (a paused one cannot), so a replica promoted after `i` dies lacks them.
   */
  dropReplicas(i: number): Promise<void>;
  /**
   * Waits until node `r` serves slots as master in every live node's view and every live node
   * says cluster_state:ok (a replica took over its dead master); fails after `ms`.
   */
  waitPromoted(r: number, ms?: number): Promise<void>;
  /** Starts node `i` again (empty, same node id and slots) and waits for cluster_state:ok. */
  restart(i: number): Promise<void>;
  /**
   * Moves the slot of `key` from its master to master `to` as `redis-cli --cluster reshard` does:
   * IMPORTING on `to`, MIGRATING on the source, its keys MIGRATEd one at a time (`between(moved,
   * left)` awaited after each: the slot's keys are then split between the two masters), then
   * SETSLOT NODE on the two and every other master. Returns how many keys moved.
   */
  migrateSlot(
    key: string,
    to: number,
    between?: (moved: number, left: number) => Promise<void>,
  ): Promise<number>;
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

/** One command on a fresh connection to `port`; undefined when the node did not answer. */
async function query(
  port: number,
  conn: NodeConnection,
  ...args: string[]
): Promise<string | undefined> {
  const c = new Redis({
    ...conn,
    port,
    host: "127.0.0.1",
    lazyConnect: true,
    maxRetriesPerRequest: 0,
    retryStrategy: () => null,
    connectTimeout: QUERY_TIMEOUT_MS,
    commandTimeout: QUERY_TIMEOUT_MS,
  });
  c.on("error", () => {});
  try {
    await c.connect();
    return String(await c.call(args[0], ...args.slice(1)));
  } catch (_e) {
    return undefined; // not up yet, dead, or paused
  } finally {
    c.disconnect(false);
  }
}

async function clusterOk(port: number, conn: NodeConnection): Promise<boolean> {
  return /cluster_state:ok/.test(await query(port, conn, "CLUSTER", "INFO") ?? "");
}

/** A line of CLUSTER NODES: the node's port, its flags, its master's id, whether it has slots. */
interface NodeLine {
  id: string;
  port: number;
  flags: string[];
  masterId: string;
  slots: boolean;
}

function nodeLines(nodes: string): NodeLine[] {
  return nodes.trim().split("\n").map((line) => {
    const f = line.trim().split(" ");
    return {
      id: f[0],
      port: Number(f[1].split("@")[0].split(":").at(-1)),
      flags: f[2].split(","),
      masterId: f[3],
      slots: f.length > 8,
    };
  });
}

/** Cluster starts tried before the error goes up (see {@link startRedisCluster}). */
const START_ATTEMPTS = 3;

/**
 * Starts the cluster and waits until every node says cluster_state:ok (and, with replicas, every
 * replica has synced). A node can lose its port, or its bus port (port + 10000, inside the
 * kernel's ephemeral range), to another socket between the check and its bind: such a start is
 * tried again on new ports.
 */
export async function startRedisCluster(opts: RedisClusterOptions = {}): Promise<RedisCluster> {
  for (let attempt = 1;; attempt++) {
    try {
      return await startOnce(opts.replicas ?? 0, opts.tls);
    } catch (e) {
      if (attempt >= START_ATTEMPTS) throw e;
    }
  }
}

/** redis-server's listening arguments for `port`: plain TCP, or TLS only (bus and replication too). */
function listenArgs(port: number, tls?: TestCertificates): string[] {
  if (!tls) return ["--port", String(port)];
  // The bus listens on tls-port + 10000 (port 0: no plain TCP at all).
  // deno-fmt-ignore
  return ["--port", "0", "--tls-port", String(port), "--tls-cluster", "yes",
    "--tls-replication", "yes", "--tls-cert-file", tls.certFile, "--tls-key-file", tls.keyFile,
    "--tls-ca-cert-file", tls.caFile, "--tls-auth-clients", "no"];
}

async function startOnce(replicas: 0 | 1, tls?: TestCertificates): Promise<RedisCluster> {
  const conn: NodeConnection = tls ? { tls: { ca: await Deno.readTextFile(tls.caFile) } } : {};
  const ask = (port: number, ...args: string[]) => query(port, conn, ...args);
  const dir = await Deno.makeTempDir({ prefix: "pf-redis-cluster-test-" });
  const ports: number[] = [];
  for (let i = 0; i < MASTERS * (1 + replicas); i++) ports.push(freeClusterPort(ports));
  const failover = replicas > 0
    // Any replica may be elected, however long its link was down (paused by a test); a replica
    // syncs at once (Redis 7.0 waits 5 s for more replicas before a diskless sync).
    // deno-fmt-ignore
    ? ["--cluster-node-timeout", String(FAILOVER_NODE_TIMEOUT_MS), "--cluster-replica-validity-factor", "0",
      "--repl-diskless-sync-delay", "0"]
    : ["--cluster-node-timeout", String(NODE_TIMEOUT_MS)];
  const children: (Deno.ChildProcess | undefined)[] = [];
  const admins: Redis[] = [];
  const probes = new Map<number, Redis>();
  const paused = new Set<number>();
  const spawn = async (i: number) => {
    const nodeDir = `${dir}/${ports[i]}`;
    await Deno.mkdir(nodeDir, { recursive: true });
    // deno-fmt-ignore
    children[i] = new Deno.Command(REDIS_BIN, {
      args: [...listenArgs(ports[i], tls), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf", ...failover,
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
    paused.delete(i);
    try {
      p.kill("SIGCONT");
      p.kill("SIGKILL");
    } catch { /* it had exited (a node that failed to start) */ }
    await p.status;
  };
  const stop = async () => {
    for (const a of admins) a.disconnect(false);
    for (let i = 0; i < ports.length; i++) await kill(i);
    await Deno.remove(dir, { recursive: true });
  };
  const live = () => ports.filter((_, i) => children[i] && !paused.has(i));
  const allOk = async () =>
    (await Promise.all(live().map((p) => clusterOk(p, conn)))).every(Boolean);
  const synced = async () => {
    const infos = await Promise.all(ports.map((p) => ask(p, "INFO", "replication")));
    const links = infos.filter((info) => /role:slave/.test(info ?? "role:slave"));
    return links.length === MASTERS * replicas &&
      links.every((info) => /master_link_status:up/.test(info ?? ""));
  };
  try {
    for (let i = 0; i < ports.length; i++) await spawn(i);
    const create = await new Deno.Command(REDIS_CLI, {
      // The first MASTERS nodes become masters; with all on one host redis-cli warns and goes on.
      // deno-fmt-ignore
      args: [...(tls ? ["--tls", "--cacert", tls.caFile] : []),
        "--cluster", "create", ...ports.map((p) => `127.0.0.1:${p}`),
        "--cluster-replicas", String(replicas), "--cluster-yes"],
      stdout: "piped",
      stderr: "piped",
    }).output();
    if (!create.success) {
      throw new Error(
        `redis-cli --cluster create failed: ${new TextDecoder().decode(create.stdout)}`,
      );
    }
    await waitFor("cluster_state:ok on every node", allOk, 20_000);
    if (replicas > 0) await waitFor("every replica synced with its master", synced, 20_000);
  } catch (e) {
    await stop();
    throw e;
  }
  const admin = (i: number) => {
    const r = new Redis({ ...conn, port: ports[i], host: "127.0.0.1", maxRetriesPerRequest: 1 });
    r.on("error", () => {}); // the test kills nodes under it on purpose
    admins.push(r);
    return r;
  };
  /** A client to a live node, for questions any node answers. */
  const probe = () => {
    const i = ports.indexOf(live()[0]);
    if (!probes.has(i)) probes.set(i, admin(i));
    return probes.get(i)!;
  };
  /** CLUSTER NODES as a live node sees it. */
  const nodesSeenBy = async (port: number) => {
    const text = await ask(port, "CLUSTER", "NODES");
    return text ? nodeLines(text) : [];
  };
  const masterOf = async (key: string) => {
    const slot = Number(await probe().call("CLUSTER", "KEYSLOT", key));
    const ranges = await probe().call("CLUSTER", "SLOTS") as [
      number,
      number,
      [string, number],
    ][];
    const r = ranges.find(([lo, hi]) => slot >= lo && slot <= hi);
    if (!r) throw new Error(`slot ${slot} of ${key} is served by no master`);
    return ports.indexOf(Number(r[2][1]));
  };
  return {
    ports,
    url: ports.map((p) => `${tls ? "rediss" : "redis"}://127.0.0.1:${p}`).join(","),
    admin,
    masterOf,
    async replicaOf(i) {
      // Every live node's view, not one: a replica's role reaches the others by gossip, and a
      // node that still listed it as a slotless master once failed a test here.
      const pick = (nodes: NodeLine[]) => {
        const id = nodes.find((n) => n.port === ports[i])?.id;
        return nodes.find((n) => id && n.masterId === id && !n.flags.includes("fail"))?.port;
      };
      let views: NodeLine[][] = [];
      try {
        await waitFor(`a replica of node ${ports[i]} in every live node's view`, async () => {
          views = await Promise.all(live().map(nodesSeenBy));
          const picks = new Set(views.map(pick));
          return picks.size === 1 && !picks.has(undefined);
        }, 10_000);
      } catch (e) {
        throw new Error(`node ${ports[i]} has no replica: ${JSON.stringify(views)}`, { cause: e });
      }
      return ports.indexOf(pick(views[0])!);
    },
    kill,
    pause(i) {
      paused.add(i);
      children[i]?.kill("SIGSTOP");
    },
    resume(i) {
      paused.delete(i);
      children[i]?.kill("SIGCONT");
    },
    async dropReplicas(i) {
      await admin(i).call("CLIENT", "KILL", "TYPE", "replica");
    },
    async waitPromoted(r, ms = 20_000) {
      const promotedIn = async (port: number) => {
        const me = (await nodesSeenBy(port)).find((n) => n.port === ports[r]);
        return me !== undefined && me.flags.includes("master") && me.slots;
      };
      await waitFor(
        `node ${ports[r]} promoted, cluster_state:ok on every live node`,
        async () => (await Promise.all(live().map(promotedIn))).every(Boolean) && await allOk(),
        ms,
      );
    },
    async restart(i) {
      await kill(i);
      await spawn(i);
      await waitFor("cluster_state:ok after a restart", allOk, 20_000);
    },
    async migrateSlot(key, to, between = async () => {}) {
      const slot = String(await probe().call("CLUSTER", "KEYSLOT", key));
      const from = await masterOf(key);
      if (from === to) throw new Error(`slot ${slot} of ${key} is on master ${ports[to]} already`);
      const [src, dst] = [admin(from), admin(to)];
      const [srcId, dstId] = [
        String(await src.call("CLUSTER", "MYID")),
        String(await dst.call("CLUSTER", "MYID")),
      ];
      await dst.call("CLUSTER", "SETSLOT", slot, "IMPORTING", srcId);
      await src.call("CLUSTER", "SETSLOT", slot, "MIGRATING", dstId);
      let moved = 0;
      for (;;) {
        const keys = await src.call("CLUSTER", "GETKEYSINSLOT", slot, "1000") as string[];
        if (keys.length === 0) break;
        // deno-fmt-ignore
        await src.call("MIGRATE", "127.0.0.1", String(ports[to]), "", "0", String(QUERY_TIMEOUT_MS * 5),
          "KEYS", keys[0]);
        moved++;
        await between(moved, keys.length - 1);
      }
      await dst.call("CLUSTER", "SETSLOT", slot, "NODE", dstId);
      await src.call("CLUSTER", "SETSLOT", slot, "NODE", dstId);
      for (let i = 0; i < ports.length; i++) {
        if (i !== from && i !== to && children[i] && !paused.has(i)) {
          await admin(i).call("CLUSTER", "SETSLOT", slot, "NODE", dstId).catch(() => {
            // a replica refuses SETSLOT; the masters' gossip reaches it
          });
        }
      }
      return moved;
    },
    stop,
  };
}
