/**
 * `pf_tcp_blast` (the benchmarks' raw TCP figure) has a deadline like every
 * other TCP call: a sender that never answers fails the blast by then,
 * naming the stream and the bytes missing, instead of hanging it (and the
 * benchmark) forever.
 */
import assert from "node:assert/strict";
import { NativeError, PF_STATUS } from "../../ffi/mod.ts";
import { tcpBlast } from "../../ffi/xfer.ts";
import { silentListener } from "./_harness.ts";

const MiB = 1 << 20;

Deno.test("a blast to a peer that never answers fails with PF_ETIMEDOUT by its deadline", async () => {
  const peer = silentListener();
  try {
    // A guard, not a measurement: the old blast never returned at all.
    let guard: ReturnType<typeof setTimeout> | undefined;
    const hung = new Promise<never>((_, reject) => {
      guard = setTimeout(() => reject(new Error("tcpBlast still pending after 10 s")), 10_000);
    });
    const blast = tcpBlast(peer.addr, 2, MiB, 300);
    try {
      await assert.rejects(Promise.race([blast, hung]), (e: unknown) => {
        assert.ok(e instanceof NativeError, String(e));
        assert.equal(e.code, PF_STATUS.PF_ETIMEDOUT);
        assert.match(
          e.message,
          /stream 0 to 127\.0\.0\.1:\d+: 1048576 of 1048576 bytes still missing at its 300 ms deadline/,
        );
        return true;
      });
    } finally {
      clearTimeout(guard);
    }
  } finally {
    peer.close();
  }
});

Deno.test("a blast's deadline must be 1 .. 3,600,000 ms", async () => {
  for (const t of [0, -1, 1.5, 3_600_001, NaN]) {
    await assert.rejects(tcpBlast("127.0.0.1:1", 1, MiB, t), /timeoutMs .* must be an integer/);
  }
});

Deno.test("a blast to a closed port fails naming the stream and the reason", async () => {
  const probe = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const port = (probe.addr as Deno.NetAddr).port;
  probe.close();
  await assert.rejects(
    tcpBlast(`127.0.0.1:${port}`, 1, MiB, 2000),
    /PF_EIO: pf_tcp_blast: stream 0 to 127\.0\.0\.1:\d+: .*Connection refused/,
  );
});
