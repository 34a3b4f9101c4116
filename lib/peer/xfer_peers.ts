/**
 * The peer tier's transfer connections, one per owner (by its gRPC address):
 * made on first use through the transfer handshake (`Peer.ConnectTransfer`,
 * lender.ts on the owner: this side's info out, the owner's back, then
 * connect; every step with a deadline), shared by every fetch from that
 * owner, dropped when broken so the next fetch handshakes again. The
 * handshake's answer also names the owner's peer RPC socket (where locks
 * are asked for), kept beside the connection.
 *
 * @module
 */

import type { XferEndpoint, XferPeer } from "../../ffi/xfer.ts";
import type { Logger } from "../log.ts";

/** The handshake with an owner: this side's transport and a call that trades info bytes. */
export interface Handshake {
  transport: string;
  trade(
    ownerAddr: string,
    info: Uint8Array,
  ): Promise<{ transport: string; peerInfo: Uint8Array; rpcAddr: string }>;
}

/** An owner as the handshake left it: the connected transfer peer, and its peer RPC socket ("" = none: gRPC). */
export interface OwnerLink {
  peer: XferPeer;
  rpcAddr: string;
}

/**
 * Transfer peers by owner address.
 *
 * @example
 * ```ts
 * const peers = new XferPeers(endpoint, 2_000, log, { transport: "tcp", trade });
 * const { peer, rpcAddr } = await peers.get("10.0.0.2:50055");
 * if (peer.state().broken !== 0) peers.drop("10.0.0.2:50055", peer);
 * await peers.close();
 * ```
 */
export class XferPeers {
  readonly #endpoint: XferEndpoint;
  readonly #connectTimeoutMs: number;
  readonly #log: Logger;
  readonly #handshake: Handshake;
  readonly #peers = new Map<string, Promise<OwnerLink>>();
  /** The connected peer of each entry of `#peers`, once its handshake ended. */
  readonly #connected = new Map<string, XferPeer>();

  constructor(endpoint: XferEndpoint, connectTimeoutMs: number, log: Logger, handshake: Handshake) {
    this.#endpoint = endpoint;
    this.#connectTimeoutMs = connectTimeoutMs;
    this.#log = log;
    this.#handshake = handshake;
  }

  /**
   * The link to the owner at `addr` (a failed handshake is forgotten: the
   * next call retries). A link whose connection broke while idle (the owner
   * restarted: its transfer sockets closed) is dropped and made again here,
   * before a lock is asked over it: reused, its READ was refused after the
   * owner had locked, and the first fetch after every owner restart was a
   * `transfer` miss.
   */
  get(addr: string): Promise<OwnerLink> {
    const known = this.#peers.get(addr);
    const peer = this.#connected.get(addr);
    if (known && peer && peer.state().broken !== 0) {
      this.#log.info("transfer connection to the owner broke while idle; handshaking again", {
        addr,
        error: peer.lastError(),
      });
      void this.drop(addr, peer);
    } else if (known) return known;
    const p = this.#connect(addr);
    this.#peers.set(addr, p);
    p.then(
      (l) => {
        if (this.#peers.get(addr) === p) this.#connected.set(addr, l.peer);
      },
      () => {
        if (this.#peers.get(addr) === p) this.#peers.delete(addr);
      },
    );
    return p;
  }

  /**
   * A broken peer is closed (what it still has in flight ends first) and
   * reconnected next time. A peer that is no longer the owner's link (another
   * fetch dropped it and a third made a new one) is only closed: the new
   * link stays. Returns at once (a fetch does not wait for the close);
   * the promise settles once the peer is closed (never rejects: a failed
   * close is logged).
   */
  drop(addr: string, peer: XferPeer): Promise<void> {
    if (this.#connected.get(addr) === peer) {
      this.#peers.delete(addr);
      this.#connected.delete(addr);
    }
    return peer.close().catch((e: Error) =>
      this.#log.warn("closing a broken transfer peer failed", { addr, error: e.message })
    );
  }

  /** Closes every peer (each ends what it has in flight first). */
  async close(): Promise<void> {
    for (const p of this.#peers.values()) {
      await p.then((l) => l.peer.close(), () => {});
    }
    this.#peers.clear();
    this.#connected.clear();
  }

  async #connect(addr: string): Promise<OwnerLink> {
    const peer = this.#endpoint.createPeer();
    let rpcAddr: string;
    try {
      const theirs = await this.#handshake.trade(addr, peer.info());
      rpcAddr = theirs.rpcAddr;
      if (theirs.transport !== this.#handshake.transport) {
        throw new Error(
          `transfer handshake with ${addr}: the owner uses ${theirs.transport}, this node ${this.#handshake.transport}`,
        );
      }
      await peer.connect(theirs.peerInfo, this.#connectTimeoutMs);
    } catch (e) {
      await peer.close();
      throw e;
    }
    return { peer, rpcAddr };
  }
}
