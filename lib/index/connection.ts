/**
 * The block index's Redis connection: which URLs are accepted, how the client behaves when Redis
 * is away (no offline queue, no retries per request, a short reconnect back-off: the caller
 * serves locally instead of waiting), the index scripts as commands, and the deadline every call
 * runs under. lib/index/block_index.ts makes the calls.
 *
 * One Redis (`redis://host:port`), or a Redis Cluster (`--index-redis-cluster`) reached through
 * seed nodes listed comma-separated (`redis://h1:7000,redis://h2:7001`): ioredis's `Cluster`
 * with the same fail-fast options, and no retry of its own after a closed connection or a
 * CLUSTERDOWN (the caller's deadline and re-join handle both; a retried advertise could land
 * after a later withdraw). Pipelines spanning namespaces are split per slot (lib/index/batch.ts).
 *
 * @module
 */

import { Cluster, type Command, Redis } from "ioredis";
import type { Buffer } from "node:buffer";
import { IndexInputError } from "./errors.ts";
import { ADVERTISE_LUA, HEARTBEAT_LUA, LOOKUP_LUA, WITHDRAW_LUA } from "./scripts.ts";

/** Reconnect back-off: 100 ms steps, capped at 1 s, so a restarted Redis is found fast. */
const RECONNECT_STEP_MS = 100;
const RECONNECT_MAX_MS = 1_000;

/** The scripts as ioredis custom commands (numkeys first, then keys, then args). */
export interface IndexCommands {
  /** 1, or 0 / another live process's address when this node's registration is not its own. */
  pfAdvertise(...args: (string | number | Buffer)[]): Promise<number | string>;
  pfWithdraw(...args: (string | number | Buffer)[]): Promise<number>;
  /** 1, or 0 / another live process's address when this node's registration is not its own. */
  pfHeartbeat(...args: (string | number | Buffer)[]): Promise<number | string>;
  pfLookup(...args: (string | number | Buffer)[]): Promise<(string | number)[]>;
}

/** What the index sends in a pipeline (ioredis's typings take no spread of script arguments). */
export interface IndexPipeline {
  eval(lua: string, ...args: (string | number | Buffer)[]): unknown;
  pexpire(key: string, ms: number): unknown;
  pttl(key: string): unknown;
  exec(): Promise<[Error | null, unknown][] | null>;
}

/** A pipeline on `redis`: its commands go out in one write, and their answers come in one. */
export function indexPipeline(redis: Redis | Cluster): IndexPipeline {
  return redis.pipeline() as unknown as IndexPipeline;
}

/** Where the URL (or each seed of a comma-separated list) points, without credentials (for log lines). */
export function redisWhere(url: string): string {
  return redisSeeds(url).map((seed) => {
    const u = new URL(seed);
    return `${u.protocol}//${u.host}${u.pathname.length > 1 ? u.pathname : ""}`;
  }).join(",");
}

/** A Redis client (one server or a cluster) with the index scripts defined on it. */
export type IndexRedis = (Redis | Cluster) & IndexCommands;

/** Reconnects 100 ms, 200 ms, ... apart, at most 1 s. */
const reconnectDelay = (times: number) => Math.min(times * RECONNECT_STEP_MS, RECONNECT_MAX_MS);

/** Where the index's Redis is and how to reach it (part of the index's options). */
export interface IndexRedisTarget {
  /** `redis://[user:pass@]host:port[/db]` (or `rediss://`); with `cluster`, seeds comma-separated. */
  url: string;
  /** `url` lists a Redis Cluster's seed nodes ({@link checkClusterSeeds}). Default false. */
  cluster?: boolean;
  /**
   * PEM CA certificates trusted for a `rediss://` URL instead of the system's trust store
   * (`--index-redis-tls-ca`, read at flag time by lib/index/flags.ts). Unset: the system's.
   */
  tlsCa?: string;
}

/**
 * A client for the index at `url` whose commands give up after `timeoutMs`; not yet connected.
 * `cluster`: `url` lists a Redis Cluster's seed nodes ({@link checkClusterSeeds}). `tlsCa`: see
 * {@link IndexRedisTarget}; a certificate it does not trust fails like an unreachable Redis, the
 * TLS reason in the error.
 */
