/**
 * The peer tier's command-line flags (each also a `PEGAFLOW_*` environment
 * variable), added to the server's program by lib/server/config.ts. The peer
 * tier runs where the block index does (`--index-redis`); `--peer-fetch
 * false` keeps the index and serving peers but never fetches.
 *
 * @module
 */

import { InvalidArgumentError, type Option } from "commander";
import { boolArg, envOption } from "../cli/flags.ts";
import type { TransportChoice } from "../transfer/transport.ts";
import { DEFAULT_TCP_STREAMS } from "../transfer/transport.ts";
import { DEFAULT_PEER_LOCK_TTL_MS, MAX_PEER_LOCK_TTL_MS } from "./locks.ts";
import { DEFAULT_PEER_FETCH_TIMEOUT_MS } from "./peer_tier.ts";

/** The peer part of the server's configuration. */
export interface PeerConfig {
  /** Fetch blocks other nodes hold on a local miss (needs the index). */
  fetch: boolean;
  transport: TransportChoice;
  /** Transfer listener port (0 = any free port). */
  xferPort: number;
  /** Peer RPC listener port (lock and release in frames over TCP; 0 = any free port). */
  rpcPort: number;
  /** TCP sockets (or RDMA QPs per NIC) per peer. */
  xferStreams: number;
  /** RDMA devices; empty = every device. */
  nics: string[];
  /** Deadline of a fetch's READ batch. */
  fetchTimeoutMs: number;
  /** TTL of locks this node grants when the requester asks for none. */
  lockTtlMs: number;
}

function intArg(flag: string, min: number, max: number) {
  return (value: string): number => {
    const n = Number(value.trim());
    if (!/^\d+$/.test(value.trim()) || n < min || n > max) {
      throw new InvalidArgumentError(
        `${flag} must be an integer in ${min}..${max}, got "${value}"`,
      );
    }
    return n;
  };
}

/**
 * The peer flags as commander Options.
 *
 * @example
 * ```ts
 * for (const o of peerOptions()) command.addOption(o);
 * ```
 */
export function peerOptions(): Option[] {
  return [
    envOption(
      "--peer-fetch [bool]",
      "on a local miss, fetch blocks other nodes hold (needs --index-redis)",
      "PEER_FETCH",
    ).default(true).preset(true).argParser(boolArg),
    envOption(
      "--transport <kind>",
      "cross-node transport: auto (RDMA, else TCP), tcp, rdma",
      "TRANSPORT",
    )
      .default("auto").choices(["auto", "tcp", "rdma"]),
    envOption("--xfer-port <port>", "cross-node transfer listener port (0: any free)", "XFER_PORT")
      .default(0).argParser(intArg("--xfer-port", 0, 65535)),
    envOption(
      "--peer-rpc-port <port>",
      "peer RPC listener port: transfer locks in frames over TCP (0: any free)",
      "PEER_RPC_PORT",
    ).default(0).argParser(intArg("--peer-rpc-port", 0, 65535)),
    envOption("--xfer-streams <n>", "TCP sockets (RDMA QPs per NIC) per peer", "XFER_STREAMS")
      .default(DEFAULT_TCP_STREAMS).argParser(intArg("--xfer-streams", 1, 64)),
    envOption("--nics <list>", "RDMA devices, name[:port] comma-separated (default: all)", "NICS")
      .argParser((v: string) => v.split(",").map((s) => s.trim())),
    envOption(
      "--peer-fetch-timeout-ms <ms>",
      "deadline of one peer fetch's read",
      "PEER_FETCH_TIMEOUT_MS",
    ).default(DEFAULT_PEER_FETCH_TIMEOUT_MS).argParser(
      intArg("--peer-fetch-timeout-ms", 1, 3_600_000),
    ),
    envOption(
      "--peer-lock-ttl-ms <ms>",
      "TTL of transfer locks granted to peers that ask for none (a vanished requester's expire)",
      "PEER_LOCK_TTL_MS",
    ).default(DEFAULT_PEER_LOCK_TTL_MS).argParser(
      intArg("--peer-lock-ttl-ms", 1, MAX_PEER_LOCK_TTL_MS),
    ),
  ];
}

/** Reads the parsed peer options out of commander's `opts()`. */
export function peerConfigFrom(o: Record<string, unknown>): PeerConfig {
  return {
    fetch: o.peerFetch as boolean,
    transport: o.transport as TransportChoice,
    xferPort: o.xferPort as number,
    rpcPort: o.peerRpcPort as number,
    xferStreams: o.xferStreams as number,
    nics: (o.nics as string[] | undefined) ?? [],
    fetchTimeoutMs: o.peerFetchTimeoutMs as number,
    lockTtlMs: o.peerLockTtlMs as number,
  };
}
