/**
 * The block index's command-line flags (each also a `PEGAFLOW_*` environment
 * variable), added to the server's commander program by lib/server/config.ts.
 * No `--index-redis` = no index: the node serves from its own tiers only.
 *
 * @module
 */

import { X509Certificate } from "node:crypto";
import { hostname } from "node:os";
import { InvalidArgumentError, type Option } from "commander";
import { boolArg, envOption, intArg } from "../cli/flags.ts";
import { MAX_TIMER_MS } from "../timer_limit.ts";
import { DEFAULT_INDEX_TIMEOUT_MS, DEFAULT_NODE_TTL_MS } from "./block_index.ts";
import {
  checkClusterSeeds,
  checkRedisAuth,
  checkRedisList,
  redisSeeds,
  redisWhere,
} from "./connection.ts";
import { checkNodeToken } from "./keys.ts";
import { splitHostPort } from "../host_port.ts";

/** The index part of the server's configuration. */
export interface IndexConfig {
  /** Redis URL (with `redisCluster`: seed URLs, comma-separated); undefined = no cross-node index. */
  redisUrl: string | undefined;
  /** `redisUrl` names a Redis Cluster's seed nodes. */
  redisCluster: boolean;
  /** This node's id; undefined = `<hostname>:<gRPC port>`, resolved once the port is bound. */
  nodeId: string | undefined;
  /** What peers dial; undefined = the gRPC address (the hostname when it listens on any address). */
  advertiseAddr: string | undefined;
  timeoutMs: number;
  nodeTtlMs: number;
  /** `--index-redis-tls-ca`: PEM CA certificates trusted for `rediss://`; unset = the system's. */
  tlsCa?: string;
}

/** `--index-redis-tls-ca` as parsed: the file and what it held when the flags were read. */
interface TlsCaFile {
  path: string;
  pem: string;
}

const PEM_CERTIFICATE = /-----BEGIN CERTIFICATE-----[\s\S]*?-----END CERTIFICATE-----/g;

/**
 * `--index-redis-tls-ca`: reads the file once, now (a CA rotated later is read at the next
 * start). Throws unless it is a regular file that can be read and holds at least one PEM
 * certificate, each parsing. Empty (an env var set to nothing): no CA, the system's.
 */
function tlsCaArg(path: string): TlsCaFile | undefined {
  if (path.trim() === "") return undefined;
  let pem: string;
  try {
    // A FIFO or a device would block the start, or never end: a CA file is a regular file.
    if (!Deno.statSync(path).isFile) throw new Error("not a regular file");
    pem = Deno.readTextFileSync(path);
  } catch (e) {
    throw new Error(`cannot read CA file "${path}": ${(e as Error).message}`);
  }
  const certs = pem.match(PEM_CERTIFICATE) ?? [];
  if (certs.length === 0) {
    throw new Error(
      `CA file "${path}" holds no PEM certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----)`,
    );
  }
  certs.forEach((cert, i) => {
    try {
      new X509Certificate(cert);
    } catch (e) {
      throw new Error(
        `CA file "${path}": certificate ${i + 1} of ${certs.length} does not parse: ${
          (e as Error).message
        }`,
      );
    }
  });
  return { path, pem };
}

/** Rethrows a validation error as commander's, so the flag is named in front of it. */
function asArg<T>(check: (v: string) => T) {
  return (value: string): T => {
    try {
      return check(value);
    } catch (e) {
      throw new InvalidArgumentError((e as Error).message);
    }
  };
}

/**
 * `--index-redis`: a redis:// URL (or, for `--index-redis-cluster`, several comma-separated),
 * or "" (no index) for empty / `none` (an env var set to nothing).
 */
function redisArg(value: string): string {
  const v = value.trim();
  return v === "" || v.toLowerCase() === "none" ? "" : checkRedisList(v);
}

function hostPort(value: string): string {
  const a = splitHostPort(value);
  if (!a || a.port < 1 || a.port > 65535) {
    throw new Error(`"${value}" is not host:port (e.g. 10.0.0.7:50055)`);
  }
  if (/^(0\.0\.0\.0|\[?::\]?)$/.test(a.host)) {
    throw new Error(`"${value}" is a wildcard address; peers need one they can dial`);
  }
  checkNodeToken("advertise address", value);
  return value;
}

/**
 * The index flags as commander Options.
 *
 * @example
 * ```ts
 * for (const o of indexOptions()) command.addOption(o);
 * ```
 */
