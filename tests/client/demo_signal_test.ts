/**
 * `deno task demo` stopped by Ctrl-C or SIGTERM: its engine's KV regions are
 * shm files that outlive the process unless closed. Its `finally` does not
 * run on a signal, so a stopped demo left them in /dev/shm (32 files, GiBs
 * for a long prompt). Now a signal closes them, and the demo exits as a
 * signal would (130 / 143).
 */
import assert from "node:assert/strict";
import { startServer } from "../server/harness.ts";

const ROOT = new URL("../..", import.meta.url).pathname;

function shmOf(pid: number): string[] {
  const out: string[] = [];
  for (const e of Deno.readDirSync("/dev/shm")) if (e.name.includes(`-${pid}-`)) out.push(e.name);
  return out;
}

for (const [signal, code] of [["SIGINT", 130], ["SIGTERM", 143]] as const) {
  Deno.test(`demo stopped by ${signal} removes its shared-memory regions and exits ${code}`, async () => {
    const srv = await startServer(["--pool-size", "64mb"]);
    const child = new Deno.Command(Deno.execPath(), {
      args: [
        "run",
        "-A",
        "lib/client/demo.ts",
        "--addr",
        srv.grpc,
        "--backend",
        "host",
        "--tokens",
        "1024",
        "--requests",
        "1000000",
      ],
      cwd: ROOT,
      stdout: "piped",
      stderr: "piped",
    }).spawn();
    try {
      // The first line comes once the engine registered (its regions exist).
      const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
      let seen = "";
      const deadline = Date.now() + 60_000;
      while (!seen.includes("\n") && Date.now() < deadline) {
        const r = await reader.read();
        if (r.done) break;
        seen += r.value;
      }
      assert.match(seen, /^server /, `demo's first line: ${seen}`);
      assert.ok(shmOf(child.pid).length > 0, "the demo's regions are in /dev/shm");
      child.kill(signal);
      const st = await child.status;
      reader.releaseLock();
      await child.stdout.cancel().catch(() => {});
      const err = new TextDecoder().decode(await new Response(child.stderr).arrayBuffer());
      assert.equal(st.code, code, err);
      assert.match(err, new RegExp(`demo stopped by ${signal}`));
      assert.deepEqual(shmOf(child.pid), [], "regions left in /dev/shm");
    } finally {
      try {
        child.kill("SIGKILL");
      } catch { /* exited */ }
      for (const n of shmOf(child.pid)) Deno.removeSync(`/dev/shm/${n}`);
      await srv.stop();
    }
  });
}
