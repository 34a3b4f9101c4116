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
import { addPeers, COUNT, fakeVerbs, QPS, rdmaPair, settlesWithin, within } from "./_fake_verbs.ts";
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
      /could not queue the batch: ibv_post_send of part 0 .* on QP 0 \(pf_fake0\): Cannot allocate memory/,
    );
    const info = pair.epA.info();
    assert.deepEqual([info.submitted, info.ok, info.failed], [0, 0, 0], "no record, none counted");
    assert.equal(pair.peerA.state().inflight, 0);
    assert.equal(pair.peerA.state().broken, -8);
    assert.match(
      pair.peerA.lastError(),
      /QPs moved to the error state \(ibv_post_send of part 0 \(1 WR\) on QP 0 \(pf_fake0\): Cannot allocate memory\); close the peer and reconnect/,
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

Deno.test("a completion queue whose poll fails breaks its peer naming the NIC, the peer and the return value, ends the batches on it at once and is not polled again", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096 });
  try {
    const { fake } = pair;
    fake.fake_hold(1); // both batches stay on the wire, on both QPs
    const batches = [
      pair.peerA.submit(stridedRead(8, 30_000)),
      pair.peerA.submit(stridedRead(3, 30_000)),
    ];
    const failedPolls = Number(fake.fake_count(COUNT.failedPolls));
    assert.equal(fake.fake_fail_poll(pair.qpA, -5), 0);
    // Before: the failed poll was taken for "no completions" and the CQ
    // polled again every pass; the batches waited for their 30 s deadline,
    // and past it for ever (the deadline's flushes went to the lost CQ).
    for (const b of batches) {
      assert.equal((await within(b, 5000, "a record")).statusName, "PF_EIO");
    }
    const info = pair.epA.info();
    assert.deepEqual([info.submitted, info.failed, info.timedOut], [2, 2, 0]);
    assert.equal(pair.peerA.state().inflight, 0);
    assert.equal(pair.peerA.state().broken, -8);
    const why = `ibv_poll_cq of peer ${pair.peerA.handle}'s CQ on pf_fake0 returned -5`;
    assert.match(pair.peerA.lastError(), new RegExp(`QPs moved to the error state \\(${why}`));
    const e = refused(() => pair.peerA.submit(stridedRead(1, 5000)), "PF_EIO");
    assert.match(e.message, new RegExp(`peer ${pair.peerA.handle} is broken \\(.*${why}`));
    // The NIC stopped for good: the QPs whose completions can no longer be
    // seen are destroyed, their parked WRs with them.
    assert.deepEqual([fake.fake_qp_state(pair.qpA), fake.fake_qp_state(pair.qpA + 1)], [-1, -1]);
    assert.equal(fake.fake_parked(), 0);
    await new Promise((r) => setTimeout(r, 200));
    const polls = Number(fake.fake_count(COUNT.failedPolls)) - failedPolls;
    assert.equal(polls, 1, "the lost CQ is polled once");
    assert.equal(pair.peerB.state().broken, 0, "the other side's peer is not touched");
    await within(pair.peerA.close(), 5000, "the peer close");
  } finally {
    await pair.close();
  }
});