export function indexOptions(): Option[] {
  return [
    envOption(
      "--index-redis <url>",
      "Redis of the cross-node block index, e.g. redis://10.0.0.5:6379 (unset, empty or none: no index); " +
        "with --index-redis-cluster, seed nodes: redis://h1:7000,redis://h2:7000",
      "INDEX_REDIS",
    ).argParser(asArg(redisArg)),
    envOption(
      "--index-redis-cluster [bool]",
      "--index-redis is a Redis Cluster (its seed nodes, comma-separated)",
      "INDEX_REDIS_CLUSTER",
    ).default(false).preset(true).argParser(boolArg),
    envOption(
      "--index-redis-tls-ca <path>",
      "PEM file of the CA certificates trusted for a rediss:// --index-redis (default: the system's)",
      "INDEX_REDIS_TLS_CA",
    ).argParser(asArg(tlsCaArg)),
    envOption(
      "--node-id <id>",
      "this node's id in the block index (default: <hostname>:<gRPC port>)",
      "NODE_ID",
    ).argParser(asArg((v) => {
      checkNodeToken("node id", v);
      return v;
    })),
    envOption(
      "--advertise-addr <host:port>",
      "address peers dial to fetch from this node (default: the gRPC address)",
      "ADVERTISE_ADDR",
    ).argParser(asArg(hostPort)),
    envOption(
      "--index-timeout-ms <ms>",
      "deadline of each block index call; past it the node serves locally",
      "INDEX_TIMEOUT_MS",
    ).default(DEFAULT_INDEX_TIMEOUT_MS).argParser(intArg("--index-timeout-ms", 1, MAX_TIMER_MS)),
    envOption(
      "--index-node-ttl-ms <ms>",
      "a node that stops heartbeating leaves the index after this long",
      "INDEX_NODE_TTL_MS",
    ).default(DEFAULT_NODE_TTL_MS).argParser(intArg("--index-node-ttl-ms", 100, MAX_TIMER_MS)),
  ];
}

/**
 * Reads the parsed index options out of commander's `opts()`. Throws commander's
 * `InvalidArgumentError` naming the flags when `--index-redis` and `--index-redis-cluster`
 * disagree (a list without the cluster flag, the flag without a Redis, seeds that differ), when
 * a user name or password does not percent-decode, or when `--index-redis-tls-ca` is given
 * without a rediss:// `--index-redis`.
 */
export function indexConfigFrom(o: Record<string, unknown>): IndexConfig {
  const redisUrl = (o.indexRedis as string | undefined) || undefined; // "": none
  const redisCluster = o.indexRedisCluster === true;
  if (redisCluster && !redisUrl) {
    throw new InvalidArgumentError(
      "--index-redis-cluster needs --index-redis (the cluster's seed nodes, e.g. redis://10.0.0.5:7000,redis://10.0.0.6:7000)",
    );
  }
  if (redisUrl) {
    try {
      checkRedisAuth(redisUrl); // here, not in the parser: commander would echo the password
    } catch (e) {
      throw new InvalidArgumentError(`--index-redis: ${(e as Error).message}`);
    }
  }
  if (redisUrl && !redisCluster && redisSeeds(redisUrl).length > 1) {
    throw new InvalidArgumentError(
      `--index-redis "${redisWhere(redisUrl)}" lists ${
        redisSeeds(redisUrl).length
      } Redis nodes: add --index-redis-cluster for a Redis Cluster, or give one redis:// URL`,
    );
  }
  if (redisUrl && redisCluster) {
    try {
      checkClusterSeeds(redisUrl);
    } catch (e) {
      throw new InvalidArgumentError(
        `--index-redis (--index-redis-cluster): ${(e as Error).message}`,
      );
    }
  }
  const tlsCa = tlsCaFrom(o.indexRedisTlsCa as TlsCaFile | undefined, redisUrl);
  return {
    redisUrl,
    redisCluster,
    ...(tlsCa ? { tlsCa } : {}),
    nodeId: o.nodeId as string | undefined,
    advertiseAddr: o.advertiseAddr as string | undefined,
    timeoutMs: o.indexTimeoutMs as number,
    nodeTtlMs: o.indexNodeTtlMs as number,
  };
}

/** The CA's PEM; throws unless `redisUrl` is a rediss:// one (the seeds share their scheme). */
function tlsCaFrom(ca: TlsCaFile | undefined, redisUrl: string | undefined): string | undefined {
  if (!ca) return undefined;
  if (!redisUrl) {
    throw new InvalidArgumentError(
      `--index-redis-tls-ca "${ca.path}" needs --index-redis with a rediss:// URL (e.g. rediss://10.0.0.5:6380)`,
    );
  }
  if (new URL(redisSeeds(redisUrl)[0]).protocol !== "rediss:") {
    throw new InvalidArgumentError(
      `--index-redis-tls-ca "${ca.path}" is for TLS, but --index-redis "${
        redisWhere(redisUrl)
      }" is not rediss://; use rediss://, or drop the CA`,
    );
  }
  return ca.pem;
}

/**
 * Node id and advertise address, with their defaults filled in from the
 * bound gRPC address (`host:port`, port resolved).
 *
 * @example
 * ```ts
 * nodeIdentity(cfg.index, "0.0.0.0:50055"); // { nodeId: "gpu7:50055", advertiseAddr: "gpu7:50055" }
 * ```
 */
export function nodeIdentity(
  cfg: IndexConfig,
  grpcAddr: string,
  host: string = hostname(),
): { nodeId: string; advertiseAddr: string } {
  const i = grpcAddr.lastIndexOf(":");
  const bindHost = grpcAddr.slice(0, i);
  const port = grpcAddr.slice(i + 1);
  const wildcard = /^(0\.0\.0\.0|\[?::\]?|)$/.test(bindHost);
  return {
    nodeId: cfg.nodeId ?? `${host}:${port}`,
    advertiseAddr: cfg.advertiseAddr ?? (wildcard ? `${host}:${port}` : grpcAddr),
  };
}
