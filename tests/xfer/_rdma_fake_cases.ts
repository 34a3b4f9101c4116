/**
 * The RDMA verbs transport's data path, run over `fake_ibverbs.c` (a
 * software stand-in for libibverbs, no device needed): two endpoints of this
 * process connected both ways, READ / WRITE / WRITE_IMM moving real bytes
 * between their pools, and the batch-end rules under failures the stand-in
 * forces (a post that fails, a NIC that stalls, flush completions held back).
 * What the stand-in models and what it cannot prove: docs/transfer.md.
 */
import assert from "node:assert/strict";
import { XferBatch, XferEndpoint } from "../../ffi/xfer.ts";
import { CompletionRing, Engine, NativeError } from "../../ffi/mod.ts";
import { crc32c } from "../../lib/ssd/format.ts";
import { fakeVerbs, QPS, rdmaPair, settlesWithin, within } from "./_fake_verbs.ts";
import { fillPattern, firstMismatch, type Seg } from "./_pattern.ts";

const KIB = 1024;

Deno.test("over the verbs stand-in, READ, WRITE and WRITE_IMM move every byte, READ checksums each group, and the immediate arrives after the data", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096, immTag: 77 });
  try {
    const memA = pair.poolA.view(0, pair.poolA.bytes);
    const memB = pair.poolB.view(0, pair.poolB.bytes);
    fillPattern(memB, 0, memB.length, 11);
    // READ: 40 segments of 12 KiB strided so none merge, 3 stripes each.
    const segs: Seg[] = [];
    for (let i = 0; i < 40; i++) segs.push([i * 40 * KIB + 4 * KIB, i * 16 * KIB, 12 * KIB]);
    const read = new XferBatch(64, 64).reset("read", 5000);
    for (const [r, l, b] of segs) read.seg(r, l, b).group(b);
    const r = await within(pair.peerA.submit(read), 5000, "READ");
    assert.equal(r.statusName, "PF_OK");
    assert.equal(firstMismatch(memA, segs, 11), -1);
    assert.deepEqual(
      [...r.crcs!],
      segs.map(([, l, b]) => crc32c(memA.subarray(l, l + b))),
    );
    // WRITE then WRITE_IMM from A's pool into B's.
    fillPattern(memA, 0, memA.length, 23);
    const out: Seg[] = [[8 << 20, 0, 1 << 20], [12 << 20, 2 << 20, 64 * KIB]];
    const write = new XferBatch(8).reset("write", 5000);
    for (const [r2, l, b] of out) write.seg(r2, l, b);
    assert.equal((await within(pair.peerA.submit(write), 5000, "WRITE")).statusName, "PF_OK");
    for (const [r2, l, b] of out) {
      assert.deepEqual(memB.subarray(r2, r2 + b), memA.subarray(l, l + b), `WRITE at ${r2}`);
    }
    const got = new Promise<[number, number]>((resolve) => {
      const sub = pair.epB.imm$.subscribe((m) => {
        sub.unsubscribe();
        // The data is in place when the immediate is seen.
        resolve([m.imm, crc32c(memB.subarray(14 << 20, (14 << 20) + 256 * KIB))]);
      });
    });
    const imm = new XferBatch(8).reset("write_imm", 5000, 0xfeed).seg(14 << 20, 0, 256 * KIB);
    assert.equal((await within(pair.peerA.submit(imm), 5000, "WRITE_IMM")).statusName, "PF_OK");
    assert.deepEqual(await within(got, 5000, "the immediate"), [
      0xfeed,
      crc32c(memA.subarray(0, 256 * KIB)),
    ]);
    assert.equal(pair.peerA.state().broken, 0);
  } finally {
    await pair.close();
  }
});

/** A READ of `n` 4 KiB segments strided apart: with 4 KiB stripes, `n` WRs spread over the QPs. */
function stridedRead(n: number, timeoutMs: number): XferBatch {
  const b = new XferBatch(n).reset("read", timeoutMs);
  for (let i = 0; i < n; i++) b.seg(i * 8 * KIB, i * 8 * KIB, 4 * KIB);
  return b;
}

/** Throws unless `fn` throws a NativeError with `code`; returns it. */
function refused(fn: () => unknown, code: string): NativeError {
  try {
    fn();
  } catch (e) {
    assert.ok(e instanceof NativeError, String(e));
    assert.equal(e.codeName, code, e.message);
    return e;
  }
  assert.fail(`accepted; expected ${code}`);
}

