/**
 * The peer tier's command-line flags (each also a `PEGAFLOW_*` environment
 * variable), added to the server's program by lib/server/config.ts. The peer
 * tier runs where the block index does (`--index-redis`); `--peer-fetch
 * false` keeps the index and serving peers but never fetches.
 *
 * @module
 */

import { InvalidArgumentError, type Option } from "commander";
import { boolArg, envOption, intArg } from "../cli/flags.ts";
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

/** Most RDMA devices one endpoint opens (`RDMA_MAX_NICS` in csrc/pf_rdma.c). */
const MAX_NICS = 16;
/** Longest `--nics` list the transfer layer takes (ffi/xfer.ts: 255 bytes, comma-joined). */
const MAX_NICS_BYTES = 255;
/** One `--nics` entry as csrc/pf_rdma.c reads it: a device name (under 64 bytes) and a port 1..255. */
const NIC_ENTRY = /^([A-Za-z0-9_.-]{1,63})(?::(\d+))?$/;

/**
 * Parses `--nics`: `name[:port],...` (empty = every device). The library
 * checks the same at open, after the pool exists and without the flag's name.
 */
function nicsArg(value: string): string[] {
  if (value.trim() === "") return [];
  const nics = value.split(",").map((s) => s.trim());
  for (const nic of nics) {
    const m = NIC_ENTRY.exec(nic);
    if (!m || (m[2] !== undefined && (Number(m[2]) < 1 || Number(m[2]) > 255))) {
      throw new InvalidArgumentError(
        `--nics entry "${nic}" of "${value}" is not name[:port] (a device name of ` +
          `[A-Za-z0-9_.-], under 64 characters; port 1..255)`,
      );
    }
  }
  const bytes = nics.join(",").length;
  if (nics.length > MAX_NICS || bytes > MAX_NICS_BYTES) {
    throw new InvalidArgumentError(
      `--nics "${value}" names ${nics.length} devices in ${bytes} bytes; ` +
        `at most ${MAX_NICS} devices in ${MAX_NICS_BYTES} bytes`,
    );
  }
  return nics;
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
      .argParser(nicsArg),
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
