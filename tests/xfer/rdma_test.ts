/**
 * The RDMA verbs transport where no RDMA device exists (every machine we
 * have): loading libibverbs.so.1, the errors for a missing library and for
 * no device, and parameter validation. Its data path has not run on
 * hardware (docs/transfer.md).
 */
import assert from "node:assert/strict";
import { CompletionRing, Engine, NativeError } from "../../ffi/mod.ts";
import { rdmaDevices, XferEndpoint, type XferEndpointOptions } from "../../ffi/xfer.ts";

function withPool<T>(fn: (o: Pick<XferEndpointOptions, "pool" | "ring">) => T): T {
  const engine = Engine.open({ backend: "host" });
  const pool = engine.createPool(1 << 20);
  const ring = new CompletionRing(64);
  try {
    return fn({ pool, ring });
  } finally {
    ring.destroy();
    pool.close();
    engine.close();
  }
}

function rdmaError(opts: Partial<XferEndpointOptions>): NativeError {
  return withPool((base) => {
    try {
      XferEndpoint.open({ transport: "rdma", streams: 2, ...base, ...opts });
    } catch (e) {
      assert.ok(e instanceof NativeError, String(e));
      return e;
    }
    assert.fail("XferEndpoint.open(rdma) succeeded on a machine without an RDMA device");
  });
}

/** What this machine has: "no-lib", "no-device" or "devices". */
function rdmaSituation(): "no-lib" | "no-device" | "devices" {
  try {
    return rdmaDevices().length ? "devices" : "no-device";
  } catch (e) {
    if (e instanceof NativeError && e.codeName === "PF_ENODEV") return "no-lib";
    throw e;
  }
}
const situation = rdmaSituation();

Deno.test("without libibverbs the RDMA transport fails naming the library it could not load", () => {
  Deno.env.set("PEGAFLOW_LIBIBVERBS", "/nonexistent/libibverbs.so.1");
  try {
    const e = rdmaError({});
    assert.equal(e.codeName, "PF_ENODEV");
    assert.match(e.message, /\/nonexistent\/libibverbs\.so\.1 not found/);
    assert.match(e.message, /use the TCP transport/);
    assert.throws(() => rdmaDevices(), /libibverbs\.so\.1 not found/);
  } finally {
    Deno.env.delete("PEGAFLOW_LIBIBVERBS");
  }
});

Deno.test({
  name: "with no RDMA device, opening RDMA says none was found and that TCP is used",
  ignore: situation === "devices",
  fn() {
    const e = rdmaError({});
    assert.equal(e.codeName, "PF_ENODEV");
    if (situation === "no-lib") {
      assert.match(e.message, /libibverbs\.so\.1 not found/);
    } else {
      assert.match(e.message, /no RDMA device found .*libibverbs\.so\.1 lists none/);
      assert.match(e.message, /the TCP transport is used instead/);
    }
  },
});

Deno.test("RDMA parameters are validated before any device is touched", () => {
  const cases: [Partial<XferEndpointOptions>, RegExp][] = [
    [{ streams: 0 }, /streams \(QPs per NIC per peer\) 0; expected 1\.\.64/],
    [{ streams: 65 }, /streams \(QPs per NIC per peer\) 65/],
    [{ nics: ["mlx5_0", ""] }, /nics "mlx5_0,": empty or over-long device name/],
    [{ nics: ["mlx5_0:0"] }, /nics entry "mlx5_0:0": port must be 1\.\.255/],
    [{ nics: ["mlx5_0:x"] }, /port must be 1\.\.255/],
    [{ nics: ["mlx5 0"] }, /bad character ' ' in device name/],
    [{ stripeBytes: 100 }, /stripe_bytes 100 below 4096/],
  ];
  for (const [opts, re] of cases) {
    const e = rdmaError(opts);
    assert.equal(e.codeName, "PF_EINVAL", `${JSON.stringify(opts)}: ${e.message}`);
    assert.match(e.message, re);
  }
});

Deno.test({
  name: "a NIC name libibverbs does not list is refused with the names it does list",
  ignore: situation !== "devices",
  fn() {
    const e = rdmaError({ nics: ["pegaflow_no_such_nic"] });
    assert.equal(e.codeName, "PF_EINVAL");
    assert.match(e.message, /no RDMA device named "pegaflow_no_such_nic" \(found: /);
  },
});