Deno.test("a submit whose first part the NIC refuses returns PF_EIO naming the QP, posts no record and breaks the peer with the reason", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096 });
  try {
    pair.fake.fake_fail_post(0, 0);
    const e = refused(() => pair.peerA.submit(stridedRead(2, 5000)), "PF_EIO");
    assert.match(
      e.message,
      /could not queue the batch: ibv_post_send of part 0 .* on QP 0 \(pf_fake0\)/,
    );
    const info = pair.epA.info();
    assert.deepEqual([info.submitted, info.ok, info.failed], [0, 0, 0], "no record, none counted");
    assert.equal(pair.peerA.state().inflight, 0);
    assert.equal(pair.peerA.state().broken, -8);
    assert.match(
      pair.peerA.lastError(),
      /QPs moved to the error state \(ibv_post_send of part 0 \(1 WR\) on QP 0 \(pf_fake0\): .*\); close the peer and reconnect/,
    );
    assert.equal(pair.fake.fake_qp_state(pair.qpA), QPS.ERR);
  } finally {
    await pair.close();
  }
});

Deno.test("a submit whose second part the NIC refuses after the first part already completed returns the error and posts no record", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096 });
  try {
    // Part 0 runs at once; the post of part 1 waits until the poller has
    // handled part 0's completion, then fails: nothing of the batch is left
    // on the wire when the submit sees the failure (before: the submit ended
    // the batch itself, posting its record from the JS thread).
    pair.fake.fake_fail_post(1, 1);
    const e = refused(() => pair.peerA.submit(stridedRead(2, 5000)), "PF_EIO");
    assert.match(e.message, /ibv_post_send of part 1 .* on QP 1 \(pf_fake0\)/);
    const info = pair.epA.info();
    assert.deepEqual([info.submitted, info.ok, info.failed], [0, 0, 0], "no record, none counted");
    assert.equal(pair.peerA.state().inflight, 0);
  } finally {
    await pair.close();
  }
});

Deno.test("a submit whose second part the NIC refuses while the first is still on the wire is accepted, and its one record (PF_EIO) follows the first part's flush", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096 });
  try {
    pair.fake.fake_hold(1); // part 0 stays on the wire
    pair.fake.fake_fail_post(1, 0);
    const r = await within(pair.peerA.submit(stridedRead(2, 30_000)), 5000, "the record");
    assert.equal(r.statusName, "PF_EIO");
    const info = pair.epA.info();
    assert.deepEqual([info.submitted, info.failed, info.timedOut], [1, 1, 0]);
    assert.equal(pair.fake.fake_parked(), 0, "part 0 was flushed, not left running");
    assert.equal(pair.peerA.state().inflight, 0);
  } finally {
    await pair.close();
  }
});

Deno.test("a timed-out batch's record waits for the flush of every QP it was posted on, each WR of a chain flushing on its own", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096 });
  try {
    // 8 WRs: a chain of 4 on each QP, parked (a stalled NIC). QP 1 is slow to flush.
    pair.fake.fake_hold(1);
    assert.equal(pair.fake.fake_defer_flush(pair.qpA + 1), 0);
    const done = pair.peerA.submit(stridedRead(8, 200));
    for (let i = 0; i < 500 && pair.fake.fake_qp_state(pair.qpA + 1) !== QPS.ERR; i++) {
      await new Promise((r) => setTimeout(r, 10));
    }
    assert.equal(pair.fake.fake_qp_state(pair.qpA + 1), QPS.ERR, "the deadline moved the QPs");
    // Every flush completion of QP 0 (one per WR, unsignaled ones too) is
    // handled; QP 1's four are still held: its READs may still be landing.
    assert.equal(pair.fake.fake_wait_polled(pair.qpA, 5000), 1);
    assert.equal(pair.fake.fake_deferred(), 4);
    assert.equal(
      pair.epA.info().timedOut,
      0,
      "ended before QP 1 flushed (before: after QP 0's 4 flushes)",
    );
    assert.ok(!(await settlesWithin(done, 200)));
    assert.equal(pair.fake.fake_deliver_flush(), 4);
    const r = await within(done, 5000, "the record after the last flush");
    assert.equal(r.statusName, "PF_ETIMEDOUT");
    assert.match(
      pair.peerA.lastError(),
      /QPs moved to the error state \(batch tag \d+ \(slot \d+\) passed its 200 ms deadline/,
    );
  } finally {
    await pair.close();
  }
});

