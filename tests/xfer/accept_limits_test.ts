/**
 * The TCP transport's listening side under too many connections. Over its
 * cap (PEGAFLOW_TCP_MAX_CONNS) an endpoint accepts a connection and refuses
 * it at once: a REFUSE frame, close, counted, one log line per burst, and a
 * requester's connect fails naming the cap. Out of file descriptors it takes
 * each pending connection off the backlog with its reserve descriptor and
 * refuses it, instead of spinning on a listener that stays readable; once
 * descriptors are free it serves again. Before: no cap (a thread per
 * connection for as long as anyone opened them), and a failed accept was
 * retried at once, a core at 100 % while the pending connections waited
 * forever for their hello.
 */
import assert from "node:assert/strict";
import { CompletionRing, Engine, NativeError, PF_STATUS } from "../../ffi/mod.ts";
import { XferBatch, XferEndpoint } from "../../ffi/xfer.ts";
import { Registry } from "prom-client";
import { registerTransferMetrics } from "../../lib/transfer/metrics.ts";
import { LocalNode, nextFrame, type NodeProc, spawnNode, TCP_OP, tcpFrame } from "./_harness.ts";

const MiB = 1 << 20;
const { PF_EBUSY, PF_ENOMEM } = PF_STATUS;
/** How long a raw connection may wait for the server's first frame (a failing test must end). */
const ANSWER_MS = 5000;

/** A raw connection that said hello; the server's first frame (or "closed" / "open"). */
async function hello(port: number, conns: Deno.Conn[]) {
  const c = await Deno.connect({ hostname: "127.0.0.1", port });
  conns.push(c);
  await c.write(tcpFrame(TCP_OP.hello));
  return {
    conn: c,
    port: (c.localAddr as Deno.NetAddr).port,
    answer: await nextFrame(c, ANSWER_MS),
  };
}

/** Polls the node's counters until `ok` holds (at most ~10 s; the counters are the event). */
async function infoWhen(
  node: NodeProc,
  ok: (i: Record<string, number>) => boolean,
): Promise<Record<string, number>> {
  let info = await node.cmd<Record<string, number>>({ cmd: "info" });
  for (let i = 0; i < 500 && !ok(info); i++) {
    await new Promise((r) => setTimeout(r, 20));
    info = await node.cmd<Record<string, number>>({ cmd: "info" });
  }
  return info;
}

/** utime + stime (clock ticks) of the thread of `pid` named `name`. */
async function threadTicks(pid: number, name: string): Promise<number> {
  for await (const t of Deno.readDir(`/proc/${pid}/task`)) {
    const dir = `/proc/${pid}/task/${t.name}`;
    if ((await Deno.readTextFile(`${dir}/comm`)).trim() !== name) continue;
    const stat = await Deno.readTextFile(`${dir}/stat`);
    const f = stat.slice(stat.lastIndexOf(")") + 2).split(" "); // f[0] is field 3 (state)
    return Number(f[11]) + Number(f[12]); // fields 14 and 15
  }
  throw new Error(`process ${pid} has no thread named ${name}`);
}

async function clockTicksPerSecond(): Promise<number> {
  const out = await new Deno.Command("getconf", { args: ["CLK_TCK"] }).output();
  return Number(new TextDecoder().decode(out.stdout).trim());
}

/** A READ of 1 MiB from the node over a fresh peer of `local`. */
async function readFrom(local: LocalNode, port: number): Promise<string> {
  const peer = local.ep.createPeer();
  try {
    await peer.connect(`127.0.0.1:${port}`, 5000);
    const res = await peer.submit(new XferBatch(1).reset("read", 10_000).seg(0, 0, MiB));
    return res.statusName;
  } finally {
    await peer.close();
  }
}

