// Adversarial checks of the TS client SDK (review): the local RPC client under
// servers that misbehave, close() with calls pending, load-state waits.
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import { LocalRpcClient, LocalRpcStatus } from "../../lib/client/local_rpc.ts";
import { encodeFrame } from "../../lib/local_rpc/wire.ts";
import { chainedBlockHashes } from "../../lib/client/hashes.ts";
import { LoadState, LoadStateTimeout } from "../../lib/client/load_state.ts";
import { SimEngine, type SimEngineOptions } from "../../lib/client/sim_engine.ts";
import { PegaflowClient, PegaflowError } from "../../lib/client/client.ts";
import { SharedMemory } from "../../ffi/mod.ts";
import { armLoadState, LOAD_STATE_BYTES } from "../../lib/engine/load_state.ts";

/** A one-connection fake RPC server on a temp Unix socket; `serve` runs per accepted conn. */
async function fakeServer(serve: (c: Deno.Conn) => Promise<void>) {
  const dir = await Deno.makeTempDir({ prefix: "pf-review-" });
  const path = `${dir}/s.rpc`;
  const l = Deno.listen({ transport: "unix", path });
  const conns: Deno.Conn[] = [];
  const tasks: Promise<void>[] = [];
  const accepting = (async () => {
    try {
      for await (const c of l) {
        conns.push(c);
        tasks.push(serve(c).catch(() => {}));
      }
    } catch {
      // listener closed
    }
  })();
  return {
    path,
    async stop() {
      l.close();
      for (const c of conns) {
        try {
          c.close();
        } catch {
          // closed by serve
        }
      }
      await accepting;
      await Promise.all(tasks);
      await Deno.remove(dir, { recursive: true });
    },
  };
}

/** Reads one request frame's header (call id) from `c`. */
async function readRequest(c: Deno.Conn): Promise<{ callId: number; method: number }> {
  const head = new Uint8Array(9);
  let got = 0;
  while (got < 9) {
    const n = await c.read(head.subarray(got));
    if (n === null) throw new Error("eof");
    got += n;
  }
  const dv = new DataView(head.buffer);
  const len = dv.getUint32(0, true);
  let rest = len - 5;
  const skip = new Uint8Array(4096);
  while (rest > 0) {
    const n = await c.read(skip.subarray(0, Math.min(rest, skip.length)));
    if (n === null) throw new Error("eof");
    rest -= n;
  }
  return { callId: dv.getUint32(4, true), method: head[8] };
}

function isStatus(code: number, re?: RegExp) {
  return (e: unknown) => {
    assert.ok(e instanceof LocalRpcStatus, `not a LocalRpcStatus: ${e}`);
    assert.equal(e.code, code, e.details);
    if (re) assert.match(e.details, re);
    return true;
  };
}

Deno.test("local RPC: a server that closes mid-frame fails the call UNAVAILABLE", async () => {
  const srv = await fakeServer(async (c) => {
    const { callId } = await readRequest(c);
    const frame = encodeFrame(callId, 0, new Uint8Array(100));
    await c.write(frame.subarray(0, 20)); // header and part of the body, then gone
    c.close();
  });
  const client = new LocalRpcClient(srv.path, 1 << 20);
  try {
    await assert.rejects(
      client.call("health", new Uint8Array(0), 5_000),
      isStatus(grpc.status.UNAVAILABLE, /closed/),
    );
  } finally {
    client.close();
    await srv.stop();
  }
});

Deno.test("local RPC: an oversized answer fails the call UNAVAILABLE naming the limit", async () => {
  const srv = await fakeServer(async (c) => {
    const { callId } = await readRequest(c);
    await c.write(encodeFrame(callId, 0, new Uint8Array(2048)));
    await readRequest(c).catch(() => {});
  });
  const client = new LocalRpcClient(srv.path, 1024);
  try {
    await assert.rejects(
      client.call("health", new Uint8Array(0), 5_000),
      isStatus(grpc.status.UNAVAILABLE, /exceeds the 1024-byte/),
    );
  } finally {
    client.close();
    await srv.stop();
  }
});

