/**
 * Test helper: transfer nodes for tests and benchmarks — a child process
 * running `_node.ts` (optionally inside a network namespace), and an
 * in-process node (this process's own pool, ring and endpoint).
 */
import { CompletionRing, Engine, type Pool } from "../../ffi/mod.ts";
import { XferEndpoint, type XferEndpointOptions } from "../../ffi/xfer.ts";
import { fillPattern } from "./_pattern.ts";

const NODE = decodeURIComponent(new URL("./_node.ts", import.meta.url).pathname);

/** A `_node.ts` child. */
export interface NodeProc {
  port: number;
  pid: number;
  proc: Deno.ChildProcess;
  /** Sends one command and returns its JSON answer (events are skipped). */
  cmd<T = Record<string, unknown>>(c: Record<string, unknown>): Promise<T>;
  /** Next `{"event": ...}` line. */
  event(): Promise<Record<string, unknown>>;
  /** Events received and not yet taken by {@link NodeProc.event}. */
  pendingEvents(): number;
  /** Closes stdin and waits for exit (or kills it if already signalled). */
  close(): Promise<Deno.CommandStatus>;
  /** Its stderr once it exited ("" unless spawned with `keepStderr`). */
  stderr(): Promise<string>;
}

/** How a node child runs, beyond its arguments. */
export interface SpawnOptions {
  /** Added to its environment (e.g. `PEGAFLOW_TCP_MAX_CONNS`). */
  env?: Record<string, string>;
  /** Its descriptor limit, soft and hard (`prlimit --nofile=N:N`: Deno cannot raise it). */
  nofile?: number;
  /** Keep its stderr for {@link NodeProc.stderr} instead of passing it through. */
  keepStderr?: boolean;
}

/** Starts a node child; `netns` runs it inside that network namespace. */
export async function spawnNode(
  args: {
    poolBytes: number;
    seed: number;
    streams?: number;
    bindAddr?: string;
    fill?: boolean;
    /** Open its endpoint with only this many descriptors free (run it with `nofile`). */
    fdsLeftAtOpen?: number;
  },
  netns?: string,
  opts: SpawnOptions = {},
): Promise<NodeProc> {
  let argv = [Deno.execPath(), "run", "-A", NODE, JSON.stringify(args)];
  if (opts.nofile) argv = ["prlimit", `--nofile=${opts.nofile}:${opts.nofile}`, ...argv];
  if (netns) argv = ["ip", "netns", "exec", netns, ...argv];
  const proc = new Deno.Command(argv[0], {
    args: argv.slice(1),
    env: opts.env,
    stdin: "piped",
    stdout: "piped",
    stderr: opts.keepStderr ? "piped" : "inherit",
  }).spawn();
  const stderr = opts.keepStderr ? new Response(proc.stderr).text() : Promise.resolve("");
  const reader = proc.stdout.pipeThrough(new TextDecoderStream()).getReader();
  const writer = proc.stdin.getWriter();
  let buf = "";
  const answers: Record<string, unknown>[] = [];
  const events: Record<string, unknown>[] = [];
  let waiting: (() => void) | undefined;
  let eof = false;
  (async () => {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      for (let nl = buf.indexOf("\n"); nl >= 0; nl = buf.indexOf("\n")) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        const o = JSON.parse(line) as Record<string, unknown>;
        (o.event ? events : answers).push(o);
        waiting?.();
      }
    }
    eof = true;
    waiting?.();
  })();
  async function next(q: Record<string, unknown>[]): Promise<Record<string, unknown>> {
    while (q.length === 0) {
      if (eof) throw new Error("node exited");
      await new Promise<void>((r) => (waiting = r));
    }
    return q.shift()!;
  }
  const hello = await next(answers);
  const enc = new TextEncoder();
  return {
    port: hello.port as number,
    pid: hello.pid as number,
    proc,
    async cmd<T>(c: Record<string, unknown>) {
      await writer.write(enc.encode(JSON.stringify(c) + "\n"));
      const a = await next(answers);
      if (a.error) throw new Error(`node: ${a.error}`);
      return a as T;
    },
    event: () => next(events),
    pendingEvents: () => events.length,
    async close() {
      try {
        await writer.close();
      } catch {
        // stdin already gone: the child was killed
      }
      return await proc.status;
    },
    stderr: () => stderr,
  };
}

/** This process's own node: engine, pool (seeded pattern), ring, endpoint. */
export class LocalNode {
  readonly engine: Engine;
  readonly pool: Pool;
  readonly ring: CompletionRing;
  readonly ep: XferEndpoint;
  readonly mem: Uint8Array;

  constructor(
    poolBytes: number,
    seed: number,
    opts: Partial<Omit<XferEndpointOptions, "pool" | "ring">> = {},
    ringCapacity = 4096,
  ) {
    this.engine = Engine.open({ backend: "host" });
    this.pool = this.engine.createPool(poolBytes, { pretouch: true });
    this.ring = new CompletionRing(ringCapacity);
    this.mem = this.pool.view(0, poolBytes);
    fillPattern(this.mem, 0, poolBytes, seed);
    this.ep = XferEndpoint.open({
      transport: "tcp",
      streams: 4,
      ...opts,
      pool: this.pool,
      ring: this.ring,
    });
  }

  async close(): Promise<void> {
    await this.ep.close();
    await this.ring.shutdown();
    this.ring.destroy();
    this.pool.close();
    this.engine.close();
  }
}

