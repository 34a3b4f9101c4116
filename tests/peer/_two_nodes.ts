/**
 * Two peer-tier nodes in one process, over real parts (the harness of
 * peer_tier_test.ts and lock_abandon_test.ts): two pools on the host
 * backend, two stores, the owner's lock table behind a real gRPC `Peer`
 * service and a real peer RPC socket, the requester's tier reading over the
 * real TCP transport. Hooks hold the owner's lock handler, its answer or its
 * checksum function, so a test can make the owner slow at an exact point.
 */

import assert from "node:assert/strict";
import type { Buffer } from "node:buffer";
import * as grpc from "@grpc/grpc-js";
import { lenientPeerService } from "../../lib/server/decode.ts";
import { poolChecksums } from "../../ffi/uring.ts";
import { KvStore } from "../../lib/storage/store.ts";
import { discardEverywhere } from "../../lib/storage/lower_tiers.ts";
import { storeTierHost } from "../../lib/storage/tier_host.ts";
import type { BlockLayout } from "../../lib/storage/block.ts";
import type { TierBlocks, TierHost } from "../../lib/storage/tier.ts";
import { Logger } from "../../lib/log.ts";
import { type ChecksumFn, PeerLockTable } from "../../lib/peer/locks.ts";
import { PeerLinks } from "../../lib/peer/link.ts";
import { type PeerIndex, PeerTier } from "../../lib/peer/peer_tier.ts";
import { peerServiceImpl } from "../../lib/peer/service.ts";
import { servePeerRpc } from "../../lib/server/local_rpc.ts";
import type { PeerServer, QueryBlocksForTransferResponse } from "../../proto/pegaflow.ts";
import { TransferLender } from "../../lib/peer/lender.ts";
import { LocalNode } from "../xfer/_harness.ts";
import type { IndexAdvertiser } from "../../lib/index/advertiser.ts";
import type { Owner } from "../../lib/peer/owner_walk.ts";
import { advertisedFills } from "../../lib/index/attach.ts";

export const NS = "ns-peer";
export const LAYOUT: BlockLayout = {
  layers: 3,
  tpSize: 2,
  collapseTp: false,
  segments: 2,
  segmentBytes: 8192,
};
export const POOL = 16 << 20;
export const log = new Logger("error");

export function hash(i: number): Uint8Array {
  return new Uint8Array([0x70, i, 0xee, i ^ 0x5a]);
}

/**
 * A node: pool + ring + TCP endpoint, a store over the pool, its tier host
 * (with an index advertiser: fed by the store's evictions, its fills
 * advertised, as the server wires it).
 */
export function node(seed: number, advertiser?: IndexAdvertiser) {
  const n = new LocalNode(POOL, seed);
  const store = new KvStore({
    capacityBytes: POOL,
    onEvict: advertiser && ((ns, hex) => advertiser.onEvicted(ns, hex)),
  });
  store.defineNamespace(NS, LAYOUT);
  const host = advertiser
    ? advertisedFills(storeTierHost(store), advertiser)
    : storeTierHost(store);
  const checksum = (b: readonly (readonly { offset: number; bytes: number }[])[]) =>
    poolChecksums(n.pool.handle, b);
  return { n, store, host, checksum };
}

/** Seals blocks on `host` with bytes derived from their hash; returns their payloads. */
export function seal(nd: ReturnType<typeof node>, hashes: Uint8Array[]): Uint8Array[] {
  return hashes.map((h) => {
    const f = nd.host.fill(NS, h, "test", "retained")!;
    const payload = new Uint8Array(f.payloadBytes);
    for (let i = 0; i < payload.length; i++) payload[i] = (i * 131 + h[1] * 7 + (i >> 9)) & 0xff;
    let p = 0;
    for (const x of f.extents) {
      nd.n.mem.set(payload.subarray(p, p + x.bytes), x.offset);
      p += x.bytes;
    }
    f.commit();
    return payload;
  });
}

/** A block's bytes in payload order, read through a pin. */
export function payloadOf(host: TierHost, mem: Uint8Array, h: Uint8Array): Uint8Array | undefined {
  const pin = host.pin(NS, [h], "test-read");
  const b = pin?.blocks[0];
  if (!b) {
    pin?.release();
    return undefined;
  }
  const out = new Uint8Array(b.payloadBytes);
  let p = 0;
  for (const x of b.extents) {
    out.set(mem.subarray(x.offset, x.offset + x.bytes), p);
    p += x.bytes;
  }
  pin!.release();
  return out;
}

