/**
 * The transfer handshake (`Peer.ConnectTransfer`, lib/peer/lender.ts): the
 * owner answers its side's info; over RDMA it keeps one connected peer per
 * requester node (a new handshake replaces and closes the old), refuses bad
 * info without keeping anything, and closes every peer at shutdown; a
 * requester on another transport, an empty requester and oversized info are
 * refused naming what was wrong. No machine here has an RDMA device, so the
 * RDMA side runs over a stand-in endpoint whose peers record what was done to
 * them; the TCP side runs for real in every peer-tier test (the requester
 * handshakes before its first READ).
 */
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import type { ConnectTransferResponse } from "../../proto/pegaflow.ts";
import { Logger } from "../../lib/log.ts";
import {
  type LenderEndpoint,
  type LenderPeer,
  MAX_LENT_PEERS,
  MAX_PEER_INFO_BYTES,
  TransferLender,
} from "../../lib/peer/lender.ts";
import type { PeerLockTable } from "../../lib/peer/locks.ts";
import { peerServiceImpl } from "../../lib/peer/service.ts";

const log = new Logger("error", { component: "handshake-test" });
const bytes = (s: string) => new TextEncoder().encode(s);

/** An RDMA-like endpoint: each peer's info is "qp-<n>"; info "bad" fails its connect. */
function standIn(transport = "rdma") {
  const made: { n: number; connectedWith?: string; closed: boolean }[] = [];
  const ep: LenderEndpoint = {
    transport,
    addr: () => "10.0.0.1:7400",
    rpcAddr: () => "10.0.0.1:7401",
    createPeer(): LenderPeer {
      const rec: { n: number; connectedWith?: string; closed: boolean } = {
        n: made.length,
        closed: false,
      };
      made.push(rec);
      return {
        info: () => bytes(`qp-${rec.n}`),
        connect(remote: Uint8Array) {
          const s = new TextDecoder().decode(remote);
          if (s === "bad") return Promise.reject(new Error("peer info: version 0, expected 1"));
          rec.connectedWith = s;
          return Promise.resolve();
        },
        close() {
          rec.closed = true;
          return Promise.resolve();
        },
      };
    },
  };
  return { ep, made };
}

/** The service's ConnectTransfer handler, called as grpc-js would call it. */
function handshake(
  lender: TransferLender,
  request: { requester: string; transport: string; peerInfo: Uint8Array },
): Promise<ConnectTransferResponse> {
  const impl = peerServiceImpl(
    {} as PeerLockTable, // not used by the handshake
    () => ({ transport: "rdma", addr: "10.0.0.1:7400" }),
    lender,
    log,
  );
  return new Promise((resolve, reject) => {
    impl.connectTransfer(
      { request } as grpc.ServerUnaryCall<typeof request, ConnectTransferResponse>,
      (err, res) => err ? reject(err) : resolve(res!),
    );
  });
}

function refusedWith(code: number, detail: RegExp) {
  return (e: unknown) => {
    const err = e as grpc.ServiceError;
    assert.equal(err.code, code, err.details);
    assert.match(err.details, detail);
    return true;
  };
}

Deno.test("an RDMA owner keeps one connected peer per requester node; a new handshake replaces the old", async () => {
  const { ep, made } = standIn();
  const lender = new TransferLender(ep, 1000, log);
  const a = await handshake(lender, {
    requester: "node-b",
    transport: "rdma",
    peerInfo: bytes("b-1"),
  });
  assert.deepEqual(
    { transport: a.transport, info: new TextDecoder().decode(a.peerInfo), rpc: a.rpcAddr },
    { transport: "rdma", info: "qp-0", rpc: "10.0.0.1:7401" },
    "the answer names the owner's side and its peer RPC socket",
  );
  assert.equal(made[0].connectedWith, "b-1", "the owner's side is connected before it answers");
  await handshake(lender, { requester: "node-c", transport: "rdma", peerInfo: bytes("c-1") });
  assert.equal(lender.size, 2);
  // node-b's side broke and it handshakes again: the old peer goes.
  await handshake(lender, { requester: "node-b", transport: "rdma", peerInfo: bytes("b-2") });
  assert.equal(lender.size, 2);
  await new Promise((r) => setTimeout(r, 0));
  assert.deepEqual(made.map((m) => m.closed), [true, false, false]);
  await lender.close();
  assert.deepEqual(
    made.map((m) => m.closed),
    [true, true, true],
    "shutdown closes every lent peer",
  );
  await assert.rejects(
    handshake(lender, { requester: "node-d", transport: "rdma", peerInfo: bytes("d-1") }),
    refusedWith(grpc.status.FAILED_PRECONDITION, /stopping/),
  );
});

