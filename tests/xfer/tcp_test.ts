/**
 * The TCP transport between two processes, each with its own pool: this
 * test process (initiator) and a `_node.ts` child (server), on loopback.
 */
import assert from "node:assert/strict";
import fc from "fast-check";
import { NativeError } from "../../ffi/mod.ts";
import { tcpBlast, XferBatch, type XferPeer } from "../../ffi/xfer.ts";
import { LocalNode, type NodeProc, spawnNode, stopProcess } from "./_harness.ts";
import { checksum, firstMismatch, patternByte, type Seg } from "./_pattern.ts";
import { crc32c } from "../../lib/ssd/format.ts";

const MiB = 1 << 20;
const SEED_A = 0x5eed_a;
const SEED_B = 0x5eed_b;
const CANARY = 0xee;

async function pair(
  poolA: number,
  poolB: number,
  streams = 4,
  stripeBytes?: number,
): Promise<{ a: NodeProc; b: LocalNode; peer: XferPeer }> {
  const a = await spawnNode({ poolBytes: poolA, seed: SEED_A, streams });
  const b = new LocalNode(poolB, SEED_B, { streams, stripeBytes });
  const peer = b.ep.createPeer();
  await peer.connect(`127.0.0.1:${a.port}`, 5000);
  return { a, b, peer };
}

async function teardown(a: NodeProc, b: LocalNode): Promise<void> {
  await b.close();
  await a.close();
}

function submit(peer: XferPeer, batch: XferBatch, segs: Seg[]) {
  for (const [r, l, n] of segs) batch.seg(r, l, n);
  return peer.submit(batch);
}

Deno.test("a READ of many random segments lands every byte and nothing else", async () => {
  const { a, b, peer } = await pair(32 * MiB, 32 * MiB);
  const batch = new XferBatch(4096);
  try {
    assert.equal(peer.state().remoteBytes, 32 * MiB);
    await fc.assert(
      fc.asyncProperty(
        fc.array(
          fc.record({
            bytes: fc.integer({ min: 1, max: 96 * 1024 }),
            gap: fc.integer({ min: 0, max: 4096 }),
            remote: fc.nat({ max: 32 * MiB - 96 * 1024 }),
          }),
          { minLength: 1, maxLength: 300 },
        ),
        async (specs) => {
          // Local ranges are laid out one after another with gaps of canary.
          const segs: Seg[] = [];
          let l = 0;
          for (const s of specs) {
            l += s.gap;
            segs.push([s.remote, l, s.bytes]);
            l += s.bytes;
          }
          b.mem.fill(CANARY, 0, l + 4096);
          const res = await submit(peer, batch.reset("read", 20_000), segs);
          assert.equal(res.statusName, "PF_OK");
          assert.equal(firstMismatch(b.mem, segs, SEED_A), -1);
          let cursor = 0;
          for (const [, lo, n] of segs) {
            for (let k = cursor; k < lo; k++) assert.equal(b.mem[k], CANARY, `gap byte ${k}`);
            cursor = lo + n;
          }
          for (let k = cursor; k < cursor + 4096; k++) assert.equal(b.mem[k], CANARY);
        },
      ),
      { numRuns: 25 },
    );
  } finally {
    await teardown(a, b);
  }
});

Deno.test("one long segment is striped over every stream and lands in order", async () => {
  const { a, b, peer } = await pair(64 * MiB, 64 * MiB, 4, 256 * 1024);
  try {
    const segs: Seg[] = [[3 * MiB + 12, 5, 40 * MiB + 7]];
    b.mem.fill(0, 0, 48 * MiB);
    const res = await submit(peer, new XferBatch(4).reset("read", 30_000), segs);
    assert.equal(res.statusName, "PF_OK");
    // 160 stripes of 256 KiB over 4 streams: one frame per stream.
    assert.equal(res.parts, 4);
    assert.equal(firstMismatch(b.mem, segs, SEED_A), -1);
    assert.equal(b.mem[4], 0);
    assert.equal(b.mem[5 + 40 * MiB + 7], 0);
  } finally {
    await teardown(a, b);
  }
});

