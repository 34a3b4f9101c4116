/**
 * Every refused or failed RPC's log line names the instance, TP/PP rank and
 * request id it was about as fields, also when the error itself carries
 * none: a registration refused by its checks, an UnregisterContext of an
 * unknown instance, and an internal failure (a native copy that failed for
 * a reason of the server's, "rpc failed unexpectedly"). In-process: a
 * grpc-js server over a KvEngine on the host backend whose copies fail.
 */
import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { PegaflowClient } from "../../lib/client/client.ts";
import { SimEngine } from "../../lib/client/sim_engine.ts";
import { KvEngine, PROTOCOL_VERSION } from "../../lib/engine/engine.ts";
import type { NativePort } from "../../lib/engine/ports.ts";
import { Logger } from "../../lib/log.ts";
import { Sessions } from "../../lib/server/sessions.ts";
import { ServerMetrics } from "../../lib/server/metrics.ts";
import { KvStore } from "../../lib/storage/store.ts";
import { MODEL, openTestNative, serveEngine, silent } from "../engine/setup.ts";
import { refusedWith } from "./harness.ts";

Deno.test("refusals and internal failures log the request's instance, ranks and request id", async () => {
  const native = await openTestNative();
  // Every copy fails the way a broken native layer would: a plain Error, not the engine's.
  const failing: NativePort = {
    ...native,
    submit: () => Promise.reject(new Error("injected: the copy engine broke")),
  };
  const store = new KvStore({ capacityBytes: native.poolBytes });
  const engine = new KvEngine({ native: failing, store, log: silent, leaseTtlMs: 60_000 });
  const lines: Record<string, unknown>[] = [];
  const log = new Logger("info", {}, (l) => lines.push(JSON.parse(l)));
  const sessions = new Sessions();
  const metrics = new ServerMetrics(() => store.stats());
  const { server, port } = await serveEngine(engine, sessions, metrics, log);
  const client = new PegaflowClient(`127.0.0.1:${port}`, { deadlineMs: 10_000 });
  // The instance's two TP ranks; rank 1 is the one whose calls fail.
  const [rank0, sim] = [0, 1].map((tpRank) =>
    SimEngine.create({
      client,
      instanceId: "ids-a",
      namespace: "ns-ids",
      model: MODEL,
      numBlocks: 16,
      backend: "host",
      tpRank,
      tpSize: 2,
    })
  );
  const lineOf = (msg: string, method: string) => {
    const l = lines.find((l) => l.msg === msg && l.method === method);
    assert.ok(
      l,
      `no "${msg}" line for ${method}:\n${lines.map((l) => JSON.stringify(l)).join("\n")}`,
    );
    return l;
  };
  try {
    // A registration its checks refuse: the error names the ranks only in its text.
    await assert.rejects(
      client.registerContext({ ...sim.registration(), clientVersion: "pegaflow-0" }),
      refusedWith("FAILED_PRECONDITION", /client version/),
    );
    const reg = lineOf("rpc refused", "RegisterContext");
    assert.equal(reg.instance, "ids-a");
    assert.equal(reg.tp_rank, 1);
    assert.equal(reg.pp_rank, 0);

    await assert.rejects(
      client.unregisterContext("ids-ghost"),
      refusedWith("FAILED_PRECONDITION", /not registered/),
    );
    assert.equal(lineOf("rpc refused", "UnregisterContext").instance, "ids-ghost");

    // An internal failure: INTERNAL to the client, an error line with the ids for the operator.
    engine.register({ ...rank0.registration(), clientVersion: PROTOCOL_VERSION });
    engine.register({ ...sim.registration(), clientVersion: PROTOCOL_VERSION });
    const hashes = chainedBlockHashes(syntheticTokens(7, 16 * 2), 16);
    await assert.rejects(
      client.save({
        instanceId: "ids-a",
        tpRank: 1,
        ppRank: 0,
        blockIds: [0, 1],
        blockHashes: hashes,
        requestId: "req-internal",
      }),
      refusedWith("INTERNAL", /injected/),
    );
    const save = lineOf("rpc failed unexpectedly", "Save");
    assert.equal(save.instance, "ids-a");
    assert.equal(save.tp_rank, 1);
    assert.equal(save.pp_rank, 0);
    assert.equal(save.request, "req-internal");
  } finally {
    client.close();
    server.forceShutdown();
    await engine.close();
    await native.close();
    rank0.close();
    sim.close();
  }
});
