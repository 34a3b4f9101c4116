/**
 * The framed RPC listener (lib/server/local_rpc.ts) served in-process over a
 * stand-in Engine service whose answers the test releases: what a peer that
 * half-closes its socket after its last call gets back, and what the
 * listener's close() ends.
 */
import assert from "node:assert/strict";
import type * as grpc from "@grpc/grpc-js";
import { HealthResponse } from "../../proto/pegaflow.ts";
import { serveLocalRpc } from "../../lib/server/local_rpc.ts";
import { encodeFrame, FrameReader, LOCAL_RPC_IDS, writeAll } from "../../lib/local_rpc/wire.ts";
import { Logger } from "../../lib/log.ts";
import { eofReportingListener } from "./_eof_listener.ts";

type Answer = (err: grpc.ServiceError | null, res?: unknown) => void;

/** Every answer on `conn` until the server closes it. */
async function readAnswers(conn: Deno.Conn): Promise<{ callId: number; status: number }[]> {
  const frames = new FrameReader(64 << 20);
  const out: { callId: number; status: number }[] = [];
  for (;;) {
    let n: number | null;
    try {
      n = await conn.read(frames.space());
    } catch (_e) {
      return out; // reset by the server
    }
    if (n === null) return out;
    frames.wrote(n);
    for (let f = frames.next(); f; f = frames.next()) out.push({ callId: f.callId, status: f.tag });
  }
}

const HEALTH: HealthResponse = { status: "ok", version: "test", backend: "host" };

Deno.test("local RPC: a peer that half-closes after its calls still gets the answers of calls running then", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc2-" });
  const held: Answer[] = [];
  let eof!: () => void;
  const eofSeen = new Promise<void>((r) => eof = r);
  const impl = { health: (_c: unknown, answer: Answer) => void held.push(answer) };
  const rpc = serveLocalRpc(
    eofReportingListener(`${dir}/s.rpc`, () => eof()),
    impl,
    1 << 20,
    new Logger("error", {}, () => {}),
  );
  const conn = await Deno.connect({ transport: "unix", path: `${dir}/s.rpc` });
  try {
    const health = LOCAL_RPC_IDS.health;
    await writeAll(conn, encodeFrame(1, health, new Uint8Array(0)));
    await writeAll(conn, encodeFrame(2, health, new Uint8Array(0)));
    await conn.closeWrite(); // shutdown(SHUT_WR): done sending, still reading
    await eofSeen;
    // Both calls still run when the server reads the end of the stream; they answer after it.
    assert.equal(held.length, 2);
    await new Promise((r) => setTimeout(r, 0));
    for (const answer of held) answer(null, HEALTH);
    assert.deepEqual(await readAnswers(conn), [
      { callId: 1, status: 0 },
      { callId: 2, status: 0 },
    ], "the answers of calls running at the peer's half-close were dropped");
  } finally {
    conn.close();
    rpc.close();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("local RPC: close() ends a connection whose peer half-closed and reads none of its answers", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-lrpc2-" });
  let eof!: () => void;
  const eofSeen = new Promise<void>((r) => eof = r);
  // 256 KiB answers: a few fill the socket's buffers, so the rest wait on a peer that never reads.
  const big: HealthResponse = { ...HEALTH, version: "v".repeat(256 << 10) };
  const impl = { health: (_c: unknown, answer: Answer) => answer(null, big) };
  const rpc = serveLocalRpc(
    eofReportingListener(`${dir}/s.rpc`, () => eof()),
    impl,
    1 << 20,
    new Logger("error", {}, () => {}),
  );
  const conn = await Deno.connect({ transport: "unix", path: `${dir}/s.rpc` });
  const calls = 40;
  try {
    for (let id = 1; id <= calls; id++) {
      await writeAll(conn, encodeFrame(id, LOCAL_RPC_IDS.health, new Uint8Array(0)));
    }
    await conn.closeWrite();
    await eofSeen;
    await new Promise((r) => setTimeout(r, 0));
    rpc.close(); // shutdown: the stuck answers are given up, the connection ends
    const got = await readAnswers(conn);
    assert.ok(
      got.length < calls,
      `close() left the connection open: all ${calls} answers were written after it`,
    );
  } finally {
    conn.close();
    await Deno.remove(dir, { recursive: true });
  }
});