Deno.test("a READ with checksum groups hands back each group's CRC32C as its bytes landed", async () => {
  // Small stripes: a group's bytes are cut over several streams and combined in order.
  const { a, b, peer } = await pair(8 * MiB, 8 * MiB, 4, 4096);
  const batch = new XferBatch(512, 512);
  try {
    await fc.assert(
      fc.asyncProperty(
        fc.array(
          fc.record({
            bytes: fc.integer({ min: 1, max: 40_000 }),
            // Adjacent on both sides half the time: the transport merges such
            // segments, but never across a group boundary.
            adjacent: fc.boolean(),
            remote: fc.nat({ max: 8 * MiB - 40_000 }),
          }),
          { minLength: 1, maxLength: 60 },
        ),
        fc.array(fc.double({ min: 0, max: 1, noNaN: true }), { maxLength: 40 }),
        async (specs, cutsAt) => {
          const segs: Seg[] = [];
          let l = 0;
          for (const s of specs) {
            const prev = segs[segs.length - 1];
            const r = s.adjacent && prev && prev[0] + prev[2] + s.bytes <= 8 * MiB
              ? prev[0] + prev[2]
              : s.remote;
            if (!s.adjacent) l += 512;
            segs.push([r, l, s.bytes]);
            l += s.bytes;
          }
          const total = segs.reduce((n, sg) => n + sg[2], 0);
          // Group boundaries anywhere in the payload, inside segments too.
          const cuts = [...new Set(cutsAt.map((c) => Math.floor(c * total)))]
            .filter((c) => c > 0 && c < total).sort((x, y) => x - y);
          const bounds = [0, ...cuts, total];
          batch.reset("read", 20_000);
          for (const [r, lo, n] of segs) batch.seg(r, lo, n);
          for (let g = 0; g + 1 < bounds.length; g++) batch.group(bounds[g + 1] - bounds[g]);
          const res = await peer.submit(batch);
          assert.equal(res.statusName, "PF_OK");
          assert.equal(firstMismatch(b.mem, segs, SEED_A), -1);
          const payload = new Uint8Array(total);
          let p = 0;
          for (const [, lo, n] of segs) payload.set(b.mem.subarray(lo, lo + n), (p += n) - n);
          assert.ok(res.crcs, "checksums handed back");
          assert.equal(res.crcs.length, bounds.length - 1);
          for (let g = 0; g + 1 < bounds.length; g++) {
            assert.equal(
              res.crcs[g],
              crc32c(payload.subarray(bounds[g], bounds[g + 1])),
              `group ${g} [${bounds[g]}, ${bounds[g + 1]})`,
            );
          }
        },
      ),
      { numRuns: 30 },
    );
    // Without groups there is nothing to hand back.
    const plain = await peer.submit(new XferBatch(1).reset("read", 5000).seg(0, 0, 4096));
    assert.equal(plain.crcs, undefined);
  } finally {
    await teardown(a, b);
  }
});

Deno.test("batches in flight together on one peer all complete with their own bytes", async () => {
  const { a, b, peer } = await pair(16 * MiB, 16 * MiB, 3, 64 * 1024);
  try {
    const batches = Array.from({ length: 24 }, () => new XferBatch(64));
    const segsOf = (i: number): Seg[] =>
      Array.from(
        { length: 16 },
        (_, k) => [((i * 37 + k * 101) % 200) * 65536 + k, (i * 16 + k) * 40_000, 40_000 - k],
      );
    const results = await Promise.all(
      batches.map((bt, i) => submit(peer, bt.reset("read", 20_000), segsOf(i))),
    );
    for (let i = 0; i < results.length; i++) {
      assert.equal(results[i].statusName, "PF_OK");
      assert.equal(firstMismatch(b.mem, segsOf(i), SEED_A), -1, `batch ${i}`);
    }
    assert.equal(b.ep.info().ok, 24);
  } finally {
    await teardown(a, b);
  }
});

