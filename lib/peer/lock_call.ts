/**
 * One transfer lock on an owner, as the requester makes it (peer_tier.ts):
 * asked over the owner's peer RPC socket (or gRPC, link.ts), its answer
 * checked against this node (block payload, transport, extents), and the
 * release that ends it. A fetch takes one or two of them: the first chunk's
 * blocks alone, then the rest while that chunk reads (docs/peer.md).
 *
 * This node names each lock (a random id in the request): a call that got
 * no answer — the owner was slow, the deadline passed — or whose answer could
 * not be decoded (the owner granted the lock, maybe, and this node cannot
 * read its id) is followed by a release of that id in the background, so a
 * lock the owner grants after this node gave up is released at once instead
 * of pinning its blocks for its TTL (locks.ts, "abandoned"). Nothing is
 * added to a call that answers.
 *
 * @module
 */

import type {
  QueryBlocksForTransferRequest,
  QueryBlocksForTransferResponse,
} from "../../proto/pegaflow.ts";
import type { BlockRanges } from "../transfer/ranges.ts";
import type { Logger } from "../log.ts";
import { remoteExtents } from "./extents_wire.ts";
import { type PeerLinks, PeerRpcError, unanswered, undecodable } from "./link.ts";
import { PEER_LOCK_ID_BYTES } from "./locks.ts";
import { monotonicNow } from "../clock.ts";
import { hashHex } from "../storage/keys.ts";

/** A lock request as the tier asks it; {@link lockPart} names the lock (its id). */
export type LockAsk = Omit<QueryBlocksForTransferRequest, "lockId">;

/** Whom a lock is asked of: the owner's gRPC address, its peer RPC socket, its node id (logs). */
export interface LockTarget {
  addr: string;
  rpcAddr: string;
  nodeId: string;
}

/** What this node expects of every answer. */
export interface LockExpect {
  /** This node's bytes per block of the namespace. */
  payloadBytes: number | undefined;
  /** This node's transport. */
  transport: string;
  /** This node's layout of the namespace in words (for an owner that refuses it). */
  layoutSummary?: string;
}

/** A granted, checked lock. */
export interface LockedPart {
  res: QueryBlocksForTransferResponse;
  /** The locked blocks' pool ranges on the owner. */
  remote: BlockRanges;
  /**
   * Ends the lock on the owner, naming the blocks (indices into this part)
   * that landed with other checksums than answered, so the owner checks and
   * drops them (damage_report.ts); never rejects (a lost release lets it
   * expire there).
   */
  release: (failedBlocks?: readonly number[]) => Promise<unknown>;
  /**
   * When the owner may let the lock expire (`monotonicNow()` ms): the TTL it granted, counted
   * from when the request left here (the owner started it later). A READ must end before.
   */
  expiresAt: number;
}

/** Why a lock brought nothing (peer_tier.ts counts it). */
export type LockFailure = {
  why: "lock-rpc" | "owner-miss" | "bad-answer";
  fields: Record<string, string>;
  /** The owner's peer RPC socket is gone: its link must be dropped (the next fetch handshakes again). */
  socketGone?: boolean;
  /**
   * The call got no answer, or one it could not decode: the release of the
   * lock's id, in flight, that ends the lock should the owner have granted
   * it or still grant it. Never rejects; the caller keeps it for flush and
   * close.
   */
  abandon?: Promise<unknown>;
};

/**
 * Asks `target` for a lock on `ask.blockHashes` and checks the answer; a
 * bad answer's lock is released before this returns. `timeoutMs`: the lock
 * call's deadline; `releaseMs`: each release's (the RPC deadline: a lock
 * call cut short by its fetch's deadline must not cut its release short).
 */
export async function lockPart(
  links: PeerLinks,
  target: LockTarget,
  ask: LockAsk,
  expect: LockExpect,
  timeoutMs: number,
  log: Logger,
  releaseMs = timeoutMs,
): Promise<LockedPart | LockFailure> {
  const owner = target.nodeId;
  const end = releaser(links, target, ask.requester, releaseMs, log);
  const lockId = crypto.getRandomValues(new Uint8Array(PEER_LOCK_ID_BYTES));
  let res: QueryBlocksForTransferResponse;
  const sentAt = monotonicNow();
  try {
    res = await links.lock(target.addr, { ...ask, lockId }, timeoutMs, target.rpcAddr);
  } catch (e) {
    const socketGone = e instanceof PeerRpcError && e.socketGone;
    return {
      why: "lock-rpc",
      fields: { owner, addr: target.addr, error: (e as Error).message },
      socketGone,
      // The owner may grant it yet (or has: its answer late, or unreadable): end it there.
      abandon: unanswered(e) || undecodable(e) ? end(lockId) : undefined,
    };
  }
  if (res.lockId.length === 0) {
    const fields = { owner, addr: target.addr, miss_reason: res.missReason };
    if (res.missReason !== "other-layout") return { why: "owner-miss", fields };
    // The owner's engine cuts this namespace's blocks another way: name this node's layout
    // (the owner logs its own beside the one asked for).
    const layout = { layout: ask.layoutFingerprint, layout_summary: expect.layoutSummary ?? "" };
    return { why: "owner-miss", fields: { ...fields, ...layout } };
  }
  // The id answered: an owner that predates lock_id picks its own.
  const release = (failed?: readonly number[]) => end(res.lockId, failed);
  let remote: BlockRanges | string;
  try {
    remote = remoteExtents(res);
  } catch (e) {
    // Never let an answer it cannot read escape with its lock still held on the owner.
    remote = `unreadable extents: ${(e as Error).message}`;
  }
  const asked = ask.blockHashes.length;
  if (
    typeof remote === "string" || res.checksums.length > asked || res.checksums.length === 0 ||
    res.payloadBytes !== expect.payloadBytes || res.transport !== expect.transport
  ) {
    await release();
    const error = typeof remote === "string"
      ? remote
      : res.checksums.length === 0
      ? `a lock on 0 blocks (lock id ${hashHex(res.lockId)})`
      : res.checksums.length > asked
      ? `${res.checksums.length} blocks locked, ${asked} asked`
      : res.payloadBytes !== expect.payloadBytes
      ? `block payload ${res.payloadBytes} bytes, ${expect.payloadBytes} here`
      : `owner transport ${res.transport}, this node ${expect.transport}`;
    return { why: "bad-answer", fields: { owner, addr: target.addr, error } };
  }
  return { res, remote, release, expiresAt: sentAt + res.lockTtlMs };
}

/**
 * Releases a lock of `target`'s, naming the blocks (indices into its
 * prefix) that failed their checksum here; never rejects (a lost release
 * lets the lock expire on the owner). A report and its outcome are logged.
 */
function releaser(
  links: PeerLinks,
  target: LockTarget,
  requester: string,
  releaseMs: number,
  log: Logger,
): (lockId: Uint8Array, failed?: readonly number[]) => Promise<void> {
  const owner = target.nodeId;
  return (lockId, failed = []) =>
    links.release(
      target.addr,
      { lockId, requester, failedBlocks: Array.from(failed) },
      releaseMs,
      target.rpcAddr,
    ).then((r) => {
      if (failed.length === 0) return;
      log.warn("owner told of blocks that failed their checksum here", {
        owner,
        lock: hashHex(lockId),
        reported: failed.length,
        dropped_by_owner: r.condemned,
      });
    }, (e: Error) =>
      log[failed.length ? "warn" : "debug"]("peer lock release failed; it expires on the owner", {
        owner,
        addr: target.addr,
        lock: hashHex(lockId),
        reported: failed.length,
        error: e.message,
      }));
}
