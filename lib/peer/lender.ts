/**
 * The owner's side of the transfer handshake (`Peer.ConnectTransfer`): what
 * a requester needs before its first READ from this node.
 *
 * RDMA: RC QPs are point to point, so this node creates a transfer peer for
 * each requester node, connects it with the requester's info (QPNs, PSNs,
 * GIDs, rkeys) and answers its own; the requester then connects its side
 * with that answer. A new handshake from the same node replaces (and closes)
 * the old peer: the requester reconnects after its side broke; past
 * {@link MAX_LENT_PEERS} requesters the oldest handshake's peer is closed (a
 * requester that died never says so). TCP: no state
 * here; the answer is this node's listener, host:port, which the requester
 * dials. Either way the answer also names this node's peer RPC socket, where
 * the requester then asks for its transfer locks.
 *
 * @module
 */

import type { Logger } from "../log.ts";

/** The slice of a transfer peer the lender uses (ffi/xfer.ts `XferPeer`). */
export interface LenderPeer {
  info(): Uint8Array;
  connect(remote: Uint8Array, timeoutMs: number): Promise<void>;
  close(): Promise<void>;
}

/** What the lender needs of this node's transfer endpoint. */
export interface LenderEndpoint {
  /** "tcp" | "rdma". */
  transport: string;
  /** TCP: host:port a requester dials (the advertised host, the listener's port). */
  addr(): string;
  /** host:port of this node's peer RPC socket as requesters dial it ("" when there is none). */
  rpcAddr(): string;
  createPeer(): LenderPeer;
}

/** A refusal the service maps to a gRPC status. */
export class HandshakeRefused extends Error {
  constructor(
    readonly code: "INVALID_ARGUMENT" | "FAILED_PRECONDITION",
    message: string,
  ) {
    super(message);
  }
}

/** Largest peer info accepted (RDMA: a few dozen bytes per QP; 8 NICs × 16 QPs fit). */
export const MAX_PEER_INFO_BYTES = 16 << 10;
/** Requester nodes this node keeps a connected RDMA peer for at once (past it, the oldest handshake's goes). */
export const MAX_LENT_PEERS = 1024;

/**
 * Transfer peers this node keeps for requesters.
 *
 * @example
 * ```ts
 * const lender = new TransferLender(endpoint, 5_000, log);
 * const { transport, peerInfo } = await lender.connect("node-b", "rdma", bytes);
 * await lender.close();
 * ```
 */
export class TransferLender {
  readonly #ep: LenderEndpoint;
  readonly #connectTimeoutMs: number;
  readonly #log: Logger;
  readonly #peers = new Map<string, LenderPeer>();
  #closed = false;

  constructor(ep: LenderEndpoint, connectTimeoutMs: number, log: Logger) {
    this.#ep = ep;
    this.#connectTimeoutMs = connectTimeoutMs;
    this.#log = log;
  }

  /** Connected peers kept for requesters. */
  get size(): number {
    return this.#peers.size;
  }

  /** One handshake: this node's side for `requester`, connected, and the bytes to answer. */
  async connect(
    requester: string,
    transport: string,
    peerInfo: Uint8Array,
  ): Promise<{ transport: string; peerInfo: Uint8Array; rpcAddr: string }> {
    const who = `ConnectTransfer from "${requester}"`;
    if (!requester) {
      throw new HandshakeRefused("INVALID_ARGUMENT", "ConnectTransferRequest.requester is empty");
    }
    if (transport !== this.#ep.transport) {
      throw new HandshakeRefused(
        "FAILED_PRECONDITION",
        `${who}: the requester uses ${transport || "(none)"}, this node ${this.#ep.transport}; ` +
          `every node must run the same --transport`,
      );
    }
    if (peerInfo.length > MAX_PEER_INFO_BYTES) {
      throw new HandshakeRefused(
        "INVALID_ARGUMENT",
        `${who}: ConnectTransferRequest.peer_info is ${peerInfo.length} bytes, at most ${MAX_PEER_INFO_BYTES}`,
      );
    }
    if (this.#ep.transport === "tcp") {
      return {
        transport: "tcp",
        peerInfo: new TextEncoder().encode(this.#ep.addr()),
        rpcAddr: this.#ep.rpcAddr(),
      };
    }
    if (this.#closed) {
      throw new HandshakeRefused("FAILED_PRECONDITION", `${who}: this node is stopping`);
    }
    if (peerInfo.length === 0) {
      throw new HandshakeRefused(
        "INVALID_ARGUMENT",
        `${who}: ConnectTransferRequest.peer_info is empty`,
      );
    }
    const peer = this.#ep.createPeer();
    try {
      await peer.connect(peerInfo, this.#connectTimeoutMs);
    } catch (e) {
      await peer.close().catch(() => {});
      // The native layer checks the bytes (version, QP count, sizes) and names what is wrong.
      throw new HandshakeRefused("INVALID_ARGUMENT", `${who}: ${(e as Error).message}`);
    }
    const old = this.#peers.get(requester);
    // Re-inserted last: the map's order is the order of the last handshakes.
    this.#peers.delete(requester);
    this.#peers.set(requester, peer);
    if (old) this.#retire(requester, old);
    if (this.#peers.size > MAX_LENT_PEERS) {
      // A requester that died (or came back under another id) never says so: the table
      // would fill with them and refuse every new node. The oldest handshake's peer goes;
      // a live requester of it sees its READ fail and handshakes again.
      const [oldest, p] = this.#peers.entries().next().value!;
      this.#peers.delete(oldest);
      this.#log.warn("transfer peer of the oldest handshake closed: at most this many are kept", {
        requester: oldest,
        peers: MAX_LENT_PEERS,
      });
      this.#retire(oldest, p);
    }
    this.#log.info("transfer peer lent", {
      requester,
      transport: this.#ep.transport,
      peers: this.#peers.size,
    });
    return { transport: this.#ep.transport, peerInfo: peer.info(), rpcAddr: this.#ep.rpcAddr() };
  }

  /** Closes every lent peer (each ends what it has in flight first). */
  async close(): Promise<void> {
    this.#closed = true;
    const peers = [...this.#peers.values()];
    this.#peers.clear();
    await Promise.all(peers.map((p) => p.close().catch(() => {})));
  }

  #retire(requester: string, peer: LenderPeer): void {
    peer.close().catch((e: Error) =>
      this.#log.warn("closing a replaced transfer peer failed", { requester, error: e.message })
    );
  }
}
