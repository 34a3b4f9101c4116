/**
 * Races in the C library that need a thread stopped at one exact point:
 * the programs in `tests/native/c/` force each interleaving (a hook, or a
 * replay through the library's own internal calls), built here with
 * AddressSanitizer and UBSan against `csrc/`, and must exit 0. Each one
 * failed on the code before its fix (docs/native.md, "Lifetimes" and
 * "Transfer batches end once").
 */
import assert from "node:assert/strict";
import { build, objects, run } from "./_sanitized_c.ts";

Deno.test("C races: a landed part counts against its own batch, a broken peer ends a late-armed batch, a submit that cannot queue its batch never waits on a full ring, a close waits for a submit, connect, info, error or sync past its lookup, an endpoint close refuses while a peer is created, a submit during the deadline timer's scan kicks it, a wrapped kernel table on an empty arena never waits, a TCP wait never ends before its deadline", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-races-" });
  try {
    const objs = await objects(dir);
    const [parts, broken, close, peerClose, peerCalls, ringFull, timerKick, arena, tcpWait] =
      await Promise
        .all([
          build(dir, objs, "xfer_parts", ["pf_tcp.c"]),
          build(dir, objs, "xfer_broken", []),
          build(dir, objs, "uring_close", ["pf_uring.c"]),
          build(dir, objs, "xfer_submit_close", ["pf_xfer.c"]),
          build(dir, objs, "xfer_peer_close", ["pf_xfer.c"]),
          build(dir, objs, "xfer_submit_ring_full", ["pf_xfer.c"]),
          build(dir, objs, "xfer_timer_kick", ["pf_xfer.c"]),
          build(dir, objs, "cuda_arena_wrap", ["pf_cuda.c"]),
          build(dir, objs, "tcp_wait_deadline", ["pf_tcp.c"]),
        ]);

    // The TCP transport's waits (connect, hello, a stalled stream) end at their deadline, not up
    // to 1 ms before it (before: the time left was rounded down to whole ms).
    assert.match(await run(tcpWait, [], "tcp_wait_deadline"), /^0 of 40 deadlines ended early$/m);

    // A wrapped kernel table on an empty arena is reserved at once (before:
    // it waited for ever, the cuda submitter thread with it).
    assert.match(
      await run(arena, [], "cuda_arena_wrap"),
      /reserved at offset 0 MiB, lap end 104 MiB \(correct\)/,
    );

    // A submit while the deadline timer scans wakes it (before: never, so a
    // short batch armed behind the scan waited for the longer wake it planned).
    const kick = await run(timerKick, [], "xfer_timer_kick");
    assert.match(kick, /timer scanning: kicked \(correct\)/);
    assert.match(kick, /timer to wake in 1 ms: not kicked \(correct\)/);

    for (const mode of ["", "ack"]) {
      const out = await run(parts, mode ? [mode] : [], `xfer_parts ${mode}`);
      assert.match(out, /after 1 of B's 2 parts: B still in flight \(correct\)/);
      assert.match(out, /after B's 2nd part: B ended PF_OK \(correct\)/);
    }
    assert.match(
      await run(broken, [], "xfer_broken"),
      /^0 of 2000 peer failures left a batch in flight/m,
    );
    const file = `${dir}/uring_close.dat`;
    const submit = await run(close, [file, "submit"], "uring_close submit");
    assert.match(submit, /call: -\d+ pf_io_submit: .*is closing/, "the racing submit is refused");
    const sync = await run(close, [file, "sync-uring"], "uring_close sync-uring");
    assert.match(sync, /call: 0 /, "the sync the close waited for succeeded");
    const fileClose = await run(close, [file, "sync-file"], "uring_close sync-file");
    assert.match(fileClose, /file close during sync: -6/, "PF_EBUSY while the sync holds the file");
    for (const out of [submit, sync, fileClose]) {
      assert.match(out, /pf_uring_close: 0/);
      assert.match(out, /pool destroy 0, ring destroy 0/);
    }
    const lookup = await run(peerClose, ["lookup"], "xfer_submit_close lookup");
    assert.match(lookup, /submit: -9 pf_xfer_submit: peer \d+ is closing/, "refused");
    assert.match(lookup, /pf_xfer_peer_close: 0/);
    const armed = await run(peerClose, ["armed"], "xfer_submit_close armed");
    assert.match(armed, /submit: -9 pf_xfer_submit: peer \d+ is closing/, "taken back");
    assert.match(armed, /records: 0\n/, "no record: the submit returned the error");
    assert.match(armed, /pf_xfer_peer_close: 0/);

    // A submit that must end its own batch while the ring is full returns the
    // error at once and posts nothing (before: it waited for ring room on the
    // JS thread, the ring's only consumer, for ever).
    const refused = await run(ringFull, ["transport"], "xfer_submit_ring_full transport");
    assert.match(
      refused,
      /submit returned: -4 pf_xfer_submit: peer \d+: the stub transport could not queue the batch: .*out of memory for the send queue/,
    );
    const brokeMeanwhile = await run(ringFull, ["broken"], "xfer_submit_ring_full broken");
    assert.match(
      brokeMeanwhile,
      /submit returned: -8 pf_xfer_submit: peer \d+ broke as the batch was queued \(stream 1 to 10\.0\.0\.2:7010: receive: connection reset by peer\)/,
    );
    for (const out of [refused, brokeMeanwhile]) {
      assert.match(out, /records: 16, free slots 256, in flight 0, submitted 0/);
    }

    // A close during a pending connect: the connect gives up with PF_ESHUTDOWN
    // naming the peer, then the close frees it (before: the close freed the
    // peer under the connect, which then read it).
    for (const mode of ["handshake", "connect"]) {
      const out = await run(peerCalls, [mode], `xfer_peer_close ${mode}`);
      assert.match(out, /close during connect: finished \(rc 0\)/);
      assert.match(out, /connect: -9 pf_xfer_peer_connect\(tcp\): peer \d+ was closed while/);
      assert.match(out, /pf_xfer_close: 0/);
    }
    const twice = await run(peerCalls, ["twice"], "xfer_peer_close twice");
    assert.match(twice, /second connect: -6 .*a connect is already under way/);
    const create = await run(peerCalls, ["create"], "xfer_peer_close create");
    assert.match(create, /endpoint close during pf_xfer_peer_create: finished \(rc -6\)/);
    assert.match(create, /peers: 1/);
    assert.match(create, /pf_xfer_close: 0/);
    for (const mode of ["info", "error"]) {
      const out = await run(peerCalls, [mode], `xfer_peer_close ${mode}`);
      assert.match(out, /still waiting for it/, `the close waits for pf_xfer_peer_${mode}`);
      assert.match(out, /pf_xfer_peer_close: 0/);
    }
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
