/**
 * The `Peer` service (proto/pegaflow.proto): what other nodes call on this
 * node to fetch blocks from it, served on gRPC and — lock and release — on
 * the peer RPC socket (lib/server/local_rpc.ts `servePeerRpc`). `QueryBlocksForTransfer` checks the
 * request, locks the held prefix ({@link PeerLockTable}) and answers where
 * its bytes are; `ReleaseTransferLock` ends a lock (or, naming a lock not
 * granted yet, abandons it: locks.ts); `ConnectTransfer` is the
 * transfer handshake (lender.ts). Bad input is refused with
 * INVALID_ARGUMENT naming the field (bytes that are not the request message
 * too: serve it with `lenientPeerService()`); nothing is locked for it.
 *
 * @module
 */

import * as grpc from "@grpc/grpc-js";
import type {
  PeerServer,
  QueryBlocksForTransferRequest,
  QueryBlocksForTransferResponse,
} from "../../proto/pegaflow.ts";
import { MAX_HASH_BYTES } from "../limits.ts";
import { MAX_HASHES_PER_REQUEST } from "../storage/store.ts";
import type { Logger } from "../log.ts";
import { HandshakeRefused, type TransferLender } from "./lender.ts";
import { PEER_LOCK_ID_BYTES, type PeerLockTable } from "./locks.ts";
import { BadReportError } from "./damage_report.ts";
import { hashHex } from "../storage/keys.ts";
import { undecodableReason } from "../server/decode.ts";

/** What the service tells a requester about this node's transport. */
export interface TransferEndpointInfo {
  /** "tcp" | "rdma". */
  transport: string;
  /** Where a requester connects its transfer peer (TCP: host:port of the listener). */
  addr: string;
}

/** A gRPC error answer: INVALID_ARGUMENT unless `code` says otherwise. */
function refuse(message: string, code = grpc.status.INVALID_ARGUMENT): grpc.ServiceError {
  return Object.assign(new Error(message), {
    code,
    details: message,
    metadata: new grpc.Metadata(),
  });
}

/** Why a lock request is malformed, or undefined. */
export function checkLockRequest(r: QueryBlocksForTransferRequest): string | undefined {
  if (!r.namespace) return "QueryBlocksForTransferRequest.namespace is empty";
  if (!r.requester) return "QueryBlocksForTransferRequest.requester is empty";
  if (r.blockHashes.length === 0) return "QueryBlocksForTransferRequest.block_hashes is empty";
  if (r.blockHashes.length > MAX_HASHES_PER_REQUEST) {
    return `QueryBlocksForTransferRequest.block_hashes names ${r.blockHashes.length} hashes; at most ${MAX_HASHES_PER_REQUEST}`;
  }
  for (let i = 0; i < r.blockHashes.length; i++) {
    const n = r.blockHashes[i].length;
    if (n < 1 || n > MAX_HASH_BYTES) {
      return `QueryBlocksForTransferRequest.block_hashes[${i}] is ${n} bytes (1..${MAX_HASH_BYTES})`;
    }
  }
  if (!r.layoutFingerprint) return "QueryBlocksForTransferRequest.layout_fingerprint is empty";
  const id = r.lockId.length;
  if (id !== 0 && id !== PEER_LOCK_ID_BYTES) {
    return `QueryBlocksForTransferRequest.lock_id is ${id} bytes; expected ${PEER_LOCK_ID_BYTES} (or none: the owner picks it)`;
  }
  return undefined;
}

/**
 * The `Peer` service over `locks`; `endpoint()` is this node's transfer
 * endpoint as peers must dial it.
 *
 * @example
 * ```ts
 * server.addService(PeerService, peerServiceImpl(locks, () => ({ transport: "tcp", addr }), lender, log));
 * ```
 */
