/**
 * The requester's gRPC side of a peer fetch: one `Peer` client per owner
 * address (kept, reconnected by grpc-js), every call with a deadline.
 *
 * @module
 */

import * as grpc from "@grpc/grpc-js";
import {
  type ConnectTransferRequest,
  type ConnectTransferResponse,
  PeerClient,
  type QueryBlocksForTransferRequest,
  type QueryBlocksForTransferResponse,
} from "../../proto/pegaflow.ts";

/** Largest lock answer accepted: the owner's default --max-message-size. */
const MAX_LOCK_ANSWER_BYTES = 64 << 20;

/** Clients of other nodes' `Peer` service, by address. */
export class PeerLinks {
  readonly #clients = new Map<string, PeerClient>();

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

  /** `QueryBlocksForTransfer` on the node at `addr`. Rejects with the gRPC error. */
  lock(
    addr: string,
    req: QueryBlocksForTransferRequest,
    timeoutMs: number,
  ): Promise<QueryBlocksForTransferResponse> {
    return new Promise((resolve, reject) => {
      this.#client(addr).queryBlocksForTransfer(
        req,
        new grpc.Metadata(),
        { deadline: Date.now() + timeoutMs },
        (err, res) => err ? reject(err) : resolve(res),
      );
    });
  }

  /** `ReleaseTransferLock` on the node at `addr`: true when it released a lock. */
  release(
    addr: string,
    lockId: Uint8Array,
    requester: string,
    timeoutMs: number,
  ): Promise<boolean> {
    return new Promise((resolve, reject) => {
      this.#client(addr).releaseTransferLock(
        { lockId, requester },
        new grpc.Metadata(),
        { deadline: Date.now() + timeoutMs },
        (err, res) => err ? reject(err) : resolve(res.released),
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
  }
}