/** Where a test holds or changes the owner's lock calls (each on the transport that carries them). */
export interface OwnerHooks {
  /** Awaited before the owner handles its n-th lock request. */
  beforeLock?: (n: number) => Promise<void>;
  /** Changes each lock answer before it is sent (a buggy owner). */
  tamper?: (res: QueryBlocksForTransferResponse) => void;
  /** Awaited after the owner answered its n-th lock request, before the answer is sent. */
  beforeAnswer?: (n: number) => Promise<void>;
  /** Replaces the bytes of each lock answer the gRPC service sends (an answer no one can decode). */
  grpcLockAnswer?: (bytes: Buffer) => Buffer;
  /** Awaited before the owner handles a transfer handshake (`ConnectTransfer`, gRPC). */
  beforeConnect?: () => Promise<void>;
}

/** The owner's Peer handlers, counting the calls each transport brought. */
export function counted(
  impl: PeerServer,
  calls: Record<string, number>,
  via: string,
  hooks: OwnerHooks = {},
): PeerServer {
  const { beforeLock, tamper, beforeAnswer } = hooks;
  const out = { ...impl };
  for (const m of ["queryBlocksForTransfer", "releaseTransferLock"] as const) {
    const h = impl[m] as grpc.handleUnaryCall<unknown, unknown>;
    (out as Record<string, unknown>)[m] = (call: never, cb: grpc.sendUnaryData<unknown>) => {
      const n = calls[`${via} ${m}`] = (calls[`${via} ${m}`] ?? 0) + 1;
      const lock = m === "queryBlocksForTransfer";
      const answer: grpc.sendUnaryData<unknown> = (e, res) => {
        if (lock && tamper && res) tamper(res as QueryBlocksForTransferResponse);
        if (lock && beforeAnswer) beforeAnswer(n).then(() => cb(e, res));
        else cb(e, res);
      };
      if (lock && beforeLock) beforeLock(n).then(() => h(call, answer));
      else h(call, answer);
    };
  }
  return out;
}

export interface TwoNodesOptions extends OwnerHooks {
  chunkBytes?: number;
  /** False: the owner has no peer RPC socket (one that predates it). Default true. */
  framed?: boolean;
  /** The peer RPC address the owner's handshake names instead of its own socket's. */
  rpcAddr?: string;
  rpcTimeoutMs?: number;
  /** The requester's fetch deadline (default 2000 ms). */
  fetchTimeoutMs?: number;
  splitLock?: boolean;
  /** The requester's index advertiser (its store's evictions and its fills feed it). */
  advertiser?: IndexAdvertiser;
  /** The requester's lock TTL asked of the owner (default: its READ deadline plus an RPC's). */
  lockTtlMs?: number;
  /** Awaited by the requester after the lock, before its READ is submitted. */
  beforeRead?: () => Promise<void>;
  /** The owner's checksum function, wrapped (a slow one: the lock waits for it). */
  ownerChecksum?: (inner: ChecksumFn) => ChecksumFn;
  /** The requester tier's logger (default: errors only). */
  log?: Logger;
  /** How long an owner that failed by its own doing is asked after the others (default 10 s). */
  ownerSuspectMs?: number;
}

/** What an owner of {@link ownerNode} is given. */
export type OwnerOptions =
  & Pick<TwoNodesOptions, "framed" | "rpcAddr" | "ownerChecksum">
  & OwnerHooks;

/**
 * An owner in this process: a node (pool `seed`), its lock table behind a
 * real gRPC `Peer` service and — unless `framed` is false — a peer RPC
 * socket its handshake names; the hooks apply to the one that carries the
 * fetches' locks.
 */
