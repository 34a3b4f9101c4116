/**
 * Test helper: one transfer "node" process — its own host-backend pool
 * filled with a seeded pattern, a TCP endpoint serving it, and a JSON-lines
 * command loop on stdin (one JSON answer per command on stdout). Run it as
 * `deno run -A _node.ts '{"poolBytes":..,"seed":..}'`; it prints
 * `{"port":N,"pid":P}` once it listens and exits when stdin closes.
 *
 * Commands: connect {addr, timeoutMs}; read/write {segs:[[remote,local,bytes]],
 * timeoutMs, imm?, op?} → {status, statusName, ns}; verify {segs, seed} →
 * {bad: first mismatching local offset or -1}; get {off, len} → {hex};
 * fill {off, len, byte}; watch {off, len} (an immediate then prints
 * {imm, sum} with a checksum of that range taken when it arrived); info;
 * hogFds (opens /dev/null until the descriptor limit: {held}); freeFds (closes
 * them, and those held since `fdsLeftAtOpen`).
 */
import { CompletionRing, Engine } from "../../ffi/mod.ts";
import { tcpBlast, XferBatch, XferEndpoint, type XferOp, type XferPeer } from "../../ffi/xfer.ts";
import { checksum, fillPattern, firstMismatch, type Seg } from "./_pattern.ts";

interface Args {
  poolBytes: number;
  seed: number;
  streams?: number;
  bindAddr?: string;
  stripeBytes?: number;
  /** false: leave the pool zeroed (benchmarks; filling GBs in JS takes seconds). */
  fill?: boolean;
  /** Open the endpoint with only this many descriptors free (the rest held as by hogFds). */
  fdsLeftAtOpen?: number;
}

const hogged: Deno.FsFile[] = [];
/** Opens /dev/null until the descriptor limit, then gives `leave` back; how many it holds. */
function hogFds(leave: number): number {
  // Deno sets up its signal handling lazily and panics if that finds no descriptor free:
  // a listener makes it do so now.
  Deno.addSignalListener("SIGUSR2", () => {});
  try {
    for (;;) hogged.push(Deno.openSync("/dev/null"));
  } catch (e) {
    if (!/Too many open files/.test((e as Error).message)) throw e;
  }
  for (const f of hogged.splice(0, leave)) f.close();
  return hogged.length;
}

const args = JSON.parse(Deno.args[0]) as Args;
const engine = Engine.open({ backend: "host" });
const pool = engine.createPool(args.poolBytes, { pretouch: true });
const ring = new CompletionRing(4096);
const mem = pool.view(0, pool.bytes);
if (args.fill !== false) fillPattern(mem, 0, mem.length, args.seed);
if (args.fdsLeftAtOpen !== undefined) hogFds(args.fdsLeftAtOpen);
const ep = XferEndpoint.open({
  transport: "tcp",
  pool,
  ring,
  streams: args.streams ?? 4,
  bindAddr: args.bindAddr,
  stripeBytes: args.stripeBytes,
});
let watch: { off: number; len: number } | undefined;
const out = (o: unknown) => console.log(JSON.stringify(o));
ep.imm$.subscribe((m) => {
  out({
    event: "imm",
    imm: m.imm,
    bytes: m.bytes,
    sum: watch ? checksum(mem, watch.off, watch.len) : 0,
  });
});
out({ port: ep.info().port, pid: Deno.pid });

let peer: XferPeer | undefined;
const batch = new XferBatch(1 << 16);

type Cmd = {
  cmd: string;
  addr?: string;
  timeoutMs?: number;
  segs?: Seg[];
  op?: XferOp;
  imm?: number;
  seed?: number;
  off?: number;
  len?: number;
  byte?: number;
  streams?: number;
  bytes?: number;
  segBytes?: number;
  repeat?: number;
  wide?: boolean;
};

async function handle(c: Cmd): Promise<unknown> {
  switch (c.cmd) {
    case "connect": {
      peer = ep.createPeer();
      await peer.connect(c.addr!, c.timeoutMs ?? 5000);
      return { ok: true, remoteBytes: peer.state().remoteBytes };
    }
    case "xfer": {
      batch.reset(c.op ?? "read", c.timeoutMs ?? 10_000, c.imm ?? 0);
      for (const [r, l, b] of c.segs!) batch.seg(r, l, b);
      const res = await peer!.submit(batch);
      return { status: res.status, statusName: res.statusName, ns: res.ns };
    }
    case "bench": {
      // `repeat` READs of `bytes` in `segBytes` segments (remote and local
      // strided by twice the segment so nothing merges); ns per batch.
      const n = Math.floor(c.bytes! / c.segBytes!);
      const big = new XferBatch(n);
      const ns: number[] = [];
      for (let i = 0; i < c.repeat!; i++) {
        big.reset("read", 120_000);
        for (let k = 0; k < n; k++) big.seg(2 * k * c.segBytes!, 2 * k * c.segBytes!, c.segBytes!);
        const t0 = performance.now();
        const res = await peer!.submit(big);
        if (res.status !== 0) throw new Error(`bench batch failed: ${res.statusName}`);
        ns.push((performance.now() - t0) * 1e6);
      }
      return { ns, bytes: n * c.segBytes! };
    }
    case "blast": {
      const ns: number[] = [];
      for (let i = 0; i < c.repeat!; i++) {
        ns.push(
          await tcpBlast(
            c.addr!,
            c.streams!,
            Math.floor(c.bytes! / c.streams!),
            c.timeoutMs ?? 120_000, // the bench batches' deadline
            { pool: c.wide ? pool : undefined },
          ),
        );
      }
      return { ns, bytes: Math.floor(c.bytes! / c.streams!) * c.streams! };
    }
    case "verify":
      return { bad: firstMismatch(mem, c.segs!, c.seed!) };
    case "get":
      return {
        hex: Array.from(
          mem.subarray(c.off!, c.off! + c.len!),
          (b) => b.toString(16).padStart(2, "0"),
        ).join(""),
      };
    case "fill":
      mem.fill(c.byte!, c.off!, c.off! + c.len!);
      return { ok: true };
    case "watch":
      watch = { off: c.off!, len: c.len! };
      return { ok: true };
    case "info":
      return ep.info();
    case "hogFds":
      return { held: hogFds(0) };
    case "freeFds":
      for (const f of hogged.splice(0)) f.close();
      return { ok: true };
    default:
      throw new Error(`unknown command ${c.cmd}`);
  }
}

const lines = Deno.stdin.readable.pipeThrough(new TextDecoderStream());
let buf = "";
for await (const chunk of lines) {
  buf += chunk;
  for (let nl = buf.indexOf("\n"); nl >= 0; nl = buf.indexOf("\n")) {
    const line = buf.slice(0, nl);
    buf = buf.slice(nl + 1);
    if (!line.trim()) continue;
    try {
      out(await handle(JSON.parse(line) as Cmd));
    } catch (e) {
      out({ error: (e as Error).message });
    }
  }
}
await ep.close();
await ring.shutdown();
ring.destroy();
pool.close();
engine.close();