Deno.test("a WRITE lands every byte in the peer's pool", async () => {
  const { a, b, peer } = await pair(16 * MiB, 16 * MiB);
  try {
    const segs: Seg[] = [];
    for (let i = 0; i < 200; i++) {
      segs.push([i * 70_000 + (i % 7), (i * 53_000) % (15 * MiB), 1 + ((i * 7919) % 65_000)]);
    }
    const res = await submit(peer, new XferBatch(256).reset("write", 20_000), segs);
    assert.equal(res.statusName, "PF_OK");
    // On A, offset r now holds B's pattern from offset l.
    const swapped = segs.map(([r, l, n]) => [l, r, n] as Seg);
    const v = await a.cmd<{ bad: number }>({ cmd: "verify", segs: swapped, seed: SEED_B });
    assert.equal(v.bad, -1);
    const info = await a.cmd<{ bytesLanded: number }>({ cmd: "info" });
    assert.equal(info.bytesLanded, segs.reduce((s, x) => s + x[2], 0));
  } finally {
    await teardown(a, b);
  }
});

Deno.test("WRITE_IMM delivers its immediate after every byte of the batch is in place", async () => {
  const { a, b, peer } = await pair(64 * MiB, 64 * MiB, 4, 128 * 1024);
  try {
    // 32 MiB assembled at A's [8 MiB, 40 MiB) from 512 scattered 64 KiB pieces of B.
    const target = 8 * MiB, piece = 64 * 1024, n = 512;
    const segs: Seg[] = [];
    const expected = new Uint8Array(n * piece);
    for (let i = 0; i < n; i++) {
      const l = ((i * 331) % 900) * piece;
      segs.push([target + i * piece, l, piece]);
      expected.set(b.mem.subarray(l, l + piece), i * piece);
    }
    await a.cmd({ cmd: "fill", off: target, len: n * piece, byte: 0 });
    await a.cmd({ cmd: "watch", off: target, len: n * piece });
    const res = await submit(peer, new XferBatch(n).reset("write_imm", 30_000, 0xc0ffee), segs);
    assert.equal(res.statusName, "PF_OK");
    const ev = await a.event();
    assert.equal(ev.imm, 0xc0ffee);
    assert.equal(ev.bytes, n * piece);
    // The checksum A took when the immediate arrived covers the whole batch.
    assert.equal(ev.sum, checksum(expected, 0, expected.length));
  } finally {
    await teardown(a, b);
  }
});

Deno.test("a segment outside the remote pool is refused before anything moves", async () => {
  const { a, b, peer } = await pair(4 * MiB, 8 * MiB);
  try {
    b.mem.fill(CANARY, 0, 1 * MiB);
    const batch = new XferBatch(4).reset("read", 5000).seg(0, 0, 4096).seg(4 * MiB - 10, 8192, 11);
    assert.throws(() => peer.submit(batch), (e: unknown) => {
      assert.ok(e instanceof NativeError);
      assert.equal(e.codeName, "PF_ERANGE");
      assert.match(
        e.message,
        /segment 1: remote_off 4194294 \+ bytes 11 exceeds the remote pool's 4194304 bytes/,
      );
      return true;
    });
    const local = new XferBatch(1).reset("read", 5000).seg(0, 8 * MiB - 1, 2);
    assert.throws(
      () => peer.submit(local),
      /segment 0: local_off 8388607 \+ bytes 2 exceeds the local pool/,
    );
    assert.ok(b.mem.subarray(0, MiB).every((x) => x === CANARY));
    assert.equal(b.ep.info().submitted, 0);
  } finally {
    await teardown(a, b);
  }
});