export async function ownerNode(seed: number, o: OwnerOptions = {}) {
  const { framed = true } = o;
  const owner = node(seed);
  const locks = new PeerLockTable({
    host: owner.host,
    ram: owner.store,
    checksum: o.ownerChecksum?.(owner.checksum) ?? owner.checksum,
    log,
    // As the server wires it (lib/server/open_tiers.ts), with no tier below RAM.
    condemn: (namespace, hashes) =>
      void discardEverywhere(owner.store, undefined, {
        namespace,
        instance: "peer-report",
        rank: 0,
        hashes,
      }),
  });
  const server = new grpc.Server();
  const xferAddr = `127.0.0.1:${owner.n.ep.info().port}`;
  let rpcListener = framed ? Deno.listen({ hostname: "127.0.0.1", port: 0 }) : undefined;
  const lender = new TransferLender(
    {
      transport: "tcp",
      addr: () => xferAddr,
      rpcAddr: () => o.rpcAddr ?? (rpcListener ? `127.0.0.1:${rpcListener.addr.port}` : ""),
      createPeer: () => owner.n.ep.createPeer(),
    },
    2000,
    log,
  );
  const impl = peerServiceImpl(locks, () => ({ transport: "tcp", addr: xferAddr }), lender, log);
  const { beforeConnect } = o;
  if (beforeConnect) {
    const connect = impl.connectTransfer;
    impl.connectTransfer = (call, cb) => void beforeConnect().then(() => connect(call, cb));
  }
  const calls: Record<string, number> = {};
  const def = lenientPeerService();
  const lockDef = def.queryBlocksForTransfer, rewrite = o.grpcLockAnswer;
  const lockAnswer = rewrite && {
    ...lockDef,
    responseSerialize: (v: unknown) => rewrite(lockDef.responseSerialize(v)),
  };
  server.addService(
    lockAnswer ? { ...def, queryBlocksForTransfer: lockAnswer } : def,
    counted(impl, calls, "grpc", framed ? {} : o),
  );
  const serve = (l: Deno.TcpListener) =>
    servePeerRpc(l, counted(impl, calls, "framed", o), 64 << 20, log);
  let rpc = rpcListener ? serve(rpcListener) : undefined;
  const port = await new Promise<number>((res, rej) =>
    server.bindAsync(
      "127.0.0.1:0",
      grpc.ServerCredentials.createInsecure(),
      (e, p) => e ? rej(e) : res(p),
    )
  );
  return {
    owner,
    locks,
    ownerAddr: `127.0.0.1:${port}`,
    get rpcAddr() {
      return rpc?.path ?? "";
    },
    calls,
    /** The owner's peer RPC socket closed and opened again on another port. */
    moveRpc() {
      rpc?.close();
      rpcListener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
      rpc = serve(rpcListener);
    },
    async close() {
      locks.close();
      rpc?.close();
      server.forceShutdown();
      await owner.n.close();
    },
  };
}

/**
 * Owner and requester in this process (the owner: {@link ownerNode}). The
 * index names the owner for the first `setOwned(n)` blocks, then the owners
 * `setOthers` lists, in that order.
 */
export async function twoNodes(o: TwoNodesOptions = {}) {
  const { chunkBytes, rpcTimeoutMs, splitLock } = o;
  const own = await ownerNode(1, o);
  const { owner, locks, ownerAddr } = own;
  const req = node(2, o.advertiser);
  let owned = 0;
  let others: Owner[] = [];
  const index: PeerIndex = {
    nodeId: "requester",
    lookup: (_ns, hashes) => {
      const mine = owned > 0
        ? [{ nodeId: "owner", addr: ownerAddr, length: Math.min(owned, hashes.length) }]
        : [];
      const owners = [
        ...mine,
        ...others.map((x) => ({ ...x, length: Math.min(x.length, hashes.length) })),
      ];
      return Promise.resolve({
        length: owners.reduce((m, x) => Math.max(m, x.length), 0),
        owners,
        available: true,
      });
    },
    stats: () => ({ up: true }),
  };
  const linkLog: string[] = [];
  const links = new PeerLinks(new Logger("warn", {}, (l) => void linkLog.push(l)));
  const tier = new PeerTier({
    host: req.host,
    index: () => index,
    endpoint: req.n.ep,
    transport: "tcp",
    links,
    checksum: req.checksum,
    log: o.log ?? log,
    fetchTimeoutMs: o.fetchTimeoutMs ?? 2000,
    rpcTimeoutMs,
    chunkBytes,
    splitLock,
    lockTtlMs: o.lockTtlMs,
    ownerSuspectMs: o.ownerSuspectMs,
    beforeRead: o.beforeRead,
  });
  return {
    owner,
    req,
    locks,
    tier,
    links,
    ownerAddr,
    rpcAddr: own.rpcAddr,
    calls: own.calls,
    linkLog,
    moveRpc: () => own.moveRpc(),
    setOwned: (n: number) => (owned = n),
    /** Owners the index names after this one (an empty list: none). */
    setOthers: (list: Owner[]) => (others = list),
    async close() {
      await tier.close();
      links.close();
      await req.n.close();
      await own.close();
    },
  };
}

export async function fetchAll(tier: PeerTier, blocks: TierBlocks, id: string): Promise<void> {
  assert.equal(tier.prefetch(id, blocks).state, "loading");
  while (tier.take(id).state === "loading") await new Promise((r) => setTimeout(r, 5));
}