Deno.test("a completion queue whose poll fails before its peer connects breaks the peer, and a submit after the connect is refused naming why", async () => {
  const pair = await rdmaPair({ streams: 1, connect: false });
  try {
    const { fake } = pair;
    const failedPolls = Number(fake.fake_count(COUNT.failedPolls));
    assert.equal(fake.fake_fail_poll(pair.qpA, -2), 0);
    for (let i = 0; i < 500 && pair.peerA.state().broken === 0; i++) {
      await new Promise((r) => setTimeout(r, 10));
    }
    // Before: ignored; the peer stayed healthy over a CQ that is lost.
    assert.equal(pair.peerA.state().broken, -8);
    const why = `ibv_poll_cq of peer ${pair.peerA.handle}'s CQ on pf_fake0 returned -2`;
    assert.match(pair.peerA.lastError(), new RegExp(`${why}.*close the peer and create it again`));
    await pair.peerA.connect(pair.peerB.info(), 1000);
    await pair.peerB.connect(pair.peerA.info(), 1000);
    const e = refused(() => pair.peerA.submit(stridedRead(1, 5000)), "PF_EIO");
    assert.match(e.message, new RegExp(`is broken \\(${why}`));
    const polls = Number(fake.fake_count(COUNT.failedPolls)) - failedPolls;
    assert.equal(polls, 1, "the lost CQ is polled once");
  } finally {
    await pair.close();
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

/** Waits (up to 5 s) until every QP of `ordinals` is in `state`; false if one is not. */
async function qpsReach(
  fake: { fake_qp_state(ordinal: number): number },
  ordinals: number[],
  state: number,
): Promise<boolean> {
  for (let i = 0; i < 500; i++) {
    if (ordinals.every((q) => fake.fake_qp_state(q) === state)) return true;
    await new Promise((r) => setTimeout(r, 10));
  }
  return false;
}

Deno.test("two peers on one NIC whose full send queues flush at once overrun no completion queue, and every batch ends", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096 });
  try {
    const second = await addPeers(pair);
    const { fake } = pair;
    // Each batch puts 1024 WRs on each of its peer's 2 QPs (their send
    // queues full) and stays on the wire; the poller falls behind the NIC,
    // so when the deadlines move the 4 QPs to the error state their flushes
    // (4 x 1024 sends + 4 x 128 receives = 4608) pile up unpolled. Before:
    // one CQ of 4096 for the NIC, shared by both peers: it overran
    // (IBV_EVENT_CQ_ERR), the completions were lost and the batches never
    // ended.
    fake.fake_hold(1);
    fake.fake_pause_poll(1);
    const batches = [pair.peerA, second.peerA].map((p) => p.submit(stridedRead(2048, 200)));
    const qps = [pair.qpA, pair.qpA + 1, second.qpA, second.qpA + 1];
    assert.ok(await qpsReach(fake, qps, QPS.ERR), "the deadlines moved the QPs to error");
    fake.fake_pause_poll(0);
    const ended = await settlesWithin(Promise.all(batches), 5000);
    const overruns = Number(fake.fake_count(COUNT.cqOverruns));
    const lost = Number(fake.fake_count(COUNT.lostCompletions));
    assert.ok(ended, `the batches never ended (CQ overruns ${overruns}, completions lost ${lost})`);
    assert.deepEqual([overruns, lost], [0, 0], "CQ overruns, completions lost");
    for (const b of batches) assert.equal((await b).statusName, "PF_ETIMEDOUT");
    assert.equal(pair.peerA.state().inflight + second.peerA.state().inflight, 0);
  } finally {
    await pair.close();
  }
});

Deno.test("a peer whose completion queue would exceed the device's max_cqe is refused naming the entries it needs and what to lower", async () => {
  Deno.env.set("PF_FAKE_IBV_MAX_CQE", "2000");
  let pair;
  try {
    // 1 QP: 1024 send + 128 receive entries fit.
    pair = await rdmaPair({ streams: 1 });
    const ep = XferEndpoint.open({
      transport: "rdma",
      streams: 2,
      pool: pair.poolA,
      ring: pair.ringA,
    });
    try {
      const e = refused(() => ep.createPeer(), "PF_EINVAL");
      assert.match(
        e.message,
        /ibv_create_cq of 2304 entries on pf_fake0 \(2 QPs x \(1024 send \+ 128 receive\)\): Invalid argument; .*fewer QPs per NIC/,
      );
      assert.equal(ep.info().peers, 0);
    } finally {
      await ep.close();
    }
  } finally {
    Deno.env.delete("PF_FAKE_IBV_MAX_CQE");
    await pair?.close();
  }
});

Deno.test("a connect that fails after some QPs reached RTS resets them, so a retry on the same peer connects and moves bytes both ways", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096, connect: false });
  try {
    const { fake } = pair;
    // A's QP 1 refuses RTR; QP 0 is in RTS by then.
    assert.equal(fake.fake_fail_modify(pair.qpA + 1, QPS.RTR), 0);
    const e = await pair.peerA.connect(pair.peerB.info(), 1000).then(() => null, (e) => e);
    assert.ok(e instanceof NativeError, String(e));
    assert.equal(e.codeName, "PF_EIO");
    assert.match(
      e.message,
      /QP 1 \(pf_fake0\) to RTR: Invalid argument; the peer's QPs were reset to INIT: connect may be retried/,
    );
    assert.equal(pair.peerA.state().connected, false);
    assert.deepEqual([fake.fake_qp_state(pair.qpA), fake.fake_qp_state(pair.qpA + 1)], [
      QPS.INIT,
      QPS.INIT,
    ]);
    // Before: "QP 0 to RTR: Invalid argument" (QP 0 was no longer in INIT).
    await pair.peerA.connect(pair.peerB.info(), 1000);
    await pair.peerB.connect(pair.peerA.info(), 1000);
    const memA = pair.poolA.view(0, pair.poolA.bytes);
    const memB = pair.poolB.view(0, pair.poolB.bytes);
    fillPattern(memB, 0, memB.length, 5);
    const segs: Seg[] = [[0, 1 << 20, 64 * KIB], [256 * KIB, 2 << 20, 64 * KIB]];
    const read = new XferBatch(8).reset("read", 5000);
    for (const [r, l, b] of segs) read.seg(r, l, b);
    assert.equal((await within(pair.peerA.submit(read), 5000, "READ")).statusName, "PF_OK");
    assert.equal(firstMismatch(memA, segs, 5), -1);
    // A WRITE_IMM from B into A: the reset emptied A's receive queues, which
    // must have been filled again for the immediate to arrive.
    const got = new Promise<number>((resolve) => {
      const sub = pair.epA.imm$.subscribe((m) => {
        sub.unsubscribe();
        resolve(m.imm);
      });
    });
    const imm = new XferBatch(8).reset("write_imm", 5000, 0xbeef).seg(4 << 20, 0, 4 * KIB);
    assert.equal((await within(pair.peerB.submit(imm), 5000, "WRITE_IMM")).statusName, "PF_OK");
    assert.equal(await within(got, 5000, "the immediate"), 0xbeef);
  } finally {
    await pair.close();
  }
});

