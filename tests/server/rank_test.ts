/**
 * One rank formula: distinct (tp_rank, pp_rank) pairs get distinct indexes,
 * and a Session naming a rank no instance can have is refused with the rank
 * named (it would otherwise share a slot of the session table).
 */
import assert from "node:assert/strict";
import { Buffer } from "node:buffer";
import * as grpc from "@grpc/grpc-js";
import { BinaryWriter } from "@bufbuild/protobuf/wire";
import fc from "fast-check";
import { rankIndex, rankOutOfRange } from "../../lib/engine/rank.ts";
import { MAX_PARALLEL } from "../../lib/limits.ts";
import { startServer, uid } from "./harness.ts";

Deno.test("every (tp_rank, pp_rank) of an instance has its own rank index", () => {
  fc.assert(fc.property(
    fc.integer({ min: 1, max: 64 }),
    fc.integer({ min: 1, max: 16 }),
    (tpSize, ppSize) => {
      const seen = new Set<number>();
      for (let pp = 0; pp < ppSize; pp++) {
        for (let tp = 0; tp < tpSize; tp++) seen.add(rankIndex(tp, pp, tpSize));
      }
      return seen.size === tpSize * ppSize && Math.max(...seen) === tpSize * ppSize - 1;
    },
  ));
  assert.equal(rankOutOfRange(MAX_PARALLEL - 1, MAX_PARALLEL - 1), undefined);
  assert.match(rankOutOfRange(MAX_PARALLEL, 0) ?? "", /tp_rank 1024 out of range 0\.\.1023/);
  assert.match(rankOutOfRange(0, MAX_PARALLEL) ?? "", /pp_rank 1024 out of range/);
});

Deno.test("a Session for a rank beyond any instance's size is refused naming the rank", async () => {
  const srv = await startServer();
  const raw = (x: Buffer | Uint8Array) => Buffer.from(x);
  const Ctor = grpc.makeGenericClientConstructor({
    Session: {
      path: "/pegaflow.Engine/Session",
      requestStream: false,
      responseStream: true,
      requestSerialize: raw,
      requestDeserialize: raw,
      responseSerialize: raw,
      responseDeserialize: raw,
    },
  }, "Engine");
  const c = new Ctor(srv.grpc, grpc.credentials.createInsecure()) as unknown as grpc.Client & {
    Session: (req: Buffer) => grpc.ClientReadableStream<Buffer>;
  };
  try {
    const id = uid("rank");
    const w = new BinaryWriter();
    w.uint32((1 << 3) | 2).string(id);
    w.uint32((2 << 3) | 0).uint32(MAX_PARALLEL); // tp_rank
    const err = await new Promise<grpc.ServiceError>((resolve) => {
      const call = c.Session(raw(w.finish()));
      call.on("data", () => {});
      call.on("error", (e: grpc.ServiceError) => resolve(e));
    });
    assert.equal(err.code, grpc.status.INVALID_ARGUMENT, err.details);
    assert.match(err.details, new RegExp(`Session: instance "${id}": tp_rank 1024 out of range`));
    assert.equal(
      await srv.metric(
        "pegaflow_rpc_requests_total",
        '{method="Session",status="INVALID_ARGUMENT"}',
      ),
      1,
    );
  } finally {
    c.close();
    await srv.stop();
  }
});