Deno.test("malformed batches name what is wrong", async () => {
  const { a, b, peer } = await pair(MiB, MiB);
  try {
    assert.throws(() => peer.submit(new XferBatch(1).reset("read", 5000)), /num_segs 0/);
    assert.throws(
      () => peer.submit(new XferBatch(1).reset("read", 0).seg(0, 0, 1)),
      /timeout_ms 0/,
    );
    assert.throws(
      () => peer.submit(new XferBatch(1).reset("read", 10).seg(0, 0, 0)),
      /segment 0 has 0 bytes/,
    );
    assert.throws(
      () => peer.submit(new XferBatch(1).reset("write", 10, 5).seg(0, 0, 1)),
      /imm is only for write_imm/,
    );
    assert.throws(
      () => peer.submit(new XferBatch(1, 1).reset("write", 10).seg(0, 0, 8).group(8)),
      /checksum groups are for read batches/,
    );
    assert.throws(
      () => peer.submit(new XferBatch(1, 2).reset("read", 10).seg(0, 0, 8).group(4).group(3)),
      /checksum groups cover 7 bytes; the segments 8/,
    );
    assert.throws(
      () => peer.submit(new XferBatch(1, 2).reset("read", 10).seg(0, 0, 8).group(0).group(8)),
      /checksum group 0 of 0 bytes/,
    );
    assert.throws(
      () => peer.submit(new XferBatch(1, 1).reset("read", 10).seg(0, 0, 8).group(9)),
      /checksum group 0 of 9 bytes/,
    );
    const unconnected = b.ep.createPeer();
    assert.throws(
      () => unconnected.submit(new XferBatch(1).reset("read", 10).seg(0, 0, 1)),
      /is not connected/,
    );
    await unconnected.close();
  } finally {
    await teardown(a, b);
  }
});

Deno.test("the serving side refuses out-of-range segments from a peer that lies about its pool", async () => {
  const a = await spawnNode({ poolBytes: MiB, seed: SEED_A });
  const conn = await Deno.connect({ hostname: "127.0.0.1", port: a.port });
  try {
    const frame = (op: number, nseg: number, bytes: number, slot = 1) => {
      const f = new DataView(new ArrayBuffer(40));
      f.setUint32(0, 0x31584650, true);
      f.setUint16(4, op, true);
      f.setUint32(8, slot, true);
      f.setUint32(12, 7, true);
      f.setUint32(20, nseg, true);
      f.setBigUint64(24, BigInt(bytes), true);
      f.setUint32(32, op === 1 ? 1 : 0, true);
      return new Uint8Array(f.buffer);
    };
    const segs = (list: [number | bigint, number][]) => {
      const d = new DataView(new ArrayBuffer(16 * list.length));
      list.forEach(([o, n], i) => {
        d.setBigUint64(16 * i, BigInt(o), true);
        d.setBigUint64(16 * i + 8, BigInt(n), true);
      });
      return new Uint8Array(d.buffer);
    };
    const readExactly = async (n: number) => {
      const out = new Uint8Array(n);
      let got = 0;
      while (got < n) {
        const k = await conn.read(out.subarray(got));
        assert.ok(k !== null, "server closed the connection");
        got += k;
      }
      return new DataView(out.buffer);
    };
    await conn.write(frame(1, 0, 0)); // HELLO
    const hello = await readExactly(40);
    assert.equal(hello.getBigUint64(24, true), BigInt(MiB));
    // READ: one in range, one past the end.
    await conn.write(frame(2, 2, 0));
    await conn.write(segs([[0, 16], [MiB - 8, 16]]));
    const r = await readExactly(40);
    assert.equal(r.getUint16(4, true), 5); // READ_RESP
    assert.equal(r.getInt16(6, true), -3); // PF_ERANGE
    assert.equal(r.getBigUint64(24, true), 0n); // no bytes follow
    // WRITE: in range [100, 116) and a wrapping offset; nothing may land.
    const before = await a.cmd<{ hex: string }>({ cmd: "get", off: 100, len: 16 });
    await conn.write(frame(3, 2, 32, 2));
    await conn.write(segs([[100, 16], [2n ** 64n - 8n, 16]])); // off + bytes wraps
    await conn.write(new Uint8Array(32).fill(0xab));
    const w = await readExactly(40);
    assert.equal(w.getUint16(4, true), 6); // ACK
    assert.equal(w.getInt16(6, true), -3);
    const after = await a.cmd<{ hex: string }>({ cmd: "get", off: 100, len: 16 });
    assert.equal(after.hex, before.hex);
    const info = await a.cmd<{ bytesLanded: number; bytesServed: number }>({ cmd: "info" });
    assert.equal(info.bytesLanded, 0);
    assert.equal(info.bytesServed, 0);
  } finally {
    conn.close();
    await a.close();
  }
});

