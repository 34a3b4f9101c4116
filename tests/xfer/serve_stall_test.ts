/**
 * The serving side of the TCP transport cannot be wedged by a peer: a
 * connection that stops reading a READ's payload, never sends its hello, or
 * stops in the middle of a WRITE's payload is closed once no byte moved for
 * the endpoint's stall time (PEGAFLOW_TCP_STALL_MS, here 500 ms), with a log
 * line naming the peer's address and stream; a peer whose streams merely
 * idle between batches keeps them and is served. Before, each such
 * connection held its serving thread until the endpoint closed (or, for the
 * READ, the kernel's TCP_USER_TIMEOUT).
 */
import assert from "node:assert/strict";
import { CompletionRing, Engine } from "../../ffi/mod.ts";
import { XferBatch, XferEndpoint } from "../../ffi/xfer.ts";
import { LocalNode, TCP_OP, tcpFrame } from "./_harness.ts";

const MiB = 1 << 20;
const NODE = decodeURIComponent(new URL("./_node.ts", import.meta.url).pathname);
const STALL_MS = 500;

/** A `_node.ts` child with the stall time set and its stderr kept. */
async function stallNode(poolBytes: number) {
  const proc = new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", NODE, JSON.stringify({ poolBytes, seed: 7, streams: 2 })],
    env: { PEGAFLOW_TCP_STALL_MS: String(STALL_MS) },
    stdin: "piped",
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const lines = proc.stdout.pipeThrough(new TextDecoderStream()).getReader();
  const writer = proc.stdin.getWriter();
  const stderr = new Response(proc.stderr).text();
  let buf = "";
  const line = async () => {
    for (;;) {
      const nl = buf.indexOf("\n");
      if (nl >= 0) {
        const l = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        return JSON.parse(l) as Record<string, number>;
      }
      const { value, done } = await lines.read();
      if (done) throw new Error("node exited");
      buf += value;
    }
  };
  const { port } = await line();
  return {
    port,
    async serving(): Promise<number> {
      await writer.write(new TextEncoder().encode('{"cmd":"info"}\n'));
      return (await line()).servingConnections;
    },
    /** Closes the node; its stderr. */
    async close(): Promise<string> {
      await writer.close();
      await proc.status;
      lines.releaseLock();
      return await stderr;
    },
  };
}

function seg(off: number, bytes: number): Uint8Array {
  const d = new DataView(new ArrayBuffer(16));
  d.setBigUint64(0, BigInt(off), true);
  d.setBigUint64(8, BigInt(bytes), true);
  return new Uint8Array(d.buffer);
}

async function readExactly(conn: Deno.Conn, n: number): Promise<void> {
  const out = new Uint8Array(n);
  for (let got = 0; got < n;) {
    const k = await conn.read(out.subarray(got));
    assert.ok(k !== null, "the server closed the connection early");
    got += k;
  }
}

/** Reads until EOF (the server closed it); false if it is still open after `ms`. */
async function closedWithin(conn: Deno.Conn, ms: number): Promise<boolean> {
  const buf = new Uint8Array(4 * MiB);
  const until = Date.now() + ms;
  for (;;) {
    const left = until - Date.now();
    if (left <= 0) return false;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const tick = new Promise<"open">((r) => (timer = setTimeout(() => r("open"), left)));
    const k = await Promise.race([conn.read(buf), tick]).finally(() => clearTimeout(timer));
    if (k === "open") return false;
    if (k === null) return true;
  }
}

Deno.test("a peer that stops reading, never says hello or stops mid-WRITE loses its serving connection; idle streams stay", async () => {
  const node = await stallNode(64 * MiB);
  const local = new LocalNode(4 * MiB, 3, { streams: 2 });
  const raw: Deno.Conn[] = [];
  let log = "";
  try {
    // A real peer first: its two streams then idle for longer than the stall time.
    const peer = local.ep.createPeer();
    await peer.connect(`127.0.0.1:${node.port}`, 5000);

    const open = () => Deno.connect({ hostname: "127.0.0.1", port: node.port });
    // 1: asks for a 64 MiB READ and never reads it.
    const reader = await open();
    raw.push(reader);
    await reader.write(tcpFrame(TCP_OP.hello)); // HELLO
    await readExactly(reader, 40);
    await reader.write(tcpFrame(TCP_OP.read, 1));
    await reader.write(seg(0, 64 * MiB));
    // 2: connects and says nothing.
    const silent = await open();
    raw.push(silent);
    // 3: a WRITE of 1 MiB that stops after 4 KiB of its payload.
    const writer = await open();
    raw.push(writer);
    await writer.write(tcpFrame(TCP_OP.hello));
    await readExactly(writer, 40);
    await writer.write(tcpFrame(TCP_OP.write, 1, MiB));
    await writer.write(seg(0, MiB));
    await writer.write(new Uint8Array(4096));

    // Nothing is read meanwhile (reading would be progress): the serving
    // threads end, and only the idle peer's two streams are still served.
    let serving = await node.serving();
    for (let i = 0; i < 40 && serving !== 2; i++) {
      await new Promise((r) => setTimeout(r, STALL_MS / 2));
      serving = await node.serving();
    }
    assert.equal(serving, 2, "only the real peer's streams are still served");
    const reasons = ["the stalled READ", "the silent connection", "the stalled WRITE"];
    for (const [i, conn] of [reader, silent, writer].entries()) {
      assert.ok(await closedWithin(conn, 10 * STALL_MS), `${reasons[i]} was not closed`);
    }

    await new Promise((r) => setTimeout(r, STALL_MS)); // idle twice the stall time by now
    const batch = new XferBatch(1).reset("read", 10_000).seg(MiB, 0, 2 * MiB);
    const res = await peer.submit(batch);
    assert.equal(res.statusName, "PF_OK", "the idle peer is still served");
    assert.equal(peer.state().broken, 0);
  } finally {
    for (const c of raw) c.close();
    await local.close();
    log = await node.close();
  }
  const readerPort = (raw[0].localAddr as Deno.NetAddr).port;
  assert.match(
    log,
    new RegExp(
      `connection \\d+ from 127\\.0\\.0\\.1:${readerPort} \\(stream 0\\): no progress for ` +
        `${STALL_MS} ms while sending a READ's payload \\(${64 * MiB} bytes\\); connection closed`,
    ),
  );
  assert.match(log, /no progress for 500 ms while waiting for its first frame/);
  assert.match(log, /no progress for 500 ms while receiving a WRITE's payload \(1048576 bytes\)/);
});

Deno.test("a bad PEGAFLOW_TCP_STALL_MS is refused naming it", async () => {
  const before = Deno.env.get("PEGAFLOW_TCP_STALL_MS");
  Deno.env.set("PEGAFLOW_TCP_STALL_MS", "0");
  const engine = Engine.open({ backend: "host" });
  const pool = engine.createPool(MiB);
  const ring = new CompletionRing(16);
  let opened: XferEndpoint | undefined;
  try {
    assert.throws(
      () => (opened = XferEndpoint.open({ transport: "tcp", pool, ring, streams: 1 })),
      /PEGAFLOW_TCP_STALL_MS "0"; expected 1\.\.3600000/,
    );
  } finally {
    if (before === undefined) Deno.env.delete("PEGAFLOW_TCP_STALL_MS");
    else Deno.env.set("PEGAFLOW_TCP_STALL_MS", before);
    await opened?.close();
    await ring.shutdown();
    ring.destroy();
    pool.close();
    engine.close();
  }
});