Deno.test("local RPC: a frame length below the header fails the call UNAVAILABLE", async () => {
  const srv = await fakeServer(async (c) => {
    await readRequest(c);
    await c.write(new Uint8Array([2, 0, 0, 0, 1, 0]));
    await readRequest(c).catch(() => {});
  });
  const client = new LocalRpcClient(srv.path, 1024);
  try {
    await assert.rejects(
      client.call("health", new Uint8Array(0), 5_000),
      isStatus(grpc.status.UNAVAILABLE, /below the 5-byte header/),
    );
  } finally {
    client.close();
    await srv.stop();
  }
});

Deno.test("local RPC: close() with calls pending fails them CANCELLED and leaves nothing running", async () => {
  let answered!: () => void;
  const seen = new Promise<void>((r) => (answered = r));
  const srv = await fakeServer(async (c) => {
    await readRequest(c);
    await readRequest(c);
    answered();
    await readRequest(c).catch(() => {});
  });
  const client = new LocalRpcClient(srv.path, 1024);
  const calls = [
    client.call("health", new Uint8Array(0), 60_000),
    client.call("save", new Uint8Array(10), 60_000),
  ];
  await seen;
  client.close();
  for (const c of calls) await assert.rejects(c, isStatus(grpc.status.CANCELLED));
  await assert.rejects(
    client.call("health", new Uint8Array(0), 1000),
    isStatus(grpc.status.CANCELLED),
  );
  await srv.stop();
});

Deno.test("local RPC: close() while the dial is in flight fails the call CANCELLED", async () => {
  const srv = await fakeServer(async (c) => {
    await readRequest(c).catch(() => {});
  });
  const client = new LocalRpcClient(srv.path, 1024);
  const call = client.call("health", new Uint8Array(0), 60_000);
  client.close();
  await assert.rejects(call, isStatus(grpc.status.CANCELLED));
  await srv.stop();
});

Deno.test("local RPC: a silent server fails the call at its deadline, with no timer left", async () => {
  const srv = await fakeServer(async (c) => {
    await readRequest(c).catch(() => {});
    await readRequest(c).catch(() => {});
  });
  const client = new LocalRpcClient(srv.path, 1024);
  try {
    await assert.rejects(
      client.call("health", new Uint8Array(0), 200),
      isStatus(grpc.status.DEADLINE_EXCEEDED, /200 ms/),
    );
  } finally {
    client.close();
    await srv.stop();
  }
});

Deno.test("block hashes: a block size of 0 or a fraction is refused, not looped on forever", () => {
  // Before: blockTokens 0 spun pushing hashes until the process ran out of memory.
  for (const bad of [0, -16, 2.5, NaN]) {
    assert.throws(
      () => chainedBlockHashes(new Uint32Array(8), bad),
      (e: unknown) => e instanceof RangeError && e.message.includes(`got ${bad}`),
    );
  }
});

/** Runs `code` in a child Deno (a crash there fails the test instead of killing the runner). */
async function child(code: string): Promise<{ code: number; signal: string | null; out: string }> {
  const root = new URL("../../", import.meta.url);
  const p = await new Deno.Command(Deno.execPath(), {
    args: ["eval", "--ext=ts", code],
    cwd: root,
    stdout: "piped",
    stderr: "piped",
  }).output();
  const td = new TextDecoder();
  return { code: p.code, signal: p.signal, out: td.decode(p.stdout) + td.decode(p.stderr) };
}

Deno.test("load state: close() during a wait rejects the wait instead of crashing the process", async () => {
  const mod = new URL("../../lib/client/load_state.ts", import.meta.url).href;
  const r = await child(`
    import { LoadState } from "${mod}";
    const st = LoadState.create();
    const w = st.waitAll(2_000).then((s) => "resolved " + s, (e) => "rejected: " + e.message);
    st.close();
    console.log(await w);
    try { st.snapshot(); console.log("snapshot read"); } catch (e) { console.log("snapshot: " + e.message); }
  `);
  assert.equal(r.signal, null, `the process died of ${r.signal}:\n${r.out}`);
  assert.equal(r.code, 0, r.out);
  assert.match(r.out, /rejected: load state \/pegaflow-ls-\S+ was closed/);
  assert.match(r.out, /snapshot: load state \/pegaflow-ls-\S+ is closed/);
});