/**
 * SIGSTOPs `pid` and waits until every thread of it is stopped (the signal
 * is asynchronous: a serving thread on another core may still answer a
 * request or two before it takes effect).
 */
export async function stopProcess(pid: number): Promise<void> {
  Deno.kill(pid, "SIGSTOP");
  for (let i = 0; i < 500; i++) {
    let running = false;
    for await (const t of Deno.readDir(`/proc/${pid}/task`)) {
      const stat = await Deno.readTextFile(`/proc/${pid}/task/${t.name}/stat`).catch(() => "");
      const state = stat.slice(stat.lastIndexOf(")") + 2, stat.lastIndexOf(")") + 3);
      if (state !== "T" && state !== "t" && state !== "") running = true;
    }
    if (!running) return;
    await new Promise((r) => setTimeout(r, 2));
  }
  throw new Error(`process ${pid} did not stop`);
}

/** Runs `ip` and throws with its stderr on failure. */
export async function ip(...args: string[]): Promise<void> {
  const r = await new Deno.Command("ip", { args, stdout: "null", stderr: "piped" }).output();
  if (!r.success) {
    throw new Error(`ip ${args.join(" ")}: ${new TextDecoder().decode(r.stderr).trim()}`);
  }
}

/** Two namespaces joined by a veth pair, addresses 10.<n>.0.1 and .2. */
export interface NetnsPair {
  a: string;
  b: string;
  addrA: string;
  addrB: string;
  remove(): Promise<void>;
}

/**
 * Creates the namespace pair (names carry this process's pid so parallel
 * runs never collide), or returns the reason it could not.
 */
export async function makeNetnsPair(tag: string): Promise<NetnsPair | string> {
  const id = `${tag}${Deno.pid}`;
  const a = `pfa${id}`, b = `pfb${id}`, va = `va${id}`.slice(0, 15), vb = `vb${id}`.slice(0, 15);
  const octet = 16 + (Deno.pid % 200);
  const addrA = `10.${octet}.0.1`, addrB = `10.${octet}.0.2`;
  const remove = async () => {
    for (const ns of [a, b]) {
      await new Deno.Command("ip", { args: ["netns", "del", ns], stdout: "null", stderr: "null" })
        .output();
    }
  };
  try {
    await ip("netns", "add", a);
    await ip("netns", "add", b);
    await ip("link", "add", va, "type", "veth", "peer", "name", vb);
    await ip("link", "set", va, "netns", a);
    await ip("link", "set", vb, "netns", b);
    await ip("-n", a, "addr", "add", `${addrA}/24`, "dev", va);
    await ip("-n", b, "addr", "add", `${addrB}/24`, "dev", vb);
    for (const [ns, dev] of [[a, va], [b, vb]]) {
      await ip("-n", ns, "link", "set", dev, "up");
      await ip("-n", ns, "link", "set", "lo", "up");
    }
    return { a, b, addrA, addrB, remove };
  } catch (e) {
    await remove();
    return (e as Error).message;
  }
}

/** A listener that takes connections and never reads or writes a byte (no hello ever comes). */
export function silentListener(): { addr: string; close: () => void } {
  const l = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const conns: Deno.Conn[] = [];
  (async () => {
    for await (const c of l) conns.push(c);
  })().catch(() => {}); // ends with BadResource when closed below
  return {
    addr: `127.0.0.1:${(l.addr as Deno.NetAddr).port}`,
    close: () => {
      l.close();
      for (const c of conns) c.close();
    },
  };
}

/** The TCP transport's frame ops (csrc/pf_tcp.c's wire format), for hand-made frames. */
export const TCP_OP = { hello: 1, read: 2, write: 3, blast: 7, refuse: 8 } as const;

/** A 40-byte frame header as a client sends it (slot 1, gen 1; a HELLO carries the version). */
export function tcpFrame(op: number, nseg = 0, bytes = 0): Uint8Array {
  const f = new DataView(new ArrayBuffer(40));
  f.setUint32(0, 0x31584650, true); // "PFX1"
  f.setUint16(4, op, true);
  f.setUint32(8, 1, true); // slot
  f.setUint32(12, 1, true); // gen
  f.setUint32(20, nseg, true);
  f.setBigUint64(24, BigInt(bytes), true);
  f.setUint32(32, op === TCP_OP.hello ? 1 : 0, true); // HELLO: protocol version
  return new Uint8Array(f.buffer);
}

/** A frame header as the server sent it. */
export interface TcpFrameHeader {
  op: number;
  status: number;
  bytes: number;
  aux: number;
}

/**
 * The next frame header on a raw connection: "closed" if the server closed it first, "open" if
 * nothing came within `ms` (a deadline: a test that fails must not hang).
 */
export async function nextFrame(
  conn: Deno.Conn,
  ms: number,
): Promise<TcpFrameHeader | "closed" | "open"> {
  const buf = new Uint8Array(40);
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<"open">((r) => (timer = setTimeout(() => r("open"), ms)));
  try {
    for (let got = 0; got < 40;) {
      const read = conn.read(buf.subarray(got)).catch((e) => {
        if (e instanceof Deno.errors.ConnectionReset) return null; // closed with our bytes unread
        throw e;
      });
      const k = await Promise.race([read, late]);
      if (k === "open") return k;
      if (k === null) return "closed";
      got += k;
    }
  } finally {
    clearTimeout(timer);
  }
  const v = new DataView(buf.buffer);
  return {
    op: v.getUint16(4, true),
    status: v.getInt16(6, true),
    bytes: Number(v.getBigUint64(24, true)),
    aux: v.getUint32(32, true),
  };
}