export function indexRedisClient(
  url: string,
  timeoutMs: number,
  cluster = false,
  tlsCa?: string,
): IndexRedis {
  const perConnection = {
    // Fail fast instead of queueing or resending: the caller serves locally.
    maxRetriesPerRequest: 0,
    autoResendUnfulfilledCommands: false,
    commandTimeout: timeoutMs,
    connectTimeout: Math.max(timeoutMs, 1_000),
    // rediss:// only (a CA for redis:// is refused at flag time).
    ...(new URL(redisSeeds(url)[0]).protocol === "rediss:"
      ? { tls: tlsCa ? { ca: tlsCa } : {} }
      : {}),
  };
  const redis = (cluster ? indexCluster(url, perConnection) : new Redis(url, {
    ...perConnection,
    lazyConnect: true,
    enableOfflineQueue: false,
    retryStrategy: reconnectDelay,
  })) as IndexRedis;
  // The scripts that change the index go as EVAL, never EVALSHA (see `evalAlways`).
  redis.pfAdvertise = evalAlways(redis, ADVERTISE_LUA) as IndexCommands["pfAdvertise"];
  redis.pfWithdraw = evalAlways(redis, WITHDRAW_LUA) as IndexCommands["pfWithdraw"];
  redis.pfHeartbeat = evalAlways(redis, HEARTBEAT_LUA) as IndexCommands["pfHeartbeat"];
  // A lookup changes nothing: a NOSCRIPT retry costs it one round trip, never a wrong order.
  redis.defineCommand("pfLookup", { lua: LOOKUP_LUA });
  return redis;
}

/**
 * A script sent as EVAL (its text, ~1 KB, on every call; Redis hashes it and reuses the
 * compiled script). ioredis's script commands go as EVALSHA and, on NOSCRIPT (Redis lost its
 * script cache with the connection up: SCRIPT FLUSH, a failover to a replica that never ran
 * them), re-send the call when that reply arrives: behind calls sent after it, which may have
 * run already. A withdraw could so run before the advertise of the same block, which then
 * stayed listed for the node's life. EVAL cannot fail that way, so Redis applies one node's
 * advertises and withdraws in the order they were sent on its one connection.
 */
function evalAlways(redis: Redis | Cluster, lua: string) {
  return (numKeys: number, ...args: (string | number | Buffer)[]) =>
    redis.eval(lua, numKeys, ...args);
}

/**
 * Returns `url` if it is a usable Redis URL, else throws
 * {@link IndexInputError} saying what is wrong (the CLI prefixes the flag).
 *
 * @example
 * ```ts
 * checkRedisUrl("redis://10.0.0.5:6379"); // ok
 * checkRedisUrl("10.0.0.5:6379");         // throws: not a redis:// URL
 * ```
 */
export function checkRedisUrl(url: string): string {
  let u: URL;
  try {
    u = new URL(url);
  } catch (_e) {
    throw new IndexInputError(
      `"${url}" is not a redis:// URL (e.g. redis://127.0.0.1:6379)`,
      { got: url },
    );
  }
  if (u.protocol !== "redis:" && u.protocol !== "rediss:") {
    throw new IndexInputError(
      `"${url}" has scheme "${u.protocol}"; expected redis:// or rediss://`,
      { got: url },
    );
  }
  if (u.hostname === "") {
    throw new IndexInputError(`"${url}" names no host (e.g. redis://127.0.0.1:6379)`, { got: url });
  }
  if (u.pathname.length > 1 && !/^\/\d+$/.test(u.pathname)) {
    throw new IndexInputError(`"${url}": the path must be a database number, e.g. /0`, {
      got: url,
    });
  }
  return url;
}

/**
 * The ioredis `Cluster` for `url`'s seeds. Credentials and TLS go to every node's connection
 * (the nodes the cluster reports too, not only the seeds). A command whose connection closed or
 * that met CLUSTERDOWN fails at once instead of being retried later (ioredis would resend it
 * after 100 ms, possibly behind a withdraw sent since); MOVED and ASK are still followed (the
 * command did not run). A cluster that drops every connection is reconnected like one Redis.
 * Nothing waits for the cluster (its offline queue is never used: {@link IndexCluster}), but a
 * command may wait for its master's connection while it opens (it fails at the deadline).
 */