Deno.test("load state: a negative or NaN layer, or a NaN timeout, is refused (not read as landed)", async () => {
  const st = LoadState.create();
  try {
    for (const layer of [-1, 0.5, NaN]) {
      await assert.rejects(
        st.waitLayer(layer, 50),
        (e: unknown) => e instanceof RangeError && e.message.includes(`layer ${layer}`),
      );
    }
    await assert.rejects(
      st.waitAll(NaN),
      (e: unknown) => e instanceof RangeError && e.message.includes("NaN"),
    );
  } finally {
    st.close();
  }
});

Deno.test("load state: a layer past the armed layer count is refused, not waited for", async () => {
  const st = LoadState.create();
  const shm = SharedMemory.open(st.name, LOAD_STATE_BYTES);
  try {
    armLoadState(shm, 4); // what the server writes before a Load returns
    await assert.rejects(
      st.waitLayer(4, 10_000),
      (e: unknown) => e instanceof RangeError && /layer 4 .*4 layers/.test(e.message),
    );
    await assert.rejects(st.waitLayer(3, 30), /layer 3 not ready after 30 ms/);
  } finally {
    shm.close();
    st.close();
  }
});

Deno.test("client: a call after close() fails as a PegaflowError CANCELLED naming the method", async () => {
  const l = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const c = new PegaflowClient(`127.0.0.1:${(l.addr as Deno.NetAddr).port}`, { deadlineMs: 1000 });
  l.close();
  c.close();
  await assert.rejects(c.health(), (e: unknown) => {
    assert.ok(e instanceof PegaflowError, `not a PegaflowError: ${e}`);
    assert.equal(e.codeName, "CANCELLED");
    assert.equal(e.method, "Health");
    return true;
  });
  await assert.rejects(
    c.unregisterContext("inst-1"),
    (e: unknown) =>
      e instanceof PegaflowError && e.codeName === "CANCELLED" && e.method === "UnregisterContext",
  );
});

Deno.test("client: an undecodable local RPC answer is a PegaflowError INTERNAL", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-review-" });
  const l = Deno.listen({ transport: "unix", path: `${dir}/g.sock.rpc` });
  const serving = (async () => {
    const conn = await l.accept();
    const { callId } = await readRequest(conn);
    // Status OK, but the body is not a HealthResponse (a truncated varint).
    await conn.write(encodeFrame(callId, 0, new Uint8Array([0x0a, 0xff, 0xff])));
    await readRequest(conn).catch(() => {});
    conn.close();
  })();
  const c = new PegaflowClient(`unix:${dir}/g.sock`, { deadlineMs: 2000 });
  try {
    await assert.rejects(c.health(), (e: unknown) => {
      assert.ok(e instanceof PegaflowError, `not a PegaflowError: ${e}`);
      assert.equal(e.codeName, "INTERNAL");
      assert.match(e.message, /Health/);
      return true;
    });
  } finally {
    c.close();
    l.close();
    await serving;
    await Deno.remove(dir, { recursive: true });
  }
});

const TINY = { name: "tiny", numLayers: 2, kvHeads: 2, headDim: 4, dtypeBytes: 2, blockTokens: 2 };
const sim = (o: Partial<SimEngineOptions> = {}) =>
  SimEngine.create({
    client: undefined as unknown as PegaflowClient,
    instanceId: "sim-review",
    namespace: "ns",
    model: TINY,
    numBlocks: 4,
    backend: "host",
    ...o,
  });

Deno.test("sim engine: a shape whose segment is not whole u32 words is refused (verify would skip bytes)", () => {
  // 2 tokens x 1 head x 3 dims x 1 byte = 6 bytes: before, fill wrote 4 of them and
  // verify compared 4, so a load that lost the last 2 bytes of every segment passed.
  assert.throws(
    () => sim({ model: { ...TINY, kvHeads: 1, headDim: 3, dtypeBytes: 1 } }),
    (e: unknown) =>
      e instanceof RangeError && /segment of 6 bytes is not a multiple of 4/.test(e.message),
  );
});

