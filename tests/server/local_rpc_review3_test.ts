/**
 * The framed RPC listener (lib/server/local_rpc.ts) served in-process over
 * stand-in services: what bounds one peer's calls (calls still running count
 * against MAX_UNREAD_ANSWERS; one read's burst of frames yields to the other
 * connections), what a handler that throws or answers what cannot be encoded
 * gets, and what a log line names.
 */
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import type { HealthResponse, LoadResponse, SaveResponse } from "../../proto/pegaflow.ts";
import * as localRpc from "../../lib/server/local_rpc.ts";
import { encodeFrame, FrameReader, LOCAL_RPC_IDS, writeAll } from "../../lib/local_rpc/wire.ts";
import { Logger } from "../../lib/log.ts";
import { eofReportingListener } from "./_eof_listener.ts";

type Answer = (err: grpc.ServiceError | null, res?: unknown) => void;
type Handler = (call: unknown, answer: Answer) => void;

const HEALTH: HealthResponse = { status: "ok", version: "test", backend: "host" };
const SAVED: SaveResponse = {
  blocksSaved: 1,
  blocksSkipped: 0,
  bytesCopied: 4096,
  blocksRefused: 0,
  blocksNotAdmitted: 0,
  blocksDiscarded: 0,
};
const quiet = () => new Logger("error", {}, () => {});
const { MAX_UNREAD_ANSWERS, serveLocalRpc, servePeerRpc } = localRpc;
const tick = (ms = 0) => new Promise((r) => setTimeout(r, ms));

/**
 * A Unix listener whose connections' reads past their first `passed[n]` (n: accept order)
 * hand their bytes to the server only once `open()` is called, in the order the reads
 * came back; `held(n)` settles once connection n's first such read came back.
 */
function holdingListener(path: string, passed: number[]) {
  const real = Deno.listen({ transport: "unix", path });
  let open!: () => void;
  const gate = new Promise<void>((r) => open = r);
  const backs = passed.map(() => Promise.withResolvers<void>());
  let accepted = 0;
  const wrap = (conn: Deno.UnixConn, n: number) => {
    let reads = 0;
    return new Proxy(conn, {
      get(target, prop) {
        if (prop === "read" && n < passed.length) {
          return async (p: Uint8Array) => {
            const got = await target.read(p);
            if (reads++ < passed[n]) return got;
            backs[n].resolve();
            await gate;
            return got;
          };
        }
        const v = Reflect.get(target, prop, target);
        return typeof v === "function" ? v.bind(target) : v;
      },
    });
  };
  const listener = {
    accept: async () => wrap(await real.accept(), accepted++),
    close: () => real.close(),
    addr: real.addr,
  } as unknown as Deno.Listener<Deno.UnixConn, Deno.UnixAddr>;
  return { listener, open, held: (n: number) => backs[n].promise };
}

/** Reads answers on `conn` until `count` arrived or the server closed it. */
async function readAnswers(
  conn: Deno.Conn,
  count: number,
): Promise<{ callId: number; status: number; body: Uint8Array }[]> {
  const frames = new FrameReader(64 << 20);
  const out: { callId: number; status: number; body: Uint8Array }[] = [];
  while (out.length < count) {
    let n: number | null;
    try {
      n = await conn.read(frames.space());
    } catch (_e) {
      return out; // reset by the server, or closed by the test's guard
    }
    if (n === null) return out;
    frames.wrote(n);
    for (let f = frames.next(); f; f = frames.next()) {
      out.push({ callId: f.callId, status: f.tag, body: f.payload });
    }
  }
  return out;
}

/** `count` calls of `method` with empty requests, ids from `first`, in one buffer. */
function burst(method: number, count: number, first = 1): Uint8Array {
  const one = encodeFrame(0, method, new Uint8Array(0));
  const out = new Uint8Array(one.length * count);
  const dv = new DataView(out.buffer);
  for (let i = 0; i < count; i++) {
    out.set(one, i * one.length);
    dv.setUint32(i * one.length + 4, first + i, true);
  }
  return out;
}