Deno.test("over PEGAFLOW_TCP_MAX_CONNS a connection is refused at once, counted and logged once per burst; a requester's connect names the cap", async () => {
  const node = await spawnNode({ poolBytes: 4 * MiB, seed: 7, streams: 1 }, undefined, {
    env: { PEGAFLOW_TCP_MAX_CONNS: "2" },
    keepStderr: true,
  });
  const local = new LocalNode(4 * MiB, 3, { streams: 2 });
  const raw: Deno.Conn[] = [];
  let log = "";
  let refusedPort = 0;
  try {
    for (const i of [1, 2]) {
      const { answer } = await hello(node.port, raw);
      assert.ok(typeof answer === "object" && answer.op === TCP_OP.hello, `connection ${i} served`);
    }
    const over = [];
    for (let i = 0; i < 3; i++) over.push(await hello(node.port, raw));
    refusedPort = over[0].port;
    for (const { answer } of over) {
      assert.deepEqual(answer, { op: TCP_OP.refuse, status: PF_EBUSY, bytes: 2, aux: 2 });
    }
    for (const { conn } of over) assert.equal(await nextFrame(conn, ANSWER_MS), "closed");

    const peer = local.ep.createPeer();
    try {
      await assert.rejects(peer.connect(`127.0.0.1:${node.port}`, 5000), (e) => {
        assert.ok(e instanceof NativeError && e.codeName === "PF_EBUSY", String(e));
        assert.match(
          e.message,
          new RegExp(
            `stream 0 to 127\\.0\\.0\\.1:${node.port}: refused: the endpoint serves 2 ` +
              `connections, its cap \\(PEGAFLOW_TCP_MAX_CONNS there\\) is 2`,
          ),
        );
        return true;
      });
    } finally {
      await peer.close();
    }
    // The peer's second stream is refused too, but maybe after its connect already failed on
    // the first (the acceptor takes it off the backlog in its own time).
    let info = await infoWhen(node, (i) => i.connsRefused >= 4);
    assert.equal(info.connsRefused, 4);
    assert.equal(info.servingConnections, 2, "the two served connections were never touched");

    // Room again: a peer's two streams fit once both raw connections are gone.
    for (const c of raw.splice(0, 2)) c.close();
    info = await infoWhen(node, (i) => i.servingConnections === 0);
    assert.equal(info.servingConnections, 0);
    assert.equal(await readFrom(local, node.port), "PF_OK");
  } finally {
    for (const c of raw) c.close();
    await local.close();
    await node.close();
    log = await node.stderr();
  }
  const refusals = log.split("\n").filter((l) => / refused: /.test(l));
  assert.equal(refusals.length, 1, `one line for the burst:\n${log}`);
  assert.match(
    refusals[0],
    new RegExp(
      `connection from 127\\.0\\.0\\.1:${refusedPort} refused: the endpoint serves its cap of ` +
        `connections \\(PEGAFLOW_TCP_MAX_CONNS\\) \\(2 connections served, cap 2\\)`,
    ),
  );
  assert.match(log, /serving connections again after refusing 4 and failing to accept 0/);
});

Deno.test("out of file descriptors, pending connections are refused with the reserve descriptor, the acceptor does not spin, and serves again once descriptors are free", async () => {
  const node = await spawnNode({ poolBytes: 4 * MiB, seed: 7, streams: 1 }, undefined, {
    nofile: 256,
    keepStderr: true,
  });
  const local = new LocalNode(4 * MiB, 3, { streams: 2 });
  const raw: Deno.Conn[] = [];
  let log = "";
  try {
    const { held } = await node.cmd<{ held: number }>({ cmd: "hogFds" });
    assert.ok(held > 0, "the node ran out of descriptors");
    const tick = await clockTicksPerSecond();
    const before = await threadTicks(node.pid, "pf-tcp-accept");
    const conns = [];
    for (let i = 0; i < 4; i++) {
      const c = await Deno.connect({ hostname: "127.0.0.1", port: node.port });
      raw.push(c);
      await c.write(tcpFrame(TCP_OP.hello));
      conns.push(c);
    }
    // The window over which the acceptor's CPU is measured: what it does with pending
    // connections it cannot accept normally.
    await new Promise((r) => setTimeout(r, 1000));
    const spent = (await threadTicks(node.pid, "pf-tcp-accept")) - before;
    assert.ok(spent < tick / 5, `the acceptor used ${spent} of ${tick} ticks in 1 s (spinning)`);
    for (const c of conns) {
      const answer = await nextFrame(c, ANSWER_MS);
      assert.ok(typeof answer === "object", `a refusal, not ${answer}`);
      assert.equal(answer.op, TCP_OP.refuse);
      assert.equal(answer.status, PF_ENOMEM);
      assert.equal(await nextFrame(c, ANSWER_MS), "closed");
    }
    const info = await node.cmd<Record<string, number>>({ cmd: "info" });
    assert.equal(info.connsRefused, 4);
    assert.equal(info.acceptErrors, 4, "one failed accept per pending connection");

    await node.cmd({ cmd: "freeFds" });
    assert.equal(await readFrom(local, node.port), "PF_OK");
  } finally {
    for (const c of raw) c.close();
    await local.close();
    await node.close();
    log = await node.stderr();
  }
  assert.match(log, /refused: out of file descriptors \(accept: Too many open files\)/);
  assert.match(log, /serving connections again after refusing 4 and failing to accept 0/);
});