Deno.test("a batch queued behind a full send queue ends with the peer's failure as soon as the peer breaks, not at its own deadline", async () => {
  const pair = await rdmaPair({ streams: 1, stripeBytes: 4096 });
  try {
    pair.fake.fake_hold(1);
    // 1024 WRs fill the QP's send queue; the next batch waits in its backlog.
    const first = pair.peerA.submit(stridedRead(1024, 300));
    const queued = pair.peerA.submit(stridedRead(1, 20_000));
    const a = await within(first, 5000, "the timed-out batch");
    assert.equal(a.statusName, "PF_ETIMEDOUT");
    // Before: the queued batch was dropped from the backlog and waited out its 20 s.
    const b = await within(queued, 5000, "the queued batch");
    assert.equal(b.statusName, "PF_EIO");
    assert.equal(pair.peerA.state().inflight, 0);
  } finally {
    await pair.close();
  }
});

Deno.test("a submit that cannot post a part while the completion ring is full returns the error at once instead of waiting on the JS thread for ring room", async () => {
  const child = decodeURIComponent(new URL("./_rdma_ring_full_child.ts", import.meta.url).pathname);
  for (const mode of ["first", "second"]) {
    const proc = new Deno.Command(Deno.execPath(), {
      args: ["run", "-A", child, mode],
      stdout: "piped",
      stderr: "piped",
    }).spawn();
    const out = proc.output();
    // Generous: the child builds the stand-in with gcc and starts Deno.
    if (!(await settlesWithin(out, 60_000))) {
      proc.kill("SIGKILL");
      await out;
      assert.fail(`${mode}: the submit never returned (it waits for ring room on the JS thread)`);
    }
    const r = await out;
    const text = new TextDecoder().decode(r.stdout);
    assert.equal(r.code, 0, `${mode}: ${text}${new TextDecoder().decode(r.stderr)}`);
    const line = JSON.parse(text.trim().split("\n").at(-1)!);
    assert.equal(line.code, "PF_EIO", `${mode}: ${text}`);
    assert.match(line.refused, new RegExp(`ibv_post_send of part ${mode === "first" ? 0 : 1} `));
  }
});

Deno.test("closing a peer whose flush never comes gives up after the flush wait, destroys its QPs so the NIC stops, and ends the batch with PF_ESHUTDOWN", async () => {
  Deno.env.set("PEGAFLOW_RDMA_FLUSH_WAIT_MS", "300");
  let pair;
  try {
    pair = await rdmaPair({ streams: 1, stripeBytes: 4096 });
  } finally {
    Deno.env.delete("PEGAFLOW_RDMA_FLUSH_WAIT_MS");
  }
  try {
    pair.fake.fake_hold(1);
    pair.fake.fake_defer_flush(pair.qpA); // a wedged NIC: no flush comes
    const done = pair.peerA.submit(stridedRead(4, 60_000));
    // Before: the close waited for the flush for ever.
    await within(pair.peerA.close(), 10_000, "the peer close");
    assert.equal(pair.fake.fake_qp_state(pair.qpA), -1, "the QP was destroyed");
    const r = await within(done, 5000, "the record");
    assert.equal(r.statusName, "PF_ESHUTDOWN");
  } finally {
    await pair.close();
  }
});

Deno.test("closing a peer with batches on the wire ends each with PF_ESHUTDOWN once its WRs are flushed", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096 });
  try {
    pair.fake.fake_hold(1);
    const batches = [
      pair.peerA.submit(stridedRead(8, 60_000)),
      pair.peerA.submit(stridedRead(3, 60_000)),
    ];
    await within(pair.peerA.close(), 5000, "the peer close");
    for (const b of batches) {
      assert.equal((await within(b, 5000, "a record")).statusName, "PF_ESHUTDOWN");
    }
    assert.equal(pair.fake.fake_parked(), 0);
    assert.equal(pair.fake.fake_deferred(), 0);
  } finally {
    await pair.close();
  }
});

Deno.test("a bad PEGAFLOW_RDMA_FLUSH_WAIT_MS refuses the RDMA endpoint naming it", async () => {
  await fakeVerbs();
  const engine = Engine.open({ backend: "host" });
  const pool = engine.createPool(1 << 20);
  const ring = new CompletionRing(64);
  Deno.env.set("PEGAFLOW_RDMA_FLUSH_WAIT_MS", "0");
  try {
    const e = refused(
      () => XferEndpoint.open({ transport: "rdma", streams: 1, pool, ring }),
      "PF_EINVAL",
    );
    assert.match(e.message, /PEGAFLOW_RDMA_FLUSH_WAIT_MS "0"; expected 1\.\.3600000 \(ms\)/);
  } finally {
    Deno.env.delete("PEGAFLOW_RDMA_FLUSH_WAIT_MS");
    ring.destroy();
    pool.close();
    engine.close();
  }
});
