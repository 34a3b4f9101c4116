/**
 * `--backend` on a machine without a usable GPU (real server processes):
 * `cuda` refuses the start before the pool, naming the flag, the reason and
 * what to use instead (the sockets bound before it removed); `auto` serves on the host backend and says why in one
 * info line. Skipped where a GPU is usable.
 */
import assert from "node:assert/strict";
import { deviceCount } from "../../ffi/mod.ts";
import { runServerToEnd, startServer } from "./harness.ts";

/** Whether the cuda backend finds a device here (the tests are about machines where it does not). */
function gpuUsable(): boolean {
  try {
    return deviceCount("cuda") > 0;
  } catch {
    return false;
  }
}
const ignore = gpuUsable();

Deno.test({
  name: "--backend cuda without a usable GPU refuses the start naming the flag and the way out",
  ignore,
  async fn() {
    const dir = await Deno.makeTempDir({ prefix: "pegaflow-backend-" });
    const path = `${dir}/grpc.sock`;
    let r;
    try {
      r = await runServerToEnd(["--backend", "cuda", "--uds", path]);
      // The sockets bound before the refusal are gone with it.
      assert.deepEqual([...Deno.readDirSync(dir)].map((e) => e.name), [], r.stderr);
    } finally {
      await Deno.remove(dir, { recursive: true });
    }
    assert.equal(r.code, 1, r.stderr);
    const lines = r.stderr.split("\n").filter((l) => l.startsWith("{")).map((l) => JSON.parse(l));
    const failed = lines.filter((l) => l.msg === "start-up failed");
    assert.equal(failed.length, 1, r.stderr);
    const error = String(failed[0].error);
    assert.match(error, /^--backend cuda: no usable GPU: pf_device_count/);
    assert.match(error, /use --backend host or --backend auto/);
    assert.ok(!lines.some((l) => l.msg === "pinned pool ready"), "the pool was built");
  },
});

Deno.test({
  name: "--backend auto without a usable GPU serves on host and logs why, once",
  ignore,
  async fn() {
    const srv = await startServer(["--backend", "auto"]);
    try {
      const lines = srv.logs().map((l) => JSON.parse(l) as Record<string, unknown>);
      const why = lines.filter((l) => String(l.msg).startsWith("--backend auto: no usable GPU"));
      assert.equal(why.length, 1, srv.logs().join("\n"));
      assert.equal(why[0].level, "info");
      assert.equal(why[0].backend, "host");
      assert.match(String(why[0].reason), /\S/);
      const ready = lines.find((l) => l.msg === "pinned pool ready");
      assert.equal(ready?.backend, "host");
      assert.equal((await srv.client.health()).status, "ok");
    } finally {
      await srv.stop();
    }
  },
});
