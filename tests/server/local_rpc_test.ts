/**
 * The local RPC socket beside `--uds PATH` (`PATH.rpc`, lib/server/local_rpc.ts):
 * frames from a raw Unix-socket client against a real server child. Good
 * calls answer what gRPC answers; bad frames get a status naming what was
 * wrong, and the server keeps serving everyone else.
 */
import assert from "node:assert/strict";
import { HealthResponse, QueryPrefetchRequest, ReleaseRequest } from "../../proto/pegaflow.ts";
import { startServer } from "./harness.ts";
import { PegaflowClient, PegaflowError } from "../../lib/client/client.ts";
import { MAX_UNREAD_ANSWERS } from "../../lib/server/local_rpc.ts";

const enc = (callId: number, method: number, payload: Uint8Array, len?: number) => {
  const out = new Uint8Array(9 + payload.length);
  const dv = new DataView(out.buffer);
  dv.setUint32(0, len ?? 5 + payload.length, true);
  dv.setUint32(4, callId, true);
  out[8] = method;
  out.set(payload, 9);
  return out;
};

/** A raw client: writes frames, reads answers (call id, status, payload) in arrival order. */
class RawClient {
  #buf = new Uint8Array(0);
  private constructor(readonly conn: Deno.UnixConn) {}

  static async dial(path: string): Promise<RawClient> {
    return new RawClient(await Deno.connect({ transport: "unix", path }));
  }

  async send(bytes: Uint8Array): Promise<void> {
    let off = 0;
    while (off < bytes.length) off += await this.conn.write(bytes.subarray(off));
  }

