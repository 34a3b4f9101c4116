/**
 * GoawayFilter (lib/server/goaway_guard.ts): over any split of a client's
 * HTTP/2 byte stream into chunks, the forwarded bytes are exactly the input
 * minus its GOAWAY frames (fast-check), and a non-HTTP/2 stream is relayed
 * untouched. The guard itself relays over real sockets, drops only client
 * GOAWAYs, and ends the server-side socket when the client closes.
 */
import assert from "node:assert/strict";
import fc from "fast-check";
import {
  FRAME_TYPE_GOAWAY,
  GoawayFilter,
  startGoawayGuard,
} from "../../lib/server/goaway_guard.ts";

const PREFACE = new TextEncoder().encode("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
const DATA = 0x0;
const HEADERS = 0x1;
const PING = 0x6;
const WINDOW_UPDATE = 0x8;

function frame(type: number, stream: number, payload: Uint8Array): Uint8Array {
  const f = new Uint8Array(9 + payload.length);
  f[0] = (payload.length >> 16) & 0xff;
  f[1] = (payload.length >> 8) & 0xff;
  f[2] = payload.length & 0xff;
  f[3] = type;
  f[4] = 0;
  new DataView(f.buffer).setUint32(5, stream);
  f.set(payload, 9);
  return f;
}

function concat(parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let o = 0;
  for (const p of parts) {
    out.set(p, o);
    o += p.length;
  }
  return out;
}

/** Splits `b` at the given cut points (sorted, deduplicated, inside bounds). */
function split(b: Uint8Array, cuts: number[]): Uint8Array[] {
  const pts = [...new Set(cuts.map((c) => c % (b.length + 1)))].sort((x, y) => x - y);
  const out: Uint8Array[] = [];
  let prev = 0;
  for (const p of [...pts, b.length]) {
    out.push(b.slice(prev, p));
    prev = p;
  }
  return out;
}

/** Runs the filter over chunks, copying each forwarded part before the next push (as the relay writes it). */
function run(f: GoawayFilter, chunks: Uint8Array[]): Uint8Array {
  const got: Uint8Array[] = [];
  for (const c of chunks) for (const p of f.push(c)) got.push(p.slice());
  return concat(got);
}

const frameArb = fc.record({
  type: fc.constantFrom(DATA, HEADERS, PING, WINDOW_UPDATE, FRAME_TYPE_GOAWAY),
  stream: fc.integer({ min: 0, max: 2 ** 31 - 1 }),
  payload: fc.uint8Array({ maxLength: 300 }),
});

Deno.test("any chunking: forwarded bytes = the stream without its GOAWAY frames", () => {
  fc.assert(
    fc.property(
      fc.array(frameArb, { maxLength: 12 }),
      fc.array(fc.nat(), { maxLength: 20 }),
      (frames, cuts) => {
        const all = frames.map((x) => frame(x.type, x.stream, x.payload));
        const input = concat([PREFACE, ...all]);
        const expected = concat([
          PREFACE,
          ...all.filter((_, i) => frames[i].type !== FRAME_TYPE_GOAWAY),
        ]);
        const f = new GoawayFilter();
        assert.deepEqual(run(f, split(input, cuts)), expected);
        assert.equal(f.goawaysDropped, frames.filter((x) => x.type === FRAME_TYPE_GOAWAY).length);
      },
    ),
    { numRuns: 400 },
  );
});

Deno.test("a GOAWAY split one byte per chunk is dropped; the frames around it pass", () => {
  const ping = frame(PING, 0, new Uint8Array(8).fill(7));
  const goaway = frame(FRAME_TYPE_GOAWAY, 0, new Uint8Array([0, 0, 0, 201, 0, 0, 0, 0]));
  const data = frame(DATA, 201, new Uint8Array([1, 2, 3]));
  const input = concat([PREFACE, ping, goaway, data]);
  const f = new GoawayFilter();
  const got = run(f, Array.from(input, (b) => new Uint8Array([b])));
  assert.deepEqual(got, concat([PREFACE, ping, data]));
  assert.equal(f.goawaysDropped, 1);
});

Deno.test("a stream that is not HTTP/2 prior knowledge is relayed byte for byte", () => {
  const http1 = new TextEncoder().encode("GET / HTTP/1.1\r\nhost: x\r\n\r\n");
  // Bytes that would parse as a GOAWAY frame header if the filter kept parsing.
  const tail = frame(FRAME_TYPE_GOAWAY, 0, new Uint8Array(8));
  const f = new GoawayFilter();
  assert.deepEqual(run(f, [http1, tail]), concat([http1, tail]));
  assert.equal(f.goawaysDropped, 0);
});

/** Reads from `c` until `n` bytes arrived or the peer closed; returns what came. */
async function readN(c: Deno.Conn, n: number): Promise<Uint8Array> {
  const parts: Uint8Array[] = [];
  let have = 0;
  const buf = new Uint8Array(4096);
  while (have < n) {
    const k = await c.read(buf);
    if (k === null) break;
    parts.push(buf.slice(0, k));
    have += k;
  }
  return concat(parts);
}

Deno.test("the guard relays both ways, drops the client's GOAWAY, and ends the upstream socket when the client closes", async () => {
  const upstream = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  let dropped = 0;
  const guard = startGoawayGuard({
    hostname: "127.0.0.1",
    port: 0,
    upstreamHostname: "127.0.0.1",
    upstreamPort: (upstream.addr as Deno.NetAddr).port,
    onGoawayDropped: () => dropped++,
  });
  const client = await Deno.connect({ hostname: "127.0.0.1", port: guard.port });
  const server = await upstream.accept();
  try {
    const ping = frame(PING, 0, new Uint8Array(8).fill(1));
    const goaway = frame(FRAME_TYPE_GOAWAY, 0, new Uint8Array(8));
    const data = frame(DATA, 1, new Uint8Array(1000).fill(9));
    await client.write(concat([PREFACE, ping, goaway, data]));
    const expected = concat([PREFACE, ping, data]);
    assert.deepEqual(await readN(server, expected.length), expected);
    assert.equal(dropped, 1);
    assert.equal(guard.connections, 1);

    // Server to client: relayed untouched, GOAWAY frames included.
    const reply = concat([frame(PING, 0, new Uint8Array(8).fill(2)), goaway]);
    await server.write(reply);
    assert.deepEqual(await readN(client, reply.length), reply);

    // The client's close reaches the server as a plain end of connection.
    client.close();
    assert.equal(await server.read(new Uint8Array(16)), null);
  } finally {
    server.close();
    await guard.close();
    upstream.close();
  }
  assert.equal(guard.connections, 0);
});

Deno.test("closing the guard ends the connections it relays", async () => {
  const upstream = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const guard = startGoawayGuard({
    hostname: "127.0.0.1",
    port: 0,
    upstreamHostname: "127.0.0.1",
    upstreamPort: (upstream.addr as Deno.NetAddr).port,
  });
  const client = await Deno.connect({ hostname: "127.0.0.1", port: guard.port });
  const server = await upstream.accept();
  try {
    await guard.close();
    assert.equal(await client.read(new Uint8Array(16)), null);
    assert.equal(await server.read(new Uint8Array(16)), null);
    await assert.rejects(Deno.connect({ hostname: "127.0.0.1", port: guard.port }));
  } finally {
    client.close();
    server.close();
    upstream.close();
  }
});

Deno.test("the guard on a Unix socket relays to the TCP upstream and drops the client's GOAWAY", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-guard-" });
  const path = `${dir}/g.sock`;
  const upstream = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  let dropped = 0;
  const guard = startGoawayGuard({
    path,
    upstreamHostname: "127.0.0.1",
    upstreamPort: (upstream.addr as Deno.NetAddr).port,
    onGoawayDropped: () => dropped++,
  });
  const client = await Deno.connect({ transport: "unix", path });
  const server = await upstream.accept();
  try {
    const ping = frame(PING, 0, new Uint8Array(8).fill(3));
    await client.write(concat([PREFACE, ping, frame(FRAME_TYPE_GOAWAY, 0, new Uint8Array(8))]));
    const expected = concat([PREFACE, ping]);
    assert.deepEqual(await readN(server, expected.length), expected);
    assert.equal(dropped, 1);
    const reply = frame(PING, 0, new Uint8Array(8).fill(4));
    await server.write(reply);
    assert.deepEqual(await readN(client, reply.length), reply);
    client.close();
    assert.equal(await server.read(new Uint8Array(16)), null);
  } finally {
    server.close();
    await guard.close();
    upstream.close();
    await Deno.remove(dir, { recursive: true });
  }
});