Deno.test("sim engine: ranks outside the topology and id/hash lists of different lengths are refused", () => {
  assert.throws(() => sim({ ppRank: 2, ppSize: 2 }), /pp_rank 2 is not a stage of pp_size 2/);
  assert.throws(() => sim({ tpRank: 2, tpSize: 2 }), /tp_rank 2 is not a rank of tp_size 2/);
  const s = sim();
  try {
    const hashes = chainedBlockHashes(new Uint32Array(8), 2);
    s.fill([0, 1, 2, 3], hashes);
    assert.deepEqual(s.verify([0, 1, 2, 3], hashes), { badSegments: 0, first: undefined });
    assert.throws(() => s.fill([0, 1], hashes.slice(0, 1)), /fill of 2 block ids with 1 hashes/);
    assert.throws(() => s.verify([0, 1, 2], hashes), /verify of 3 block ids with 4 hashes/);
  } finally {
    s.close();
  }
});

Deno.test("local RPC: a request over the message limit is refused RESOURCE_EXHAUSTED, not sent", async () => {
  const seen: number[] = [];
  const srv = await fakeServer(async (c) => {
    for (;;) {
      const { callId, method } = await readRequest(c);
      seen.push(method);
      await c.write(encodeFrame(callId, 0, new Uint8Array(0)));
    }
  });
  const client = new LocalRpcClient(srv.path, 1024);
  try {
    // gRPC refuses a message over max_send_message_length on the client; a server with
    // this limit would drop the connection, failing every other call in flight on it.
    await assert.rejects(
      client.call("save", new Uint8Array(2048), 5_000),
      isStatus(grpc.status.RESOURCE_EXHAUSTED, /2048.*1024/),
    );
    await client.call("health", new Uint8Array(0), 5_000);
    assert.deepEqual(seen, [5], "only the Health reached the server");
  } finally {
    client.close();
    await srv.stop();
  }
});

Deno.test("local RPC: a deadline past the timer range (Infinity) does not fire at once", async () => {
  const srv = await fakeServer(async (c) => {
    const { callId } = await readRequest(c);
    await new Promise((r) => setTimeout(r, 50));
    await c.write(encodeFrame(callId, 0, new Uint8Array([7])));
    await readRequest(c).catch(() => {});
  });
  const client = new LocalRpcClient(srv.path, 1024);
  try {
    // setTimeout clamps a delay past 2^31-1 ms to 1 ms: the call failed DEADLINE_EXCEEDED
    // before the server could answer, where gRPC treats such a deadline as none.
    assert.deepEqual(await client.call("health", new Uint8Array(0), Infinity), new Uint8Array([7]));
  } finally {
    client.close();
    await srv.stop();
  }
});

Deno.test("client: a deadline that is not a positive number is refused at construction", () => {
  for (const bad of [0, -1, NaN]) {
    assert.throws(
      () => new PegaflowClient("127.0.0.1:1", { deadlineMs: bad }),
      (e: unknown) => e instanceof RangeError && e.message.includes(`deadlineMs ${bad}`),
    );
  }
});

Deno.test("client: openSession after close() fails as a PegaflowError CANCELLED naming Session", () => {
  const l = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const c = new PegaflowClient(`127.0.0.1:${(l.addr as Deno.NetAddr).port}`, { deadlineMs: 1000 });
  l.close();
  c.close();
  assert.throws(() => c.openSession("inst-1", 2, 1), (e: unknown) => {
    assert.ok(e instanceof PegaflowError, `not a PegaflowError: ${e}`);
    assert.equal(e.codeName, "CANCELLED");
    assert.equal(e.method, "Session");
    assert.match(e.details, /inst-1/);
    return true;
  });
});