Deno.test("a batch whose peer stops answering times out and its late bytes never land", async () => {
  const { a, b, peer } = await pair(256 * MiB, 256 * MiB, 2);
  try {
    const segs: Seg[] = [[0, 0, 192 * MiB]];
    b.mem.fill(0, 0, 192 * MiB);
    const pending = submit(peer, new XferBatch(1).reset("read", 300), segs);
    Deno.kill(a.pid, "SIGSTOP"); // frozen before it can send 192 MiB
    const res = await pending;
    assert.equal(res.statusName, "PF_ETIMEDOUT");
    // The caller owns the range again: it reuses it (a canary), then the peer wakes.
    b.mem.fill(CANARY, 0, 192 * MiB);
    Deno.kill(a.pid, "SIGCONT");
    // At once, a batch striped over both streams. It takes the slot the
    // timed-out batch just freed (the free list is LIFO) with the next
    // generation, and its responses queue behind the late ones on each
    // stream: the late bytes arrive while their slot holds a live batch, and
    // must land neither there nor in the canary.
    const probe: Seg[] = [[0, 192 * MiB, 2 * MiB]];
    const small = await submit(peer, new XferBatch(1).reset("read", 30_000), probe);
    assert.equal(small.statusName, "PF_OK");
    assert.equal(small.parts, 2);
    assert.equal(firstMismatch(b.mem, probe, SEED_A), -1);
    const info = b.ep.info();
    assert.equal(info.timedOut, 1);
    assert.ok(info.lateBytes > 0, "the late response was discarded, not absent");
    const firstBad = b.mem.subarray(0, 192 * MiB).findIndex((x) => x !== CANARY);
    assert.equal(firstBad, -1, `late byte written at ${firstBad}`);
  } finally {
    try {
      Deno.kill(a.pid, "SIGCONT");
    } catch { /* already gone */ }
    await teardown(a, b);
  }
});

Deno.test("a short deadline submitted behind a long one still ends at its own deadline", async () => {
  // The timer sleeps until the earliest deadline it saw (30 s here): the
  // second submit must wake it, or its 200 ms batch would wait out 30 s.
  const { a, b, peer } = await pair(64 * MiB, 64 * MiB, 2);
  try {
    await stopProcess(a.pid);
    const long = submit(peer, new XferBatch(1).reset("read", 30_000), [[0, 0, 32 * MiB]]);
    const t0 = performance.now();
    const short = await submit(peer, new XferBatch(1).reset("read", 200), [[0, 32 * MiB, MiB]]);
    const ms = performance.now() - t0;
    assert.equal(short.statusName, "PF_ETIMEDOUT");
    assert.ok(ms >= 199 && ms < 2_000, `the 200 ms batch ended after ${ms.toFixed(0)} ms`);
    Deno.kill(a.pid, "SIGCONT");
    const res = await long;
    assert.equal(res.statusName, "PF_OK");
    assert.equal(firstMismatch(b.mem, [[0, 0, 32 * MiB]], SEED_A), -1);
  } finally {
    try {
      Deno.kill(a.pid, "SIGCONT");
    } catch { /* already gone */ }
    await teardown(a, b);
  }
});

