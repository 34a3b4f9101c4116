/**
 * The peer tier's transfer connections, one per owner address: made on first
 * use (with a deadline), shared by every fetch from that owner, dropped when
 * broken so the next fetch reconnects.
 *
 * @module
 */

import type { XferEndpoint, XferPeer } from "../../ffi/xfer.ts";
import type { Logger } from "../log.ts";

/**
 * Transfer peers by owner address.
 *
 * @example
 * ```ts
 * const peers = new XferPeers(endpoint, 2_000, log);
 * const peer = await peers.get("10.0.0.2:7400");
 * if (peer.state().broken !== 0) peers.drop("10.0.0.2:7400", peer);
 * await peers.close();
 * ```
 */
export class XferPeers {
  readonly #endpoint: XferEndpoint;
  readonly #connectTimeoutMs: number;
  readonly #log: Logger;
  readonly #peers = new Map<string, Promise<XferPeer>>();

  constructor(endpoint: XferEndpoint, connectTimeoutMs: number, log: Logger) {
    this.#endpoint = endpoint;
    this.#connectTimeoutMs = connectTimeoutMs;
    this.#log = log;
  }

  /** The peer connected to `addr` (a failed connect is forgotten, so the next call retries). */
  get(addr: string): Promise<XferPeer> {
    let p = this.#peers.get(addr);
    if (!p) {
      p = this.#connect(addr);
      this.#peers.set(addr, p);
      p.catch(() => {
        if (this.#peers.get(addr) === p) this.#peers.delete(addr);
      });
    }
    return p;
  }

  /** A broken peer is closed (what it still has in flight ends first) and reconnected next time. */
  drop(addr: string, peer: XferPeer): void {
    this.#peers.delete(addr);
    peer.close().catch((e: Error) =>
      this.#log.warn("closing a broken transfer peer failed", { addr, error: e.message })
    );
  }

  /** Closes every peer (each ends what it has in flight first). */
  async close(): Promise<void> {
    for (const p of this.#peers.values()) {
      await p.then((peer) => peer.close(), () => {});
    }
    this.#peers.clear();
  }

  async #connect(addr: string): Promise<XferPeer> {
    const peer = this.#endpoint.createPeer();
    try {
      await peer.connect(addr, this.#connectTimeoutMs);
    } catch (e) {
      await peer.close();
      throw e;
    }
    return peer;
  }
}
