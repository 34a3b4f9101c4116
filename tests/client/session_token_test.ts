/**
 * The client's token book-keeping against a stand-in server whose timing the test controls:
 * a session opened with no token stands for no registration (the server never adopts it), so
 * its end forgets no token, not even that of a registration made while it was open.
 */
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import { PegaflowClient } from "../../lib/client/client.ts";
import {
  EngineService,
  RegisterContextResponse,
  type SessionRequest,
  UnregisterContextResponse,
} from "../../proto/pegaflow.ts";

type Call = grpc.ServerWritableStream<SessionRequest, unknown>;

/** A server that answers RegisterContext with the next token of `tokens` and keeps sessions open. */
async function standIn(tokens: string[]) {
  const sessions: Call[] = [];
  const server = new grpc.Server();
  server.addService(EngineService, {
    registerContext: (_c: unknown, cb: grpc.sendUnaryData<unknown>) =>
      cb(null, RegisterContextResponse.fromPartial({ registrationToken: tokens.shift() })),
    unregisterContext: (_c: unknown, cb: grpc.sendUnaryData<unknown>) =>
      cb(null, UnregisterContextResponse.fromPartial({})),
    session: (call: Call) => {
      call.sendMetadata(new grpc.Metadata()); // as lib/server/grpc_service.ts: taken
      sessions.push(call);
    },
  } as unknown as grpc.UntypedServiceImplementation);
  const port = await new Promise<number>((res, rej) =>
    server.bindAsync(
      "127.0.0.1:0",
      grpc.ServerCredentials.createInsecure(),
      (e, p) => e ? rej(e) : res(p),
    )
  );
  return { address: `127.0.0.1:${port}`, sessions, stop: () => server.forceShutdown() };
}

async function until(what: string, cond: () => boolean) {
  const deadline = Date.now() + 10_000;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

const REG = {
  instanceId: "inst",
  namespace: "ns",
  tpRank: 0,
  tpSize: 1,
  ppRank: 0,
  ppSize: 1,
  worldSize: 1,
  deviceId: 0,
  layerNames: [],
  regionHandles: [],
  geometry: [],
};

Deno.test("a session opened with no token forgets no token when it ends", async () => {
  const srv = await standIn(["a".repeat(32)]);
  const client = new PegaflowClient(srv.address);
  try {
    const early = client.openSession("inst"); // no token: the rank is not registered yet
    await until("the early session taken", () => srv.sessions.length === 1);
    assert.equal(srv.sessions[0].request.registrationToken, undefined);
    await client.registerContext(REG); // token a…; the server ends the early session
    srv.sessions[0].end();
    await early.closed;
    client.openSession("inst");
    await until("the next session taken", () => srv.sessions.length === 2);
    assert.equal(srv.sessions[1].request.registrationToken, "a".repeat(32));
  } finally {
    client.close();
    srv.stop();
  }
});