/** Context switches of `pid`'s thread named `name` (one such thread expected). */
async function threadSwitches(pid: number, name: string): Promise<number> {
  const found: number[] = [];
  for await (const t of Deno.readDir(`/proc/${pid}/task`)) {
    const dir = `/proc/${pid}/task/${t.name}`;
    const comm = (await Deno.readTextFile(`${dir}/comm`).catch(() => "")).trim();
    if (comm !== name) continue;
    const status = await Deno.readTextFile(`${dir}/status`);
    const n = (key: string) => Number(status.match(new RegExp(`^${key}:\\s+(\\d+)`, "m"))?.[1]);
    found.push(n("voluntary_ctxt_switches") + n("nonvoluntary_ctxt_switches"));
  }
  assert.equal(found.length, 1, `process ${pid} has ${found.length} threads named ${name}`);
  return found[0];
}

Deno.test("an endpoint with nothing in flight has a sleeping deadline timer", async () => {
  const { a, b, peer } = await pair(8 * MiB, 8 * MiB, 2);
  try {
    // A serves a READ (its timer never arms: A submits nothing), then idles.
    const res = await submit(peer, new XferBatch(1).reset("read", 5_000), [[0, 0, MiB]]);
    assert.equal(res.statusName, "PF_OK");
    const before = await threadSwitches(a.pid, "pf-xfer-timer");
    await new Promise((r) => setTimeout(r, 500));
    const after = await threadSwitches(a.pid, "pf-xfer-timer");
    // A timer that ticked every 5 ms would have woken ~100 times.
    assert.ok(after - before <= 2, `the idle timer woke ${after - before} times in 500 ms`);
  } finally {
    await teardown(a, b);
  }
});

Deno.test("a WRITE_IMM that times out mid-payload breaks the stream and never delivers its immediate", async () => {
  const { a, b, peer } = await pair(128 * MiB, 128 * MiB, 2);
  try {
    await stopProcess(a.pid);
    const res = await submit(
      peer,
      new XferBatch(1).reset("write_imm", 300, 77),
      [[0, 0, 96 * MiB]],
    );
    assert.equal(res.statusName, "PF_ETIMEDOUT");
    // The sender notices while the target is still frozen: it cannot finish
    // the frame (the rest of the payload is no longer the batch's to read).
    for (let i = 0; i < 500 && peer.state().broken === 0; i++) {
      await new Promise((r) => setTimeout(r, 10));
    }
    assert.equal(peer.state().broken, -8);
    assert.match(peer.lastError(), /its batch ended while the payload was being sent/);
    Deno.kill(a.pid, "SIGCONT");
    // Every stream of the broken peer was shut: A drops the half frame.
    let info = await a.cmd<{ bytesLanded: number; servingConnections: number }>({ cmd: "info" });
    for (let i = 0; i < 500 && info.servingConnections > 0; i++) {
      await new Promise((r) => setTimeout(r, 10));
      info = await a.cmd({ cmd: "info" });
    }
    assert.equal(info.servingConnections, 0);
    assert.equal(info.bytesLanded, 0, "a WRITE frame counts as landed only when complete");
    assert.equal(a.pendingEvents(), 0, "no immediate for a batch that did not complete");
  } finally {
    Deno.kill(a.pid, "SIGCONT");
    await teardown(a, b);
  }
});

Deno.test("a peer killed mid-transfer fails the batch before its deadline and writes nothing after", async () => {
  const { a, b, peer } = await pair(256 * MiB, 256 * MiB, 4);
  try {
    const segs: Seg[] = [[0, 0, 192 * MiB]];
    const pending = submit(peer, new XferBatch(1).reset("read", 60_000), segs);
    Deno.kill(a.pid, "SIGSTOP");
    Deno.kill(a.pid, "SIGKILL");
    const res = await pending;
    assert.equal(res.statusName, "PF_EIO");
    assert.ok(res.ns < 60_000 * 1e6);
    b.mem.fill(CANARY, 0, 192 * MiB);
    await new Promise((r) => setTimeout(r, 200));
    assert.equal(b.mem.subarray(0, 192 * MiB).findIndex((x) => x !== CANARY), -1);
    const st = peer.state();
    assert.equal(st.broken, -8);
    assert.match(peer.lastError(), /connection|reset|closed/i);
    assert.throws(
      () => peer.submit(new XferBatch(1).reset("read", 1000).seg(0, 0, 1)),
      /is broken .* close it and reconnect/,
    );
  } finally {
    await teardown(a, b);
  }
});

