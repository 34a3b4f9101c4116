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
import { LocalRpcClient, LocalRpcStatus } from "../../lib/client/local_rpc.ts";
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
  constructor(readonly conn: Deno.UnixConn) {}

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
      engineId: "",
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

/** `calls` Health frames (call ids 1..calls) in one buffer. */
const healthBurst = (calls: number) => {
  const burst = new Uint8Array(9 * calls);
  for (let i = 0; i < calls; i++) burst.set(enc(i + 1, 5, new Uint8Array(0)), 9 * i);
  return burst;
};

/** Reads `calls` answers; each must be an OK for call ids 1..calls, in order (Health answers at once). */
async function readAllAnswered(c: RawClient, calls: number): Promise<number> {
  let answered = 0;
  for (let f = await c.next(); f !== null; f = answered < calls ? await c.next() : null) {
    assert.deepEqual([f.callId, f.status], [answered + 1, 0], `answer ${answered + 1} of ${calls}`);
    answered++;
  }
  return answered;
}

Deno.test("local RPC: a peer that pipelines many calls in one write and reads them is answered in full", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path, "--log-level", "info"]);
  try {
    // One write of 3 x MAX_UNREAD_ANSWERS calls, read while it is written: the server
    // reads them in a few reads, so more than MAX_UNREAD_ANSWERS answers are ready before
    // the first of them is written. That is not a peer leaving its answers unread (it
    // once was taken for one: the connection was dropped and most calls went unanswered).
    const calls = 3 * MAX_UNREAD_ANSWERS;
    const c = await RawClient.dial(`${path}.rpc`);
    const guard = setTimeout(() => c.close(), 20_000); // never a hang
    try {
      const sending = c.send(healthBurst(calls)).then(() => "written", (e) => `failed: ${e}`);
      const answered = await readAllAnswered(c, calls);
      assert.equal(answered, calls, `${answered} of ${calls} calls answered`);
      assert.equal(await sending, "written");
    } finally {
      clearTimeout(guard);
      c.close();
    }
    assert.equal(srv.logs().filter((l) => l.includes("connection dropped")).length, 0);
  } finally {
    await srv.stop();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("local RPC: a peer that keeps calling and never reads stalls its own writes, and the server serves on", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path, "--log-level", "info"]);
  try {
    const greedy = await RawClient.dial(`${path}.rpc`);
    // 40 x MAX_UNREAD_ANSWERS calls (1.4 MiB), no answer read: far more than the socket
    // buffers of both directions and MAX_UNREAD_ANSWERS queued answers hold.
    const calls = 40 * MAX_UNREAD_ANSWERS;
    const guard = setTimeout(() => greedy.close(), 30_000); // never a hang
    try {
      let outcome = "stalled";
      const sending = greedy.send(healthBurst(calls)).then(
        () => outcome = "written",
        (e) => outcome = `failed: ${e}`,
      );
      await new Promise((r) => setTimeout(r, 1_000));
      // "written": the server read every call of a peer that reads no answer (its memory
      // grows with them); "failed": it dropped the peer.
      assert.equal(outcome, "stalled", "the server stops reading a peer whose answers pile up");
      // Everyone else is still served meanwhile.
      const polite = await RawClient.dial(`${path}.rpc`);
      await polite.send(enc(1, 5, new Uint8Array(0)));
      const f = await polite.next();
      assert.ok(f && f.callId === 1 && f.status === 0);
      polite.close();
      // Once the greedy peer reads, nothing was dropped: every call is answered, in order.
      const answered = await readAllAnswered(greedy, calls);
      await sending;
      assert.equal(answered, calls, `${answered} of ${calls} calls answered`);
      assert.equal(outcome, "written");
    } finally {
      clearTimeout(guard);
      greedy.close();
    }
  } finally {
    await srv.stop();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("local RPC: the TS client never sends a call that already failed at its deadline", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/wedged.sock.rpc`;
  // A wedged server: it accepts, and reads nothing until both calls gave up.
  const listener = Deno.listen({ transport: "unix", path });
  const client = new LocalRpcClient(path, 64 << 20);
  try {
    // 4 MiB (more than the socket buffers hold) ahead of a Health in the write queue.
    const big = client.call("save", new Uint8Array(4 << 20), 300);
    const small = client.call("health", new Uint8Array(0), 300);
    await Promise.all(
      [big, small].map((call) =>
        assert.rejects(call, (e) => e instanceof LocalRpcStatus && e.code === 4)
      ),
    );
    const conn = await listener.accept();
    // The server wakes up: the frame whose write had begun comes whole (cutting it would
    // desync the stream); the Health, failed before its turn, must not come at all (it
    // once did, so the server ran a call its caller had been told failed).
    const seen: number[] = [];
    let buf = new Uint8Array(0);
    let stop: ReturnType<typeof setTimeout> | undefined = setTimeout(() => conn.close(), 20_000);
    for (;;) {
      const chunk = new Uint8Array(1 << 20);
      const n = await conn.read(chunk).catch(() => null);
      if (n === null) break;
      const grown = new Uint8Array(buf.length + n);
      grown.set(buf);
      grown.set(chunk.subarray(0, n), buf.length);
      buf = grown;
      while (buf.length >= 4) {
        const dv = new DataView(buf.buffer, buf.byteOffset);
        const len = dv.getUint32(0, true);
        if (buf.length < 4 + len) break;
        seen.push(dv.getUint32(4, true));
        buf = buf.slice(4 + len);
      }
      if (seen.length > 0 && buf.length === 0) {
        // The big frame is in: anything more would come within a moment.
        clearTimeout(stop);
        stop = setTimeout(() => conn.close(), 500);
      }
    }
    clearTimeout(stop);
    assert.deepEqual(seen, [1], "call ids of the frames that reached the server");
  } finally {
    client.close();
    listener.close();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("local RPC: the socket accepts again after the server ran out of descriptors", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/grpc.sock`;
  // A server allowed 300 descriptors (the limit set before exec: Deno only raises the
  // soft one up to the hard one).
  const child = new Deno.Command("bash", {
    args: [
      "-c",
      'ulimit -n 300 && exec "$0" "$@"',
      Deno.execPath(),
      "run",
      "-A",
      "main.ts",
      "--addr",
      "127.0.0.1:0",
      "--backend",
      "host",
      "--pool-size",
      "64mb",
      "--uds",
      path,
    ],
    cwd: new URL("../../", import.meta.url).pathname,
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const logs = child.stderr.pipeThrough(new TextDecoderStream());
  const logged: string[] = [];
  const draining = (async () => {
    for await (const chunk of logs) logged.push(chunk);
  })();
  const conns: Deno.Conn[] = [];
  try {
    const out = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
    let line = "";
    while (!line.includes("\n")) {
      const r = await out.read();
      if (r.done) throw new Error(`the server did not start: ${logged.join("")}`);
      line += r.value;
    }
    out.releaseLock();
    child.stdout.cancel().catch(() => {});
    // 400 connections: its accepts fail with EMFILE (once, the listener stopped for good
    // on the first: the socket file stayed, every later call hung to its deadline).
    for (let i = 0; i < 400; i++) {
      conns.push(await Deno.connect({ transport: "unix", path: `${path}.rpc` }));
    }
    for (let t = 0; !logged.join("").includes("Too many open files"); t++) {
      assert.ok(t < 100, `no accept failed with 400 connections: ${logged.join("")}`);
      await new Promise((r) => setTimeout(r, 50));
    }
    for (const c of conns.splice(0)) c.close();
    // Descriptors free again: a new peer is answered.
    const c = await RawClient.dial(`${path}.rpc`);
    const guard = setTimeout(() => c.close(), 10_000);
    try {
      await c.send(enc(1, 5, new Uint8Array(0)));
      const f = await c.next();
      assert.ok(f !== null, "no answer after the descriptor storm");
      assert.deepEqual([f.callId, f.status], [1, 0]);
    } finally {
      clearTimeout(guard);
      c.close();
    }
  } finally {
    for (const c of conns) c.close();
    child.kill("SIGTERM");
    await child.status;
    await draining;
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("local RPC: a late answer for a call that gave up is not taken for a later call's", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/late.sock.rpc`;
  // A server that answers each call 400 ms late, with its call id as the body.
  const listener = Deno.listen({ transport: "unix", path });
  const serving = (async () => {
    const conn = await listener.accept();
    const reader = new RawClient(conn);
    for (let f = await reader.next(); f !== null; f = await reader.next()) {
      const { callId } = f;
      setTimeout(() => {
        reader.send(enc(callId, 0, new TextEncoder().encode(`answer of ${callId}`))).catch(
          () => {},
        );
      }, 400);
    }
  })();
  const client = new LocalRpcClient(path, 64 << 20);
  try {
    // Call 1 gives up at 100 ms; call 2, sent at 300 ms, is pending when 1's answer comes.
    await assert.rejects(
      client.call("health", new Uint8Array(0), 100),
      (e) => e instanceof LocalRpcStatus && e.code === 4,
    );
    await new Promise((r) => setTimeout(r, 200));
    const body = await client.call("health", new Uint8Array(0), 2_000);
    assert.equal(text(body), "answer of 2");
  } finally {
    client.close();
    await serving;
    listener.close();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("local RPC: two frames split in two at every byte position are each answered once", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc-" });
  const path = `${dir}/grpc.sock`;
  const srv = await startServer(["--uds", path, "--log-level", "info"]);
  try {
    const c = await RawClient.dial(`${path}.rpc`);
    // Two empty-bodied Health calls, the second with the largest call id, cut in two at
    // every byte position (a header, a length, a call id split across reads).
    const two = new Uint8Array([
      ...enc(1, 5, new Uint8Array(0)),
      ...enc(0xffff_ffff, 5, new Uint8Array(0)),
    ]);
    for (let cut = 0; cut <= two.length; cut++) {
      await c.send(two.subarray(0, cut));
      await new Promise((r) => setTimeout(r, 1)); // the server reads the first part alone
      await c.send(two.subarray(cut));
      const got = [await c.next(), await c.next()].map((f) => [f?.callId, f?.status]);
      assert.deepEqual(got, [[1, 0], [0xffff_ffff, 0]], `cut at byte ${cut}`);
    }
    c.close();
  } finally {
    await srv.stop();
    await Deno.remove(dir, { recursive: true });
  }
});
