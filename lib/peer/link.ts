/**
 * The requester's side of the calls a peer fetch makes on an owner, every
 * one with a deadline: the transfer handshake over gRPC (`ConnectTransfer`,
 * once per owner), then the lock and its release over the owner's peer RPC
 * socket (frames over TCP, lib/local_rpc/wire.ts) when the handshake named
 * one, else over gRPC (an owner that predates it). One client per owner
 * address, kept and re-dialled by itself.
 *
 * Why not gRPC for the lock: it is on every fetch's way to its first byte,
 * and grpc-js cost ~3 ms of transit there (HTTP/2 framing, its call stack,
 * both ways) on a ~2 ms handler; a frame on a plain socket costs a fraction
 * of a millisecond (docs/peer.md).
 *
 * @module
 */

import * as grpc from "@grpc/grpc-js";
import {
  type ConnectTransferRequest,
  type ConnectTransferResponse,
  PeerClient,
  QueryBlocksForTransferRequest,
  QueryBlocksForTransferResponse,
  ReleaseTransferLockRequest,
  ReleaseTransferLockResponse,
} from "../../proto/pegaflow.ts";
import { LocalRpcClient, LocalRpcStatus } from "../client/local_rpc.ts";
import { methodIds, PEER_RPC_METHODS } from "../local_rpc/wire.ts";
import type { Logger } from "../log.ts";
import { splitHostPort } from "../host_port.ts";

/** Largest lock answer accepted: the owner's default --max-message-size. */
const MAX_LOCK_ANSWER_BYTES = 64 << 20;
const PEER_RPC_IDS = methodIds(PEER_RPC_METHODS);
/** Owners warned about (no peer RPC socket) at most: the log line is once per owner, bounded. */
const MAX_WARNED_OWNERS = 1024;

/** A framed call that did not answer OK, worded like a grpc-js error ("4 DEADLINE_EXCEEDED: ..."). */
export class PeerRpcError extends Error {
  constructor(readonly code: number, readonly details: string, addr: string) {
    super(`${code} ${grpc.status[code] ?? "UNKNOWN"}: ${details} (peer RPC ${addr})`);
    this.name = "PeerRpcError";
  }

  /** The socket could not be reached or broke (UNAVAILABLE): not an answer from the owner. */
  get socketGone(): boolean {
    return this.code === grpc.status.UNAVAILABLE;
  }
}

/**
 * The lock or release call ended with no answer from the owner — its
 * deadline passed, or its connection broke — on either transport (a
 * {@link PeerRpcError} or a grpc-js error): the owner may still run it.
 */
export function unanswered(e: unknown): boolean {
  const code = (e as { code?: unknown } | undefined)?.code;
  return code === grpc.status.DEADLINE_EXCEEDED || code === grpc.status.UNAVAILABLE;
}

/**
 * How grpc-js words an answer whose bytes its deserializer refused (INTERNAL,
 * client side); the framed lock call words its own the same way.
 */
const UNDECODABLE_ANSWER = "Response message parsing error";

/**
 * The owner answered OK, but its answer could not be decoded, on either
 * transport: the owner ran the call (a lock may be granted) and this node
 * cannot know what it answered.
 */
export function undecodable(e: unknown): boolean {
  const x = e as { code?: unknown; details?: unknown } | undefined;
  return x?.code === grpc.status.INTERNAL && typeof x.details === "string" &&
    x.details.startsWith(UNDECODABLE_ANSWER);
}

/**
 * `host:port` of a peer RPC socket as a dial target; a string says what is
 * wrong with it (it comes from another node).
 */
export function parseRpcAddr(addr: string): { hostname: string; port: number } | string {
  const a = splitHostPort(addr);
  if (!a || a.port < 1 || a.port > 65535) return `peer RPC address "${addr}" is not host:port`;
  const { host, port } = a;
  return { hostname: host.startsWith("[") && host.endsWith("]") ? host.slice(1, -1) : host, port };
}

/** Lock and release calls made on owners, by the way they went. */
export interface PeerLinkStats {
  calls: { rpc: number; grpc: number };
}

/**
 * Clients of other nodes' `Peer` service: gRPC by owner address, frames by
 * RPC address. An owner without a peer RPC socket is logged once (its locks
 * take the slower way) and counted (`pegaflow_peer_lock_calls_total{via}`).
 */
export class PeerLinks {
  readonly #clients = new Map<string, PeerClient>();
  readonly #framed = new Map<string, LocalRpcClient>();
  readonly #log: Logger | undefined;
  readonly #calls = { rpc: 0, grpc: 0 };
  readonly #slowOwners = new Set<string>();

  constructor(log?: Logger) {
    this.#log = log;
  }

  stats(): PeerLinkStats {
    return { calls: { ...this.#calls } };
  }

  /** Counts a lock or release call, and warns once per owner that has no peer RPC socket. */
  #via(addr: string, rpcAddr: string): void {
    if (rpcAddr) {
      this.#calls.rpc++;
      return;
    }
    this.#calls.grpc++;
    if (this.#slowOwners.has(addr) || this.#slowOwners.size >= MAX_WARNED_OWNERS) return;
    this.#slowOwners.add(addr);
    this.#log?.warn("owner has no peer RPC socket (an older version): its locks go over gRPC", {
      owner: addr,
    });
  }