function indexCluster(url: string, perConnection: { tls?: object }): Cluster {
  const seeds = checkClusterSeeds(url).map((s) => new URL(s));
  const first = seeds[0];
  const auth = first.username || first.password
    ? {
      username: decodeURIComponent(first.username) || undefined,
      password: decodeURIComponent(first.password),
    }
    : {};
  return new IndexCluster(
    seeds.map((u) => ({
      host: u.hostname.replace(/^\[|\]$/g, ""),
      port: Number(u.port || DEFAULT_REDIS_PORT),
    })),
    {
      lazyConnect: true,
      clusterRetryStrategy: reconnectDelay,
      retryDelayOnFailover: 0,
      retryDelayOnClusterDown: 0,
      // TLS (`perConnection.tls`) goes to every node's connection. A seed's host name is kept,
      // not resolved to an address first: its certificate names the host, seldom the address.
      ...(perConnection.tls ? { dnsLookup: keepHostName } : {}),
      redisOptions: { ...perConnection, ...auth },
    },
  );
}

const DEFAULT_REDIS_PORT = 6379;

/** ioredis's `dnsLookup` that resolves nothing: TLS checks the certificate against the name. */
function keepHostName(host: string, done: (err: Error | null, address: string) => void): void {
  done(null, host);
}

/**
 * A `Cluster` that refuses a command at once while it is not ready (connecting, reconnecting
 * after every node dropped), as `enableOfflineQueue: false` does, without that option's other
 * effect: refusing a command whose master's connection is still opening (with it, the second
 * command of a burst to a master just met — at start, after a restart or a MOVED — failed with
 * "Connection is closed." and took the index down). The node connections queue while they open,
 * in order, each command under `commandTimeout`.
 */
class IndexCluster extends Cluster {
  /** Why the last attempt to reach the cluster failed (a node's TLS or connection error). */
  #why = "";
  /** Why a connection that reads the slots failed, since the last refresh or failure. */
  #connectWhy = "";