Deno.test("local RPC: a call right after the server closed dials again instead of failing UNAVAILABLE", async () => {
  // Each connection answers one call and closes (a server restarting, or one
  // that drops idle connections). The next call is issued at once, before the
  // client has read the end of the stream: it must not be lost to the dead
  // connection, since it was never written there.
  let closed = Promise.withResolvers<void>();
  const srv = await fakeServer(async (c) => {
    const { callId } = await readRequest(c);
    await c.write(encodeFrame(callId, 0, new Uint8Array([7])));
    c.close();
    closed.resolve();
  });
  const rpc = new LocalRpcClient(srv.path, 1 << 20);
  try {
    for (let i = 0; i < 20; i++) {
      assert.deepEqual(await rpc.call("health", new Uint8Array(0), 2_000), new Uint8Array([7]));
      await closed.promise;
      closed = Promise.withResolvers<void>();
    }
  } finally {
    rpc.close();
    await srv.stop();
  }
});

Deno.test("local RPC: a call written on a connection that then ends fails UNAVAILABLE, never resent", async () => {
  let accepted = 0;
  let requests = 0;
  const srv = await fakeServer(async (c) => {
    accepted++;
    await readRequest(c);
    requests++;
    c.close(); // took the call, then went away without an answer: it may have run
  });
  const rpc = new LocalRpcClient(srv.path, 1 << 20);
  try {
    await assert.rejects(
      rpc.call("health", new Uint8Array(0), 2_000),
      isStatus(grpc.status.UNAVAILABLE, /ended/),
    );
    assert.equal(requests, 1);
    assert.equal(accepted, 1);
  } finally {
    rpc.close();
    await srv.stop();
  }
});

Deno.test("load state: a wait that times out is a LoadStateTimeout naming the state and the wait", async () => {
  const st = LoadState.create();
  try {
    for (
      const [wait, what] of [
        [() => st.waitAll(20), "the load"],
        [() => st.waitLayer(2, 20), "layer 2"],
      ] as const
    ) {
      await assert.rejects(wait(), (e: unknown) => {
        assert.ok(e instanceof LoadStateTimeout, `not a LoadStateTimeout: ${e}`);
        assert.equal(e.name, "LoadStateTimeout");
        assert.equal(e.stateName, st.name);
        assert.equal(e.waitingFor, what);
        assert.equal(e.timeoutMs, 20);
        assert.match(e.message, new RegExp(`load state ${st.name}: ${what} not ready after 20 ms`));
        return true;
      });
    }
  } finally {
    st.close();
  }
});

Deno.test("load state: two Workers creating a state in the same millisecond get distinct names", async () => {
  const mod = new URL("../../lib/client/load_state.ts", import.meta.url).href;
  // Both workers see one frozen clock: the same millisecond, each with its own counter at 0.
  const src = `
    Date.now = () => 1_700_000_000_000;
    const { LoadState } = await import("${mod}");
    let st: { name: string; close(): void } | undefined;
    try {
      st = LoadState.create();
      self.postMessage({ name: st.name });
    } catch (e) {
      self.postMessage({ error: String(e) });
    }
    self.onmessage = () => { st?.close(); self.postMessage({ closed: true }); };
  `;
  const url = URL.createObjectURL(new Blob([src], { type: "application/typescript" }));
  const workers = [0, 1].map(() => new Worker(url, { type: "module" }));
  const next = (w: Worker) =>
    new Promise<Record<string, string>>((resolve, reject) => {
      w.onmessage = (e) => resolve(e.data);
      w.onerror = (e) => (e.preventDefault(), reject(new Error(`worker: ${e.message}`)));
    });
  // Listening on both before waiting on either: a message with no listener is lost.
  const created = workers.map(next);
  try {
    const [a, b] = await Promise.all(created);
    assert.equal(a.error, undefined, a.error);
    assert.equal(b.error, undefined, b.error);
    assert.notEqual(a.name, b.name);
  } finally {
    for (const w of workers) {
      const done = next(w);
      w.postMessage("close");
      await done;
      w.terminate();
    }
    URL.revokeObjectURL(url);
  }
});