async function withSocket(
  body: (dir: string) => Promise<void>,
): Promise<void> {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc3-" });
  try {
    await body(dir);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
}

/** Waits until `count()` has not changed for a few turns of the event loop. */
async function settled(count: () => number): Promise<number> {
  let last = -1;
  for (let still = 0; still < 10;) {
    await tick(10);
    const n = count();
    still = n === last ? still + 1 : 0;
    last = n;
  }
  return last;
}

/**
 * Runs `fn`; the connections are closed if it still runs after `ms` (a test never hangs), and
 * at its end, with the server.
 */
async function guarded(
  rpc: { close(): void },
  conns: Deno.Conn[],
  ms: number,
  fn: () => Promise<void>,
): Promise<void> {
  const closeAll = () => {
    for (const c of conns) {
      try {
        c.close();
      } catch (_e) {
        // closed already (by the guard)
      }
    }
  };
  const guard = setTimeout(closeAll, ms);
  try {
    await fn();
  } finally {
    clearTimeout(guard);
    closeAll();
    rpc.close();
  }
}

Deno.test("local RPC: calls still running count against MAX_UNREAD_ANSWERS; none is lost once they answer", async () => {
  await withSocket(async (dir) => {
    const held: Answer[] = [];
    const impl: Record<string, Handler> = { save: (_c, answer) => void held.push(answer) };
    const rpc = serveLocalRpc(
      Deno.listen({ transport: "unix", path: `${dir}/s.rpc` }),
      impl,
      1 << 20,
      quiet(),
    );
    const conn = await Deno.connect({ transport: "unix", path: `${dir}/s.rpc` });
    await guarded(rpc, [conn], 20_000, async () => {
      // Saves that never answer by themselves (a copy still running): far past the bound.
      const calls = MAX_UNREAD_ANSWERS + 2000;
      const sending = writeAll(conn, burst(LOCAL_RPC_IDS.save, calls));
      const started = await settled(() => held.length);
      assert.ok(
        started <= MAX_UNREAD_ANSWERS,
        `${started} calls of one connection running at once (bound ${MAX_UNREAD_ANSWERS})`,
      );
      // The copies finish: every call is started and answered after all.
      const reading = readAnswers(conn, calls);
      let answered = 0;
      while (answered < calls) {
        const batch = held.splice(0);
        for (const answer of batch) answer(null, SAVED);
        answered += batch.length;
        if (batch.length === 0) await tick(1);
      }
      await sending;
      const got = await reading;
      assert.equal(got.length, calls);
      assert.deepEqual(got.filter((a) => a.status !== 0), []);
    });
  });
});

Deno.test("local RPC: one connection's burst of frames in one read does not hold up another connection's call", async () => {
  await withSocket(async (dir) => {
    // Connection 0 is a polite engine, connection 1 bursts. Their reads are held until both
    // came back, the burst's first: the server gets the whole burst in one read, and the
    // polite call is there while it handles the burst.
    const { listener, open, held } = holdingListener(`${dir}/s.rpc`, [1, 0]);
    let burstHandled = 0;
    let seenByPolite = -1;
    const impl: Record<string, Handler> = {
      release: (_c, answer) => {
        burstHandled++;
        answer(null, {});
      },
      health: (_c, answer) => {
        seenByPolite = burstHandled;
        answer(null, HEALTH);
      },
    };
    const rpc = serveLocalRpc(listener, impl, 1 << 20, quiet());
    const polite = await Deno.connect({ transport: "unix", path: `${dir}/s.rpc` });
    const greedy = await Deno.connect({ transport: "unix", path: `${dir}/s.rpc` });
    await guarded(rpc, [polite, greedy], 20_000, async () => {
      await writeAll(polite, encodeFrame(1, LOCAL_RPC_IDS.health, new Uint8Array(0)));
      assert.equal((await readAnswers(polite, 1))[0]?.status, 0);
      const calls = 7000; // 63,000 bytes: one read of the server's 64 KiB buffer
      await writeAll(greedy, burst(LOCAL_RPC_IDS.release, calls));
      const greedyAnswers = readAnswers(greedy, calls);
      await held(1);
      await writeAll(polite, encodeFrame(2, LOCAL_RPC_IDS.health, new Uint8Array(0)));
      await held(0);
      open();
      const a = await readAnswers(polite, 1);
      assert.equal(a[0]?.callId, 2);
      assert.ok(
        seenByPolite < calls && seenByPolite <= 4 * localRpc.FRAMES_PER_TURN,
        `the polite call waited for ${seenByPolite} of the other connection's ${calls} calls`,
      );
      assert.equal((await greedyAnswers).length, calls, "every call of the burst is answered");
    });
  });
});

Deno.test("local RPC: a handler that throws answers INTERNAL naming the method and call id; the connection serves on", async () => {
  await withSocket(async (dir) => {
    const lines: string[] = [];
    const impl: Record<string, Handler> = {
      release: () => {
        throw new TypeError("lease table is gone");
      },
      health: (_c, answer) => answer(null, HEALTH),
    };
    const rpc = serveLocalRpc(
      Deno.listen({ transport: "unix", path: `${dir}/s.rpc` }),
      impl,
      1 << 20,
      new Logger("info", {}, (l) => lines.push(l)),
    );
    const conn = await Deno.connect({ transport: "unix", path: `${dir}/s.rpc` });
    await guarded(rpc, [conn], 5_000, async () => {
      await writeAll(conn, encodeFrame(7, LOCAL_RPC_IDS.release, new Uint8Array(0)));
      await writeAll(conn, encodeFrame(8, LOCAL_RPC_IDS.health, new Uint8Array(0)));
      const got = await readAnswers(conn, 2);
      assert.deepEqual(got.map((a) => [a.callId, a.status]), [
        [7, grpc.status.INTERNAL],
        [8, grpc.status.OK],
      ]);
      const details = new TextDecoder().decode(got[0].body);
      for (const word of ["release", "call 7", "lease table is gone"]) {
        assert.ok(details.includes(word), `"${details}" names ${word}`);
      }
      const logged = lines.find((l) => l.includes("handler threw"));
      assert.ok(logged, "the throw is logged");
      assert.ok(logged.includes('"method":"release"') && logged.includes('"call":7'), logged);
    });
  });
});

Deno.test("local RPC: a response that cannot be encoded answers INTERNAL instead of breaking the server", async () => {
  await withSocket(async (dir) => {
    const bad: LoadResponse = { numBlocks: -1, numLayers: 1, bytes: 0 }; // not a uint32
    // Answered after a turn, as the real handlers answer (lib/server/grpc_service.ts `unary`).
    const impl: Record<string, Handler> = {
      load: (_c, answer) => void Promise.resolve().then(() => answer(null, bad)),
      health: (_c, answer) => answer(null, HEALTH),
    };
    const rpc = serveLocalRpc(
      Deno.listen({ transport: "unix", path: `${dir}/s.rpc` }),
      impl,
      1 << 20,
      quiet(),
    );
    const conn = await Deno.connect({ transport: "unix", path: `${dir}/s.rpc` });
    await guarded(rpc, [conn], 5_000, async () => {
      await writeAll(conn, encodeFrame(3, LOCAL_RPC_IDS.load, new Uint8Array(0)));
      const first = await readAnswers(conn, 1);
      await writeAll(conn, encodeFrame(4, LOCAL_RPC_IDS.health, new Uint8Array(0)));
      const got = [...first, ...await readAnswers(conn, 1)];
      assert.deepEqual(got.map((a) => [a.callId, a.status]), [
        [3, grpc.status.INTERNAL],
        [4, grpc.status.OK],
      ]);
      const details = new TextDecoder().decode(got[0].body);
      assert.ok(details.includes("load") && details.includes("call 3"), details);
    });
  });
});

Deno.test("peer RPC: a bad frame's log line names the remote peer's address and the connection", async () => {
  const lines: string[] = [];
  const impl: Record<string, Handler> = {};
  const rpc = servePeerRpc(
    Deno.listen({ hostname: "127.0.0.1", port: 0 }),
    impl,
    1 << 20,
    new Logger("info", {}, (l) => lines.push(l)),
  );
  const port = Number(rpc.path.split(":").pop());
  const conn = await Deno.connect({ hostname: "127.0.0.1", port });
  await guarded(rpc, [conn], 5_000, async () => {
    const short = new Uint8Array(9);
    new DataView(short.buffer).setUint32(0, 3, true); // below the 5-byte header
    await writeAll(conn, short);
    const got = await readAnswers(conn, 1);
    assert.equal(got[0]?.status, grpc.status.INVALID_ARGUMENT);
    const logged = lines.find((l) => l.includes("bad frame"));
    assert.ok(logged, "the bad frame is logged");
    const me = `127.0.0.1:${conn.localAddr.port}`;
    assert.ok(logged.includes(`"peer":"${me}"`), `${logged} names the peer ${me}`);
    assert.ok(/"conn":\d+/.test(logged), `${logged} names the connection`);
  });
});

Deno.test("local RPC: close() ends the serving of a half-closed connection whose call never answers", async () => {
  await withSocket(async (dir) => {
    let eof!: () => void;
    const eofSeen = new Promise<void>((r) => eof = r);
    let closes = 0;
    const listener = eofReportingListener(`${dir}/s.rpc`, () => eof(), () => closes++);
    const held: Answer[] = [];
    const impl: Record<string, Handler> = { save: (_c, answer) => void held.push(answer) };
    const rpc = serveLocalRpc(listener, impl, 1 << 20, quiet());
    const conn = await Deno.connect({ transport: "unix", path: `${dir}/s.rpc` });
    try {
      await writeAll(conn, encodeFrame(1, LOCAL_RPC_IDS.save, new Uint8Array(0)));
      await conn.closeWrite();
      await eofSeen;
      await tick(10); // the server now waits for the Save's answer, to write it
      assert.equal(held.length, 1);
      rpc.close(); // shutdown: the answer has nowhere to go
      await settled(() => closes);
      // The listener's close() closed it once; the connection's own serving ends and lets
      // go of it too (it once waited for an answer that never came, holding its buffers).
      assert.equal(closes, 2, "the connection's serving never ended after close()");
    } finally {
      conn.close();
    }
  });
});