export function peerServiceImpl(
  locks: PeerLockTable,
  endpoint: () => TransferEndpointInfo,
  lender: TransferLender,
  log: Logger,
): PeerServer {
  return {
    queryBlocksForTransfer(call, callback) {
      const r = call.request;
      const bad = undecodableReason(r) ?? checkLockRequest(r);
      if (bad) {
        log.warn("peer lock request refused", {
          requester: r.requester ?? "",
          namespace: r.namespace ?? "",
          error: bad,
        });
        callback(refuse(bad));
        return;
      }
      locks.grant({
        namespace: r.namespace,
        hashes: r.blockHashes,
        layoutFingerprint: r.layoutFingerprint,
        requester: r.requester,
        ttlMs: r.lockTtlMs,
        shiftedExtents: r.shiftedExtents,
        lockId: r.lockId,
      }).then((a) => {
        const ep = endpoint();
        const res: QueryBlocksForTransferResponse = {
          lockId: new Uint8Array(0),
          lockTtlMs: 0,
          transport: ep.transport,
          xferAddr: ep.addr,
          payloadBytes: 0,
          checksums: [],
          extentCounts: [],
          extents: new Uint8Array(0),
          missReason: "",
          extentShifts: [],
        };
        if (a.kind === "miss") {
          res.missReason = a.reason;
        } else {
          res.lockId = a.lockId;
          res.lockTtlMs = a.ttlMs;
          res.payloadBytes = a.payloadBytes;
          res.checksums = Array.from(a.checksums);
          res.extentCounts = Array.from(a.extentCounts);
          res.extents = a.extents;
          res.extentShifts = Array.from(a.extentShifts);
        }
        callback(null, res);
      }, (e: Error) => {
        log.error("peer lock failed", {
          requester: r.requester,
          namespace: r.namespace,
          blocks: r.blockHashes.length,
          error: e.message,
        });
        callback(refuse(e.message, grpc.status.INTERNAL));
      });
    },
    releaseTransferLock: releaseTransferLockHandler(locks, log),
    connectTransfer: connectTransferHandler(lender, log),
  };
}

/**
 * `ReleaseTransferLock`: a plain release, or one reporting damaged blocks
 * (damage_report.ts): a report naming no block of its lock is
 * INVALID_ARGUMENT, a check that failed INTERNAL; the lock is released either way.
 */
function releaseTransferLockHandler(
  locks: PeerLockTable,
  log: Logger,
): PeerServer["releaseTransferLock"] {
  return (call, callback) => {
    const bad = undecodableReason(call.request);
    if (bad) {
      log.warn("peer lock release refused", { error: bad });
      callback(refuse(bad));
      return;
    }
    const r = call.request;
    if (r.failedBlocks.length === 0) {
      callback(null, { released: locks.release(r.lockId, r.requester), condemned: 0 });
      return;
    }
    locks.releaseReported(r.lockId, r.requester, r.failedBlocks).then(
      (a) => callback(null, a),
      (e: Error) => {
        const refused = e instanceof BadReportError;
        const fields = { requester: r.requester, lock: hashHex(r.lockId), error: e.message };
        if (refused) log.warn("peer damage report refused; the lock is released", fields);
        else log.error("peer damage report failed; the lock is released", fields);
        callback(refuse(e.message, refused ? undefined : grpc.status.INTERNAL));
      },
    );
  };
}

/** `ConnectTransfer`: the handshake (lender.ts), its refusals mapped to gRPC statuses. */
function connectTransferHandler(
  lender: TransferLender,
  log: Logger,
): PeerServer["connectTransfer"] {
  return (call, callback) => {
    const r = call.request;
    const bad = undecodableReason(r);
    if (bad) {
      log.warn("transfer handshake refused", { error: bad });
      callback(refuse(bad));
      return;
    }
    lender.connect(r.requester, r.transport, r.peerInfo).then(
      (a) => callback(null, a),
      (e: Error) => {
        const code = e instanceof HandshakeRefused ? grpc.status[e.code] : grpc.status.INTERNAL;
        log.warn("transfer handshake refused", { requester: r.requester, error: e.message });
        callback(refuse(e.message, code));
      },
    );
  };
}