  #client(addr: string): PeerClient {
    let c = this.#clients.get(addr);
    if (!c) {
      c = new PeerClient(addr, grpc.credentials.createInsecure(), {
        // A dead owner must fail the call fast, not wait for the default backoff.
        "grpc.initial_reconnect_backoff_ms": 100,
        "grpc.max_reconnect_backoff_ms": 1_000,
        // A lock answer lists every locked block's pool ranges (peer_tier.ts bounds it).
        "grpc.max_receive_message_length": MAX_LOCK_ANSWER_BYTES,
      });
      this.#clients.set(addr, c);
    }
    return c;
  }

  /** One framed call on the owner's peer RPC socket at `rpcAddr`. */
  async #frame(rpcAddr: string, method: string, body: Uint8Array, timeoutMs: number) {
    let c = this.#framed.get(rpcAddr);
    if (!c) {
      const t = parseRpcAddr(rpcAddr);
      if (typeof t === "string") throw new PeerRpcError(grpc.status.INVALID_ARGUMENT, t, rpcAddr);
      c = new LocalRpcClient({ transport: "tcp", ...t }, MAX_LOCK_ANSWER_BYTES, PEER_RPC_IDS);
      this.#framed.set(rpcAddr, c);
    }
    try {
      return await c.call(method, body, timeoutMs);
    } catch (e) {
      if (!(e instanceof LocalRpcStatus)) throw e;
      const err = new PeerRpcError(e.code, e.details, rpcAddr);
      if (err.socketGone && this.#framed.get(rpcAddr) === c) {
        // Its owner moved or died: the handshake names the next address; nothing is kept.
        this.#framed.delete(rpcAddr);
        c.close();
      }
      throw err;
    }
  }

  /**
   * `QueryBlocksForTransfer` on the owner: over its peer RPC socket when
   * `rpcAddr` is set, else over gRPC at `addr`. Rejects with the status
   * (an answer it cannot decode: INTERNAL, {@link undecodable}).
   */
  async lock(
    addr: string,
    req: QueryBlocksForTransferRequest,
    timeoutMs: number,
    rpcAddr = "",
  ): Promise<QueryBlocksForTransferResponse> {
    this.#via(addr, rpcAddr);
    if (rpcAddr) {
      const body = QueryBlocksForTransferRequest.encode(req).finish();
      const answer = await this.#frame(rpcAddr, "queryBlocksForTransfer", body, timeoutMs);
      try {
        return QueryBlocksForTransferResponse.decode(answer);
      } catch (e) {
        // As grpc-js reports it (INTERNAL): the caller can tell it from a refusal.
        const why = `${UNDECODABLE_ANSWER}: ${(e as Error).message}`;
        throw new PeerRpcError(grpc.status.INTERNAL, why, rpcAddr);
      }
    }
    return await new Promise((resolve, reject) => {
      this.#client(addr).queryBlocksForTransfer(
        req,
        new grpc.Metadata(),
        { deadline: Date.now() + timeoutMs },
        (err, res) => err ? reject(err) : resolve(res),
      );
    });
  }

  /**
   * `ReleaseTransferLock` on the owner (transports as {@link lock}), naming
   * the lock's blocks that landed damaged here (`failedBlocks`, indices into
   * its prefix; the owner checks and drops them: damage_report.ts).
   */
  async release(
    addr: string,
    req: ReleaseTransferLockRequest,
    timeoutMs: number,
    rpcAddr = "",
  ): Promise<ReleaseTransferLockResponse> {
    this.#via(addr, rpcAddr);
    if (rpcAddr) {
      const body = ReleaseTransferLockRequest.encode(req).finish();
      return ReleaseTransferLockResponse.decode(
        await this.#frame(rpcAddr, "releaseTransferLock", body, timeoutMs),
      );
    }
    return await new Promise((resolve, reject) => {
      this.#client(addr).releaseTransferLock(
        req,
        new grpc.Metadata(),
        { deadline: Date.now() + timeoutMs },
        (err, res) => err ? reject(err) : resolve(res),
      );
    });
  }

  /** `ConnectTransfer` (the transfer handshake) on the node at `addr`. Rejects with the gRPC error. */
  connect(
    addr: string,
    req: ConnectTransferRequest,
    timeoutMs: number,
  ): Promise<ConnectTransferResponse> {
    return new Promise((resolve, reject) => {
      this.#client(addr).connectTransfer(
        req,
        new grpc.Metadata(),
        { deadline: Date.now() + timeoutMs },
        (err, res) => err ? reject(err) : resolve(res),
      );
    });
  }

  close(): void {
    for (const c of this.#clients.values()) c.close();
    this.#clients.clear();
    for (const c of this.#framed.values()) c.close();
    this.#framed.clear();
  }
}