Deno.test("a connect that fails and whose QPs cannot be reset says the peer must be closed and created again, and so does a retry", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096, connect: false });
  try {
    const { fake } = pair;
    assert.equal(fake.fake_fail_modify(pair.qpA + 1, QPS.RTS), 0);
    assert.equal(fake.fake_fail_modify(pair.qpA, QPS.RESET), 0);
    const first = await pair.peerA.connect(pair.peerB.info(), 1000).then(() => null, (e) => e);
    assert.ok(first instanceof NativeError, String(first));
    assert.equal(first.codeName, "PF_EIO");
    assert.match(
      first.message,
      /QP 1 \(pf_fake0\) to RTS: Invalid argument; resetting QP 0 \(pf_fake0\) failed \(Invalid argument\): close the peer and create it again/,
    );
    const retry = await pair.peerA.connect(pair.peerB.info(), 1000).then(() => null, (e) => e);
    assert.ok(retry instanceof NativeError, String(retry));
    assert.equal(retry.codeName, "PF_EIO");
    assert.match(
      retry.message,
      /an earlier connect failed and its QPs could not be reset .*: close the peer and create it again/,
    );
    // A new peer on the same endpoint connects.
    const again = await addPeers(pair);
    const read = new XferBatch(1).reset("read", 5000).seg(0, 0, 4 * KIB);
    assert.equal((await within(again.peerA.submit(read), 5000, "READ")).statusName, "PF_OK");
  } finally {
    await pair.close();
  }
});

Deno.test("a peer create whose receive posts the NIC refuses fails naming the NIC, the QP and the receives posted, and leaves no QP behind", async () => {
  const pair = await rdmaPair({ streams: 2 });
  try {
    const { fake } = pair;
    const first = fake.fake_qp_count();
    // QP 0's 128 receives go in; QP 1's sixth is refused.
    fake.fake_fail_recv(128 + 5);
    // Before: accepted with 5 receives on QP 1, so immediates on it would
    // later stall or fail with no word of why.
    const e = refused(() => pair.epA.createPeer(), "PF_EIO");
    assert.match(
      e.message,
      /ibv_post_recv on QP 1 \(pf_fake0\) failed after 5 of 128 receives: Cannot allocate memory/,
    );
    assert.equal(pair.epA.info().peers, 1, "only the pair's own peer");
    assert.deepEqual([fake.fake_qp_state(first), fake.fake_qp_state(first + 1)], [-1, -1]);
    // The NIC is fine again: the next create works.
    pair.epA.createPeer();
    assert.equal(pair.epA.info().peers, 2);
  } finally {
    await pair.close();
  }
});

Deno.test("a receive for immediates that cannot be posted again breaks the peer naming the QP, instead of leaving it a receive short", async () => {
  const pair = await rdmaPair({ streams: 2, stripeBytes: 4096 });
  try {
    const got = new Promise<number>((resolve) => {
      const sub = pair.epA.imm$.subscribe((m) => {
        sub.unsubscribe();
        resolve(m.imm);
      });
    });
    // The immediate from B consumes a receive of A's QP 0; its repost fails.
    pair.fake.fake_fail_recv(0);
    const imm = new XferBatch(8).reset("write_imm", 5000, 0x51).seg(0, 0, 4 * KIB);
    assert.equal((await within(pair.peerB.submit(imm), 5000, "WRITE_IMM")).statusName, "PF_OK");
    assert.equal(await within(got, 5000, "the immediate"), 0x51);
    // Before: ignored; the peer stayed healthy with 127 receives on QP 0.
    for (let i = 0; i < 500 && pair.peerA.state().broken === 0; i++) {
      await new Promise((r) => setTimeout(r, 10));
    }
    assert.equal(pair.peerA.state().broken, -8);
    assert.match(
      pair.peerA.lastError(),
      /ibv_post_recv of a receive for immediates on QP 0 \(pf_fake0\): Cannot allocate memory\); close the peer and reconnect/,
    );
  } finally {
    await pair.close();
  }
});