  /** The next answer, or null when the server closed the connection. */
  async next(): Promise<{ callId: number; status: number; body: Uint8Array } | null> {
    for (;;) {
      if (this.#buf.length >= 4) {
        const dv = new DataView(this.#buf.buffer, this.#buf.byteOffset);
        const len = dv.getUint32(0, true);
        if (this.#buf.length >= 4 + len) {
          const f = {
            callId: dv.getUint32(4, true),
            status: this.#buf[8],
            body: this.#buf.slice(9, 4 + len),
          };
          this.#buf = this.#buf.slice(4 + len);
          return f;
        }
      }
      const chunk = new Uint8Array(65536);
      const n = await this.conn.read(chunk);
      if (n === null) return null;
      const grown = new Uint8Array(this.#buf.length + n);
      grown.set(this.#buf);
      grown.set(chunk.subarray(0, n), this.#buf.length);
      this.#buf = grown;
    }
  }

  close(): void {
    try {
      this.conn.close();
    } catch (_e) {
      // closed by the server
    }
  }
}

const text = (b: Uint8Array) => new TextDecoder().decode(b);

Deno.test("local RPC: calls answer like gRPC, out of order by call id; bad frames are named and only their connection ends", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path]);
  try {
    assert.ok(Deno.lstatSync(`${path}.rpc`).isSocket, "PATH.rpc is served beside --uds PATH");
    const a = await RawClient.dial(`${path}.rpc`);
    // Health (id 5) and a QueryPrefetch (id 1) for an instance nobody registered.
    const q = QueryPrefetchRequest.encode({
      instanceId: "ghost",
      blockHashes: [new Uint8Array(32)],
      requestId: "req-7",
      loadInto: undefined,
    }).finish();
    await a.send(new Uint8Array([...enc(41, 5, new Uint8Array(0)), ...enc(42, 1, q)]));
    const got = new Map<number, { status: number; body: Uint8Array }>();
    for (let i = 0; i < 2; i++) {
      const f = await a.next();
      assert.ok(f);
      got.set(f.callId, f);
    }
    assert.equal(got.get(41)!.status, 0);
    assert.equal(HealthResponse.decode(got.get(41)!.body).status, "ok");
    assert.equal(got.get(42)!.status, 9, "FAILED_PRECONDITION, as over gRPC");
    assert.match(text(got.get(42)!.body), /request "req-7".*instance "ghost" is not registered/);

    // A lease id of the wrong size: INVALID_ARGUMENT from the shared handler.
    await a.send(enc(43, 3, ReleaseRequest.encode({ leaseId: new Uint8Array(3) }).finish()));
    const rel = await a.next();
    assert.deepEqual([rel!.callId, rel!.status], [43, 3]);
    assert.match(text(rel!.body), /lease id is 3 bytes, expected 16/);

    // Unknown method id: UNIMPLEMENTED naming it; the connection stays usable.
    await a.send(enc(44, 77, new Uint8Array(0)));
    const un = await a.next();
    assert.deepEqual([un!.callId, un!.status], [44, 12]);
    assert.match(text(un!.body), /unknown method id 77/);

    // Bytes that are not a QueryPrefetchRequest: INVALID_ARGUMENT naming the message.
    await a.send(enc(45, 1, new Uint8Array([0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f])));
    const bad = await a.next();
    assert.deepEqual([bad!.callId, bad!.status], [45, 3]);
    assert.match(text(bad!.body), /QueryPrefetchRequest/);

    // A second client, then a frame longer than the message limit on the first:
    // RESOURCE_EXHAUSTED with call id 0, that connection closed, the other one served.
    const b = await RawClient.dial(`${path}.rpc`);
    await a.send(enc(46, 1, new Uint8Array(0), 0x7fff_ffff));
    const big = await a.next();
    assert.deepEqual([big!.callId, big!.status], [0, 8]);
    assert.match(text(big!.body), /exceeds the \d+-byte message limit/);
    assert.equal(await a.next(), null, "the server closed the desynced connection");
    a.close();
    await b.send(enc(47, 5, new Uint8Array(0)));
    const h = await b.next();
    assert.deepEqual([h!.callId, h!.status], [47, 0]);

    // A frame shorter than its header: INVALID_ARGUMENT, connection closed.
    await b.send(enc(48, 5, new Uint8Array(0), 2));
    const short = await b.next();
    assert.deepEqual([short!.callId, short!.status], [0, 3]);
    assert.match(text(short!.body), /below the 5-byte header/);
    assert.equal(await b.next(), null);
    b.close();
  } finally {
    await srv.stop();
  }
  assert.throws(() => Deno.lstatSync(`${path}.rpc`), Deno.errors.NotFound, "removed at shutdown");
  await Deno.remove(dir, { recursive: true });
});

Deno.test("local RPC: a socket left by a killed server is taken over at the next start", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/grpc.sock`;
  const first = await startServer(["--uds", path]);
  Deno.kill(first.pid, "SIGKILL");
  await first.status;
  first.client.close();
  assert.ok(Deno.lstatSync(`${path}.rpc`).isSocket, "a SIGKILLed server leaves PATH.rpc behind");
  const second = await startServer(["--uds", path]);
  try {
    const c = await RawClient.dial(`${path}.rpc`);
    await c.send(enc(1, 5, new Uint8Array(0)));
    const f = await c.next();
    assert.deepEqual([f!.callId, f!.status], [1, 0]);
    c.close();
  } finally {
    await second.stop();
  }
  await Deno.remove(dir, { recursive: true });
});

Deno.test("local RPC: the TS client sends its hot calls over PATH.rpc and gets gRPC's answers", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path, "--log-level", "debug"]);
  const local = new PegaflowClient(`unix:${path}`);
  const tcp = new PegaflowClient(srv.grpc);
  try {
    assert.equal((await local.health()).status, "ok");
    const ask = { instanceId: "ghost", blockHashes: [new Uint8Array(32)], requestId: "req-9" };
    const errs: PegaflowError[] = [];
    for (const c of [local, tcp]) {
      await c.queryPrefetch(ask).then(
        () => assert.fail("a query for an unregistered instance must be refused"),
        (e) => errs.push(e as PegaflowError),
      );
    }
    assert.deepEqual([errs[0].code, errs[0].details], [errs[1].code, errs[1].details]);
    assert.equal(errs[0].codeName, "FAILED_PRECONDITION");
    const lines = srv.logs().filter((l) => l.includes('"local rpc"'));
    assert.deepEqual(lines.map((l) => JSON.parse(l).method), ["health", "queryPrefetch"]);
  } finally {
    local.close();
    tcp.close();
    await srv.stop();
  }
  await Deno.remove(dir, { recursive: true });
});

Deno.test("local RPC: without the socket file the TS client falls back to gRPC", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path, "--log-level", "debug"]);
  await Deno.remove(`${path}.rpc`); // as a server that serves no local socket
  const c = new PegaflowClient(`unix:${path}`);
  try {
    assert.equal((await c.health()).status, "ok");
    assert.equal((await c.health()).status, "ok");
    assert.equal(srv.logs().filter((l) => l.includes('"local rpc"')).length, 0);
  } finally {
    c.close();
    await srv.stop();
  }
  await Deno.remove(dir, { recursive: true });
});

Deno.test("local RPC: a peer that keeps calling and never reads is dropped, and the server serves on", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path]);
  try {
    const greedy = await RawClient.dial(`${path}.rpc`);
    // Health calls, never an answer read: the server's writes stall and answers queue up.
    const calls = 3 * MAX_UNREAD_ANSWERS;
    const burst = new Uint8Array(9 * calls);
    for (let i = 0; i < calls; i++) burst.set(enc(i + 1, 5, new Uint8Array(0)), 9 * i);
    // Never a hang, whatever the server does: the connection is closed at 20 s.
    const guard = setTimeout(() => greedy.close(), 20_000);
    let answers = 0;
    try {
      await greedy.send(burst).catch(() => {}); // the server may drop us while we still write
      // Dropped: reading drains what was written, then the end of the stream.
      while ((await greedy.next().catch(() => null)) !== null) answers++;
    } finally {
      clearTimeout(guard);
      greedy.close();
    }
    assert.ok(answers < calls, `all ${calls} answered: the peer was never dropped`);
    // Everyone else is still served.
    const polite = await RawClient.dial(`${path}.rpc`);
    await polite.send(enc(1, 5, new Uint8Array(0)));
    const f = await polite.next();
    assert.ok(f && f.status === 0);
    polite.close();
  } finally {
    await srv.stop();
    await Deno.remove(dir, { recursive: true });
  }
});
