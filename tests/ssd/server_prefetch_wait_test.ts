/**
 * WaitPrefetch in the real server (child process, real gRPC and the local
 * RPC socket): an engine told "loading" waits for the SSD read of its
 * request instead of polling, is answered once the read ended, and its next
 * query hits every block, each read once. A request with nothing running is
 * answered at once; bad input is refused naming what was wrong.
 */
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import { PegaflowClient, PegaflowError } from "../../lib/client/client.ts";
import type { SimEngine } from "../../lib/client/sim_engine.ts";
import { MAX_PREFETCH_WAIT_MS } from "../../lib/limits.ts";
import { uid } from "../server/harness.ts";
import { sim, ssdResidentPrefix } from "./_server.ts";

const BLOCKS = 40;
/** Far above a 40-block read on a loaded CI machine: an answer before it is the read's end. */
const WAIT_MS = 15_000;

/** Queries `reqId` (it must answer loading), waits once, queries again; the answers and the wait. */
async function waitThenQuery(
  e: SimEngine,
  client: PegaflowClient,
  hashes: Uint8Array[],
  reqId: string,
) {
  const first = await e.query(hashes, reqId);
  assert.equal(first.kind, "loading", `${reqId}: the prefix is on SSD only`);
  const t0 = performance.now();
  const settled = await client.waitPrefetch({
    instanceId: e.instanceId,
    requestId: reqId,
    waitMs: WAIT_MS,
  });
  const waitedMs = performance.now() - t0;
  const next = await e.query(hashes, reqId);
  return { settled, waitedMs, next };
}

Deno.test("WaitPrefetch over gRPC and the local RPC socket: answered when the SSD read ends, then one query hits every block", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-ssd-wait-" });
  const uds = `${dir}/pf.sock`;
  const namespace = uid("ns");
  const { srv, hashes } = await ssdResidentPrefix(dir, namespace, 31, BLOCKS, ["--uds", uds]);
  const local = new PegaflowClient(`unix:${uds}`);
  const engines: SimEngine[] = [];
  try {
    for (const [i, client] of [srv.client, local].entries()) {
      const e = sim(client, namespace);
      engines.push(e);
      await e.register();
      const r = await waitThenQuery(e, client, hashes, `wait-${i}`);
      assert.equal(r.settled, true, `transport ${i}: the read ended`);
      assert.ok(r.waitedMs < WAIT_MS, `transport ${i}: answered at the read's end, not the wait's`);
      assert.equal(
        r.next.kind,
        "ready",
        `transport ${i}: the query after the wait answers from RAM`,
      );
      if (r.next.kind !== "ready") continue;
      assert.equal(r.next.hits, BLOCKS);
      const dst = Array.from({ length: BLOCKS }, (_, j) => 20 + j);
      e.clear(dst);
      await e.load(r.next.leaseId, dst);
      assert.deepEqual(e.verify(dst, hashes), { badSegments: 0, first: undefined });
      assert.equal(
        await srv.metric("pegaflow_ssd_read_blocks_total"),
        BLOCKS * (i + 1),
        "each block read once per round",
      );
      await client.unregisterContext(e.instanceId);
      // SSD-only again for the next transport's round.
      assert.equal((await srv.http_post("/cache/memory/cleanup")).status, 200);
    }
  } finally {
    for (const e of engines) e.close();
    local.close();
    await srv.stop();
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("WaitPrefetch with nothing running answers at once; bad input is refused naming the field, instance or engine", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pf-ssd-wait-bad-" });
  const namespace = uid("ns");
  const { srv, hashes } = await ssdResidentPrefix(dir, namespace, 32, 4);
  const e = sim(srv.client, namespace);
  try {
    await e.register();
    const t0 = performance.now();
    assert.equal(
      await srv.client.waitPrefetch({
        instanceId: e.instanceId,
        requestId: "never-asked",
        waitMs: WAIT_MS,
      }),
      true,
      "no fetch of this request: nothing to wait for",
    );
    assert.ok(performance.now() - t0 < WAIT_MS / 2, "answered without holding");
    const refused = async (
      req: { instanceId: string; requestId: string; waitMs: number; engineId?: string },
      code: number,
      text: RegExp,
    ) => {
      await assert.rejects(srv.client.waitPrefetch(req), (err: unknown) => {
        assert.ok(err instanceof PegaflowError, String(err));
        assert.equal(err.code, code, err.message);
        assert.match(err.details, text);
        return true;
      });
    };
    const ok = { instanceId: e.instanceId, requestId: "r", waitMs: 10 };
    await refused({ ...ok, waitMs: 0 }, grpc.status.INVALID_ARGUMENT, /wait_ms is 0; 1\.\.60000/);
    await refused(
      { ...ok, waitMs: MAX_PREFETCH_WAIT_MS + 1 },
      grpc.status.INVALID_ARGUMENT,
      /wait_ms is 60001/,
    );
    await refused({ ...ok, requestId: "" }, grpc.status.INVALID_ARGUMENT, /needs a request_id/);
    await refused(
      { ...ok, instanceId: "nobody" },
      grpc.status.FAILED_PRECONDITION,
      /WaitPrefetch \(request "r"\): instance "nobody" is not registered/,
    );
    await refused(
      { ...ok, engineId: "someone-else" },
      grpc.status.FAILED_PRECONDITION,
      /someone-else/,
    );
    // Nothing was started by the refusals: the prefix is still on SSD only.
    assert.equal((await e.query(hashes, "after")).kind, "loading");
    assert.equal(
      await srv.client.waitPrefetch({
        instanceId: e.instanceId,
        requestId: "after",
        waitMs: WAIT_MS,
      }),
      true,
    );
    assert.equal((await e.query(hashes, "after")).kind, "ready");
  } finally {
    await srv.client.unregisterContext(e.instanceId).catch(() => {});
    e.close();
    await srv.stop();
    await Deno.remove(dir, { recursive: true });
  }
});
