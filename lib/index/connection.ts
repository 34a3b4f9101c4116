/**
 * The block index's Redis connection: which URLs are accepted, how the client behaves when Redis
 * is away (no offline queue, no retries per request, a short reconnect back-off: the caller
 * serves locally instead of waiting), the index scripts as commands, and the deadline every call
 * runs under. lib/index/block_index.ts makes the calls.
 *
 * @module
 */

import { Redis } from "ioredis";
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
  exec(): Promise<[Error | null, unknown][] | null>;
}

/** A pipeline on `redis`: its commands go out in one write, and their answers come in one. */
export function indexPipeline(redis: Redis): IndexPipeline {
  return redis.pipeline() as unknown as IndexPipeline;
}

/** Where the URL points, without credentials (for log lines). */
export function redisWhere(url: string): string {
  const u = new URL(url);
  return `${u.protocol}//${u.host}${u.pathname.length > 1 ? u.pathname : ""}`;
}

/** A Redis client with the index scripts defined on it. */
export type IndexRedis = Redis & IndexCommands;

/** A client for the index at `url` whose commands give up after `timeoutMs`; not yet connected. */
export function indexRedisClient(url: string, timeoutMs: number): IndexRedis {
  const redis = new Redis(url, {
    lazyConnect: true,
    // Fail fast instead of queueing while disconnected: the caller serves locally.
    enableOfflineQueue: false,
    maxRetriesPerRequest: 0,
    autoResendUnfulfilledCommands: false,
    commandTimeout: timeoutMs,
    connectTimeout: Math.max(timeoutMs, 1_000),
    retryStrategy: (times: number) => Math.min(times * RECONNECT_STEP_MS, RECONNECT_MAX_MS),
  }) as IndexRedis;
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
function evalAlways(redis: Redis, lua: string) {
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
