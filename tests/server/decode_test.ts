/**
 * Bytes that are not the request message are the client's fault: a raw
 * grpc-js client sends garbage and a hand-encoded u64 of 2^60, and the
 * server answers INVALID_ARGUMENT naming the message or the field (grpc-js
 * alone would answer INTERNAL "Error deserializing request"), stores
 * nothing, and keeps serving.
 */
import assert from "node:assert/strict";
import { Buffer } from "node:buffer";
import * as grpc from "@grpc/grpc-js";
import { BinaryWriter } from "@bufbuild/protobuf/wire";
import { PROTOCOL_VERSION } from "../../lib/client/client.ts";
import { startServer, uid } from "./harness.ts";

const raw = (x: Buffer | Uint8Array) => Buffer.from(x);

/** The named Engine methods as bytes-in, bytes-out calls. */
function rawClient(address: string) {
  const def = (name: string, responseStream = false) => ({
    path: `/pegaflow.Engine/${name}`,
    requestStream: false,
    responseStream,
    requestSerialize: raw,
    requestDeserialize: raw,
    responseSerialize: raw,
    responseDeserialize: raw,
  });
  const Ctor = grpc.makeGenericClientConstructor(
    { Save: def("Save"), RegisterContext: def("RegisterContext"), Session: def("Session", true) },
    "Engine",
  );
  return new Ctor(address, grpc.credentials.createInsecure()) as grpc.Client & {
    [m: string]: (...a: unknown[]) => unknown;
  };
}

function unary(
  c: ReturnType<typeof rawClient>,
  method: string,
  body: Uint8Array,
): Promise<grpc.ServiceError | null> {
  return new Promise((resolve) => {
    c[method](raw(body), (err: grpc.ServiceError | null) => resolve(err));
  });
}

/** A RegisterContextRequest whose layer 1 has block_stride = 2^60 (field 11, then field 2). */
function registerWithHugeStride(instanceId: string, namespace: string): Uint8Array {
  const w = new BinaryWriter();
  w.uint32((1 << 3) | 2).string(instanceId);
  w.uint32((2 << 3) | 2).string(namespace);
  w.uint32((4 << 3) | 0).uint32(1); // tp_size
  w.uint32((7 << 3) | 0).uint32(1); // world_size
  for (let layer = 0; layer < 2; layer++) {
    w.uint32((9 << 3) | 2).string(`model.layers.${layer}.attn`);
    w.uint32((10 << 3) | 2).bytes(new Uint8Array(64));
  }
  for (let layer = 0; layer < 2; layer++) {
    w.uint32((11 << 3) | 2).fork();
    w.uint32((1 << 3) | 0).uint32(16); // num_blocks
    w.uint32((2 << 3) | 0).uint64(layer === 1 ? 2n ** 60n : 32768n); // block_stride
    w.uint32((4 << 3) | 0).uint64(32768n); // seg_bytes
    w.uint32((5 << 3) | 0).uint32(1); // num_segments
    w.uint32((7 << 3) | 0).uint64(16n * 32768n); // region_bytes
    w.join();
  }
  w.uint32((12 << 3) | 2).string(PROTOCOL_VERSION);
  return w.finish();
}

Deno.test("undecodable requests and u64 fields above 2^53 answer INVALID_ARGUMENT naming what is wrong", async () => {
  const srv = await startServer();
  const c = rawClient(srv.grpc);
  try {
    // A truncated length-delimited field: not a SaveRequest at all.
    const garbage = new Uint8Array([0x0a, 0xff, 0xff, 0x03, 0x41]);
    const e1 = await unary(c, "Save", garbage);
    assert.equal(e1?.code, grpc.status.INVALID_ARGUMENT, e1?.details ?? "no error");
    assert.match(e1!.details, /Save: request is not a valid pegaflow\.SaveRequest \(5 bytes\)/);

    const id = uid("u64");
    const e2 = await unary(c, "RegisterContext", registerWithHugeStride(id, uid("ns")));
    assert.equal(e2?.code, grpc.status.INVALID_ARGUMENT, e2?.details ?? "no error");
    assert.match(
      e2!.details,
      /RegisterContextRequest\.geometry\[1\]\.block_stride is above 2\^53 - 1/,
    );

    // The streaming RPC too.
    const e3 = await new Promise<grpc.ServiceError>((resolve) => {
      const call = c.Session(raw(garbage)) as grpc.ClientReadableStream<Buffer>;
      call.on("data", () => {});
      call.on("error", (e: grpc.ServiceError) => resolve(e));
    });
    assert.equal(e3.code, grpc.status.INVALID_ARGUMENT, e3.details);
    assert.match(e3.details, /Session: request is not a valid pegaflow\.SessionRequest/);

    // Nothing stored, counted as the client's fault, and the server keeps serving.
    const j = await (await srv.http_get("/instances")).json();
    assert.deepEqual(j.instances, []);
    assert.equal(
      await srv.metric("pegaflow_rpc_requests_total", '{method="Save",status="INVALID_ARGUMENT"}'),
      1,
    );
    assert.equal(
      await srv.metric(
        "pegaflow_rpc_requests_total",
        '{method="RegisterContext",status="INVALID_ARGUMENT"}',
      ),
      1,
    );
    assert.equal((await srv.client.health()).status, "ok");
  } finally {
    c.close();
    await srv.stop();
  }
});