Deno.test("without a reserve descriptor (opened while out of them) the acceptor backs off instead of spinning, and serves the waiting connections once descriptors are free", async () => {
  const node = await spawnNode(
    { poolBytes: 4 * MiB, seed: 7, streams: 1, fdsLeftAtOpen: 2 }, // the listener and its wake
    undefined,
    { nofile: 256, keepStderr: true },
  );
  const raw: Deno.Conn[] = [];
  let log = "";
  try {
    const tick = await clockTicksPerSecond();
    const before = await threadTicks(node.pid, "pf-tcp-accept");
    for (let i = 0; i < 4; i++) {
      const c = await Deno.connect({ hostname: "127.0.0.1", port: node.port });
      raw.push(c);
      await c.write(tcpFrame(TCP_OP.hello));
    }
    await new Promise((r) => setTimeout(r, 1000)); // the window the acceptor's CPU is measured over
    const spent = (await threadTicks(node.pid, "pf-tcp-accept")) - before;
    assert.ok(spent < tick / 5, `the acceptor used ${spent} of ${tick} ticks in 1 s (spinning)`);
    const info = await node.cmd<Record<string, number>>({ cmd: "info" });
    assert.ok(info.acceptErrors > 0, "its accepts failed");
    assert.equal(info.connsRefused, 0, "nothing could be taken off the backlog to refuse");

    await node.cmd({ cmd: "freeFds" });
    for (const c of raw) {
      const answer = await nextFrame(c, ANSWER_MS);
      assert.ok(typeof answer === "object" && answer.op === TCP_OP.hello, `served, not ${answer}`);
    }
  } finally {
    for (const c of raw) c.close();
    await node.close();
    log = await node.stderr();
  }
  assert.match(log, /accept failed: Too many open files; accepting again every 100 ms/);
  assert.match(log, /serving connections again after refusing 0 and failing to accept [1-9]/);
});

Deno.test("a listener that closes each connection at once fails the connect at once, naming the stream and address", async () => {
  const l = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  (async () => {
    for await (const c of l) c.close();
  })().catch(() => {}); // ends with BadResource when closed below
  const local = new LocalNode(MiB, 3, { streams: 2 });
  const peer = local.ep.createPeer();
  const addr = `127.0.0.1:${(l.addr as Deno.NetAddr).port}`;
  try {
    await assert.rejects(
      peer.connect(addr, 5000),
      new RegExp(
        `stream 0 to ${addr.replaceAll(".", "\\.")}: the endpoint closed the connection before ` +
          `its hello \\((connection closed by peer|Connection reset by peer)\\): over its ` +
          `connection cap, out of descriptors, or not a PegaFlow transfer endpoint`,
      ),
    );
  } finally {
    await peer.close();
    await local.close();
    l.close();
  }
});

Deno.test("refused connections and failed accepts show in the transfer metrics", async () => {
  const before = Deno.env.get("PEGAFLOW_TCP_MAX_CONNS");
  Deno.env.set("PEGAFLOW_TCP_MAX_CONNS", "1");
  let node: LocalNode | undefined;
  const raw: Deno.Conn[] = [];
  try {
    node = new LocalNode(MiB, 5, { streams: 1 });
  } finally {
    if (before === undefined) Deno.env.delete("PEGAFLOW_TCP_MAX_CONNS");
    else Deno.env.set("PEGAFLOW_TCP_MAX_CONNS", before);
  }
  try {
    const registry = new Registry();
    registerTransferMetrics(registry, () => node.ep);
    const port = node.ep.info().port;
    assert.equal(typeof (await hello(port, raw)).answer, "object");
    const { answer } = await hello(port, raw);
    assert.ok(typeof answer === "object" && answer.op === TCP_OP.refuse, "the second is refused");
    const text = await registry.metrics();
    assert.match(text, /^pegaflow_transfer_refused_connections_total 1$/m);
    assert.match(text, /^pegaflow_transfer_accept_errors_total 0$/m);
  } finally {
    for (const c of raw) c.close();
    await node.close();
  }
});

Deno.test("a bad PEGAFLOW_TCP_MAX_CONNS is refused naming it", async () => {
  const before = Deno.env.get("PEGAFLOW_TCP_MAX_CONNS");
  const engine = Engine.open({ backend: "host" });
  const pool = engine.createPool(MiB);
  const ring = new CompletionRing(16);
  try {
    for (const bad of ["0", "65537", "-1", "2x"]) {
      Deno.env.set("PEGAFLOW_TCP_MAX_CONNS", bad);
      let opened: XferEndpoint | undefined;
      try {
        assert.throws(
          () => (opened = XferEndpoint.open({ transport: "tcp", pool, ring, streams: 1 })),
          new RegExp(`PEGAFLOW_TCP_MAX_CONNS "${bad}"; expected 1\\.\\.65536 \\(connections\\)`),
        );
      } finally {
        await opened?.close();
      }
    }
  } finally {
    if (before === undefined) Deno.env.delete("PEGAFLOW_TCP_MAX_CONNS");
    else Deno.env.set("PEGAFLOW_TCP_MAX_CONNS", before);
    await ring.shutdown();
    ring.destroy();
    pool.close();
    engine.close();
  }
});

Deno.test("an endpoint that cannot get its accept loop's wake-up descriptor fails to open", async () => {
  // One descriptor free: the listener takes it, and the accept loop's wake-up finds none.
  const spawned = spawnNode(
    { poolBytes: 4 * MiB, seed: 7, streams: 1, fdsLeftAtOpen: 1 },
    undefined,
    { nofile: 256, keepStderr: true },
  );
  const err = await spawned.then(
    async (node) => {
      await node.close();
      return undefined;
    },
    (e: Error) => e,
  );
  assert.ok(err, "the endpoint opened without its wake-up (a close would wait out a 1 s poll)");
  assert.match(err.message, /node exited/);
});