  constructor(...args: ConstructorParameters<typeof Cluster>) {
    super(...args);
    // ioredis reads CLUSTER SLOTS on a copy of a node's connection that ignores its own errors:
    // a refused TLS certificate reaches the refresh only as "Connection is closed.". Keep it.
    this.on("+node", (node: Redis) => {
      const duplicate = node.duplicate.bind(node);
      node.duplicate = (override) =>
        duplicate(override).on("error", (e: Error) => this.#connectWhy = e.message);
    });
    // "Failed to refresh slots cache." says nothing of why: add the last node's error (its
    // connection's, when that failed), before the index's listener logs it.
    this.prependListener("error", (e: Error & { lastNodeError?: Error }) => {
      const node = this.#connectWhy || e.lastNodeError?.message;
      this.#connectWhy = "";
      if (node) e.message = `${e.message} (${node})`;
      this.#why = node ?? e.message;
    });
    this.on("refresh", () => this.#connectWhy = ""); // slots read: a node's old failure is moot
    this.on("ready", () => this.#why = "");
  }

  override sendCommand(command: Command, stream?: unknown, node?: unknown): unknown {
    // CLUSTER INFO is the ready check itself, sent before the cluster is ready.
    if (this.status !== "ready" && command.name !== "cluster") {
      const why = this.#why ? `: ${this.#why}` : "";
      command.reject(new Error(`Cluster isn't ready (the index does not queue commands)${why}`));
      return command.promise;
    }
    return super.sendCommand(command, stream as never, node);
  }
}

/**
 * The entries of `--index-redis`: its comma-separated redis:// URLs (a cluster's seed nodes; one
 * for a single Redis). A `,` splits only where a URL follows (a password may hold one); an entry
 * that is no URL is split off too, so that it is named as wrong.
 */
export function redisSeeds(url: string): string[] {
  return url.split(/,(?=\s*rediss?:\/\/|[^@]*$)/i).map((s) => s.trim());
}

/**
 * Returns `url` if it is one usable Redis URL ({@link checkRedisUrl}) or a comma-separated list
 * of them (a cluster's seeds, checked together by {@link checkClusterSeeds} once `--index-redis-cluster`
 * is known), else throws {@link IndexInputError} naming the entry that is wrong.
 */
export function checkRedisList(url: string): string {
  const seeds = redisSeeds(url);
  if (seeds.length === 1) return checkRedisUrl(url);
  for (const seed of seeds) {
    if (seed === "") {
      throw new IndexInputError(
        `"${url}" has an empty entry; list seeds as redis://h1:7000,redis://h2:7001`,
        { got: url },
      );
    }
    checkRedisUrl(seed);
  }
  return url;
}

/**
 * Throws {@link IndexInputError} unless the user name and password of `url` (of each seed of a
 * list) decode: ioredis percent-decodes them when it opens the client, and a `%` not followed by
 * two hex digits would throw `URIError: URI malformed` there, after the server started. The
 * message leaves the credentials out.
 *
 * @example
 * ```ts
 * checkRedisAuth("redis://:p%40ss@h:6379"); // ok: the password is p@ss
 * checkRedisAuth("redis://:%zz@h:6379");    // throws: write a literal % as %25
 * ```
 */
export function checkRedisAuth(url: string): void {
  for (const seed of redisSeeds(url)) {
    const u = new URL(seed);
    try {
      decodeURIComponent(u.username);
      decodeURIComponent(u.password);
    } catch (_e) {
      const where = redisWhere(seed);
      throw new IndexInputError(
        `${where}: the user name or password is not percent-encoded (a % must start %XX; write a literal % as %25)`,
        { got: where },
      );
    }
  }
}

/**
 * Checks `url` as one Redis's URL, or with `cluster` as a cluster's seeds; returns where it
 * points (credentials left out) for log lines. Throws {@link IndexInputError}.
 */
export function checkRedisTarget(url: string, cluster: boolean): string {
  checkRedisList(url);
  checkRedisAuth(url);
  if (cluster) {
    checkClusterSeeds(url);
  } else if (redisSeeds(url).length > 1) {
    throw new IndexInputError(
      `"${redisWhere(url)}" lists ${
        redisSeeds(url).length
      } Redis nodes; a list is a Redis Cluster's seeds (cluster mode)`,
      { got: redisWhere(url) },
    );
  }
  return redisWhere(url);
}

/**
 * Returns the seed URLs of a Redis Cluster listed in `url` (comma-separated, each a
 * {@link checkRedisUrl} URL), else throws {@link IndexInputError} saying which seed is wrong:
 * the seeds must share the scheme and the credentials (every node gets the same), and name no
 * database but 0 (a cluster has only database 0) and no `?options`.
 *
 * @example
 * ```ts
 * checkClusterSeeds("redis://10.0.0.5:7000,redis://10.0.0.6:7000"); // two seeds
 * checkClusterSeeds("redis://10.0.0.5:7000/2");                      // throws: database 2
 * ```
 */
export function checkClusterSeeds(url: string): string[] {
  checkRedisList(url);
  const seeds = redisSeeds(url);
  const first = new URL(seeds[0]);
  for (const seed of seeds) {
    const u = new URL(seed);
    const where = redisWhere(seed);
    if (u.pathname.length > 1 && u.pathname !== "/0") {
      throw new IndexInputError(
        `seed ${where} names database ${u.pathname.slice(1)}; a Redis Cluster has only database 0`,
        { got: where },
      );
    }
    if (u.search !== "") {
      throw new IndexInputError(
        `seed ${where} has options (${u.search}); a cluster seed takes none`,
        {
          got: where,
        },
      );
    }
    if (
      u.protocol !== first.protocol || u.username !== first.username ||
      u.password !== first.password
    ) {
      throw new IndexInputError(
        `seed ${where} differs from ${
          redisWhere(seeds[0])
        } in scheme or credentials; every seed must use the same`,
        { got: where },
      );
    }
  }
  return seeds;
}
