/**
 * Two transfer nodes in two network namespaces joined by a veth pair (made
 * by the test; needs root and `ip netns`), each its own process with its own
 * pool: READ and WRITE across the veth, every byte checked. Where namespaces
 * cannot be made, the same test runs on loopback and says so.
 */
import assert from "node:assert/strict";
import { makeNetnsPair, type NodeProc, spawnNode } from "./_harness.ts";
import type { Seg } from "./_pattern.ts";

const MiB = 1 << 20;
const SEED_A = 0xa11ce, SEED_B = 0xb0b;

Deno.test("two nodes in two network namespaces READ and WRITE each other's pools over veth", async () => {
  const ns = await makeNetnsPair("x");
  if (typeof ns === "string") {
    console.log(`ip netns unavailable (${ns}); running the two nodes on loopback instead`);
  }
  const net = typeof ns === "string" ? undefined : ns;
  const addrA = net?.addrA ?? "127.0.0.1";
  let a: NodeProc | undefined, b: NodeProc | undefined;
  try {
    a = await spawnNode({ poolBytes: 32 * MiB, seed: SEED_A, streams: 4, bindAddr: addrA }, net?.a);
    b = await spawnNode({ poolBytes: 32 * MiB, seed: SEED_B, streams: 4 }, net?.b);
    const conn = await b.cmd<{ remoteBytes: number }>({
      cmd: "connect",
      addr: `${addrA}:${a.port}`,
    });
    assert.equal(conn.remoteBytes, 32 * MiB);

    // READ: 400 segments of varied sizes from all over A into B.
    const reads: Seg[] = [];
    let l = 0;
    for (let i = 0; i < 400; i++) {
      const n = 1 + ((i * 104_729) % 60_000);
      reads.push([(i * 7_919_993) % (32 * MiB - 60_000), l, n]);
      l += n + (i % 5) * 17;
    }
    const r = await b.cmd<{ statusName: string }>({
      cmd: "xfer",
      op: "read",
      segs: reads,
      timeoutMs: 30_000,
    });
    assert.equal(r.statusName, "PF_OK");
    assert.equal(
      (await b.cmd<{ bad: number }>({ cmd: "verify", segs: reads, seed: SEED_A })).bad,
      -1,
    );

    // WRITE: 16 MiB of B's pattern (untouched top half) into A.
    const writes: Seg[] = Array.from(
      { length: 64 },
      (_, i) => [i * 256 * 1024, 16 * MiB + ((i * 37) % 64) * 256 * 1024, 256 * 1024],
    );
    const w = await b.cmd<{ statusName: string }>({
      cmd: "xfer",
      op: "write",
      segs: writes,
      timeoutMs: 30_000,
    });
    assert.equal(w.statusName, "PF_OK");
    const swapped = writes.map(([r2, l2, n]) => [l2, r2, n] as Seg);
    assert.equal(
      (await a.cmd<{ bad: number }>({ cmd: "verify", segs: swapped, seed: SEED_B })).bad,
      -1,
    );
  } finally {
    await b?.close();
    await a?.close();
    await net?.remove();
  }
});
