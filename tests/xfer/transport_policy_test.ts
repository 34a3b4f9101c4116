/**
 * The transport policy: `auto` falls back to TCP loudly (once) when RDMA is
 * unavailable, explicit choices never fall back, configuration errors are
 * thrown, and the transport in use shows in the metrics.
 */
import assert from "node:assert/strict";
import { Registry } from "prom-client";
import { CompletionRing, Engine, NativeError } from "../../ffi/mod.ts";
import { rdmaDevices, XferBatch } from "../../ffi/xfer.ts";
import { Logger } from "../../lib/log.ts";
import { openTransport, transportInUse } from "../../lib/transfer/transport.ts";
import { registerTransferMetrics } from "../../lib/transfer/metrics.ts";

let hasDevice = false;
try {
  hasDevice = rdmaDevices().length > 0;
} catch { /* no libibverbs: no device either */ }

function setup() {
  const engine = Engine.open({ backend: "host" });
  const pool = engine.createPool(4 << 20);
  const ring = new CompletionRing(256);
  const lines: Record<string, unknown>[] = [];
  const log = new Logger("debug", {}, (l) => lines.push(JSON.parse(l)));
  return {
    engine,
    pool,
    ring,
    lines,
    log,
    async close() {
      await ring.shutdown();
      ring.destroy();
      pool.close();
      engine.close();
    },
  };
}

Deno.test({
  name: "auto falls back to TCP with one loud warning naming why, and metrics show TCP",
  ignore: hasDevice,
  async fn() {
    const s = setup();
    try {
      const first = openTransport(
        s.pool,
        s.ring,
        { transport: "auto", bindAddr: "127.0.0.1" },
        s.log,
      );
      assert.equal(first.name, "tcp");
      assert.equal(transportInUse(), "tcp");
      assert.match(
        first.fallbackReason!,
        /PF_ENODEV: .*(no RDMA device found|libibverbs\.so\.1 not found)/,
      );
      const warns = s.lines.filter((l) => l.level === "warn");
      assert.equal(warns.length, 1);
      assert.match(String(warns[0].msg), /RDMA UNAVAILABLE: cross-node transfers use TCP/);
      assert.equal(warns[0].reason, first.fallbackReason);

      // A second endpoint in the same process does not warn again.
      const second = openTransport(
        s.pool,
        s.ring,
        { transport: "auto", bindAddr: "127.0.0.1" },
        s.log,
      );
      assert.equal(s.lines.filter((l) => l.level === "warn").length, 1);

      // One READ from the second endpoint's pool, then the metrics.
      const registry = new Registry();
      registerTransferMetrics(registry, () => first.endpoint);
      const peer = first.endpoint.createPeer();
      await peer.connect(`127.0.0.1:${second.endpoint.info().port}`, 5000);
      const res = await peer.submit(new XferBatch(1).reset("read", 5000).seg(0, 1 << 20, 4096));
      assert.equal(res.statusName, "PF_OK");
      const text = await registry.metrics();
      assert.match(text, /pegaflow_transfer_transport\{transport="tcp"\} 1/);
      assert.match(text, /pegaflow_transfer_transport\{transport="rdma"\} 0/);
      assert.match(text, /pegaflow_transfer_batches_total\{result="ok"\} 1/);
      assert.match(text, /pegaflow_transfer_peers 1/);
      // Counters do not double count across scrapes.
      assert.match(await registry.metrics(), /pegaflow_transfer_batches_total\{result="ok"\} 1/);
      await first.endpoint.close();
      await second.endpoint.close();
    } finally {
      await s.close();
    }
  },
});

Deno.test({
  name: "an explicit rdma choice never falls back to TCP",
  ignore: hasDevice,
  async fn() {
    const s = setup();
    try {
      assert.throws(
        () => openTransport(s.pool, s.ring, { transport: "rdma" }, s.log),
        (e: unknown) => e instanceof NativeError && e.codeName === "PF_ENODEV",
      );
      assert.equal(s.lines.length, 0);
    } finally {
      await s.close();
    }
  },
});

Deno.test("configuration errors are thrown, not hidden behind a TCP fallback", async () => {
  const s = setup();
  try {
    assert.throws(
      () => openTransport(s.pool, s.ring, { transport: "auto", nics: ["bad name"] }, s.log),
      /bad character ' ' in device name/,
    );
    assert.throws(
      () => openTransport(s.pool, s.ring, { transport: "auto", qpsPerNic: 0 }, s.log),
      /qpsPerNic 0; expected an integer in 1\.\.64/,
    );
    assert.throws(
      // deno-lint-ignore no-explicit-any
      () => openTransport(s.pool, s.ring, { transport: "udp" as any }, s.log),
      /transport "udp"; expected auto, tcp or rdma/,
    );
    assert.equal(s.lines.length, 0);
  } finally {
    await s.close();
  }
});