Deno.test("a handshake with bad info, another transport, no requester or too many bytes is refused and keeps nothing", async () => {
  const { ep, made } = standIn();
  const lender = new TransferLender(ep, 1000, log);
  await assert.rejects(
    handshake(lender, { requester: "node-b", transport: "rdma", peerInfo: bytes("bad") }),
    refusedWith(
      grpc.status.INVALID_ARGUMENT,
      /ConnectTransfer from "node-b": peer info: version 0/,
    ),
  );
  assert.equal(made[0].closed, true, "the half-made peer is closed");
  await assert.rejects(
    handshake(lender, { requester: "node-b", transport: "tcp", peerInfo: bytes("x") }),
    refusedWith(grpc.status.FAILED_PRECONDITION, /requester uses tcp, this node rdma/),
  );
  await assert.rejects(
    handshake(lender, { requester: "", transport: "rdma", peerInfo: bytes("x") }),
    refusedWith(grpc.status.INVALID_ARGUMENT, /requester is empty/),
  );
  await assert.rejects(
    handshake(lender, {
      requester: "node-b",
      transport: "rdma",
      peerInfo: new Uint8Array(MAX_PEER_INFO_BYTES + 1),
    }),
    refusedWith(grpc.status.INVALID_ARGUMENT, /peer_info is 16385 bytes, at most 16384/),
  );
  await assert.rejects(
    handshake(lender, { requester: "node-b", transport: "rdma", peerInfo: new Uint8Array(0) }),
    refusedWith(grpc.status.INVALID_ARGUMENT, /peer_info is empty/),
  );
  assert.equal(lender.size, 0);
  assert.equal(made.length, 1, "no peer made for a refused request");
  await lender.close();
});

Deno.test("a TCP owner answers its listener and its peer RPC socket and keeps no state", async () => {
  const { ep, made } = standIn("tcp");
  const lender = new TransferLender(ep, 1000, log);
  const a = await handshake(lender, { requester: "node-b", transport: "tcp", peerInfo: bytes("") });
  assert.deepEqual(
    { transport: a.transport, info: new TextDecoder().decode(a.peerInfo), rpc: a.rpcAddr },
    { transport: "tcp", info: "10.0.0.1:7400", rpc: "10.0.0.1:7401" },
  );
  assert.equal(made.length, 0);
  assert.equal(lender.size, 0);
  await lender.close();
});

Deno.test("an RDMA owner with a full table of lent peers closes the oldest handshake's for a new requester", async () => {
  // Requesters that died (or came back under another node id) never say so: a table that
  // only refused once full stopped every new node from fetching, for the owner's lifetime.
  const { ep, made } = standIn();
  const lender = new TransferLender(ep, 1000, log);
  const shake = (n: number) =>
    handshake(lender, { requester: `node-${n}`, transport: "rdma", peerInfo: bytes(`i-${n}`) });
  for (let n = 0; n < MAX_LENT_PEERS; n++) await shake(n);
  assert.equal(lender.size, MAX_LENT_PEERS);
  await shake(1); // node-1 handshakes again: now the newest
  await shake(MAX_LENT_PEERS); // a new node: node-0's peer, the oldest handshake, goes
  await shake(MAX_LENT_PEERS + 1); // another: node-2's (node-1 handshook since)
  await new Promise((r) => setTimeout(r, 0));
  assert.equal(lender.size, MAX_LENT_PEERS);
  const closed = made.flatMap((m, i) => m.closed ? [i] : []);
  // Peers by creation: node-n is made[n]; node-1's second is made[MAX]; the new ones follow.
  assert.deepEqual(closed, [0, 1, 2], "node-0's, node-1's first, node-2's");
  await lender.close();
  assert.ok(made.every((m) => m.closed), "shutdown closes every lent peer");
});