Deno.test("closing a peer ends its batches in flight with PF_ESHUTDOWN", async () => {
  const { a, b, peer } = await pair(128 * MiB, 128 * MiB, 2);
  try {
    const pending = submit(peer, new XferBatch(1).reset("read", 60_000), [[0, 0, 96 * MiB]]);
    Deno.kill(a.pid, "SIGSTOP");
    await peer.close();
    const res = await pending;
    assert.equal(res.statusName, "PF_ESHUTDOWN");
  } finally {
    Deno.kill(a.pid, "SIGCONT");
    await teardown(a, b);
  }
});

Deno.test("more timeouts than the ring holds all arrive, and a full ring never blocks the JS thread", async () => {
  const a = await spawnNode({ poolBytes: 4 * MiB, seed: SEED_A, streams: 2 });
  const b = new LocalNode(4 * MiB, SEED_B, { streams: 2 }, 16);
  try {
    const peer = b.ep.createPeer();
    await peer.connect(`127.0.0.1:${a.port}`, 5000);
    await stopProcess(a.pid);
    const batches = Array.from({ length: 48 }, () => new XferBatch(1));
    const pending = batches.map((bt, i) =>
      submit(peer, bt.reset("read", 20 + i), [[i * 4096, i * 4096, 4096]])
    );
    // Hold the JS thread (nobody drains the ring) until every deadline has
    // passed: the timer fills the 16-record ring and waits for room. Calls
    // on the endpoint from this thread must still return — a timer that
    // waited while holding the peers lock would hang createPeer forever.
    const until = performance.now() + 400;
    while (performance.now() < until) { /* spin */ }
    const extra = b.ep.createPeer();
    assert.equal(b.ep.info().peers, 2);
    const results = await Promise.all(pending);
    assert.deepEqual(new Set(results.map((r) => r.statusName)), new Set(["PF_ETIMEDOUT"]));
    assert.equal(b.ep.info().timedOut, 48);
    await extra.close();
  } finally {
    Deno.kill(a.pid, "SIGCONT");
    await b.close();
    await a.close();
  }
});

Deno.test("connecting to a port nobody listens on fails with the reason", async () => {
  const b = new LocalNode(MiB, SEED_B);
  try {
    const probe = Deno.listen({ hostname: "127.0.0.1", port: 0 });
    const free = (probe.addr as Deno.NetAddr).port;
    probe.close();
    const peer = b.ep.createPeer();
    await assert.rejects(() => peer.connect(`127.0.0.1:${free}`, 2000), /Connection refused/);
    await assert.rejects(() => peer.connect("no-colon", 2000), /is not host:port/);
    await peer.close();
  } finally {
    await b.close();
  }
});

Deno.test("a raw blast into a pool moves each stream's own range of the sender's pool", async () => {
  const { a, b, peer } = await pair(16 * MiB, 16 * MiB);
  try {
    await peer.close();
    b.mem.fill(0);
    // 4 streams x 3 MiB: stream i lands in its 4 MiB slice here, from the sender's i * 3 MiB.
    await tcpBlast(`127.0.0.1:${a.port}`, 4, 3 * MiB, 30_000, { pool: b.pool });
    const segs: Seg[] = [0, 1, 2, 3].map((i) => [i * 3 * MiB, i * 4 * MiB, 3 * MiB]);
    assert.equal(firstMismatch(b.mem, segs, SEED_A), -1, "every stream sent distinct memory");
  } finally {
    await teardown(a, b);
  }
});

Deno.test("one byte pattern helper agrees with itself (sanity of the checker)", () => {
  const m = new Uint8Array(16);
  for (let i = 0; i < 16; i++) m[i] = patternByte(SEED_A, 100 + i);
  assert.equal(firstMismatch(m, [[100, 0, 16]], SEED_A), -1);
  m[7] ^= 1;
  assert.equal(firstMismatch(m, [[100, 0, 16]], SEED_A), 7);
});
