/**
 * Start-up against a taken port, and what a router logs for a backend that is down at start.
 *
 * Workers bind with SO_REUSEPORT, which Linux lets any process of the same user share: a second
 * router started on a running one's port printed "listening" and took half of its clients (two
 * routers with separate backend state behind one port). Now it exits 2 naming the flags, like a
 * --workers 1 router always did. A backend found down at start was logged twice ("backend out of
 * service", then "... at start"); now once.
 */
import assert from "node:assert/strict";
import { spawnRouter } from "./harness.ts";

const ROUTER = new URL("../../router.ts", import.meta.url).pathname;

const DEAD = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"];

/** Runs the router CLI; a router still running after `ms` (it listened) is killed, code null. */
async function exitWithin(
  args: string[],
  ms: number,
): Promise<{ code: number | null; err: string }> {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "--allow-all", "--unstable-no-legacy-abort", "--unstable-net", ROUTER, ...args],
    stdin: "null",
    stdout: "null",
    stderr: "piped",
  }).spawn();
  const err = new Response(child.stderr).text();
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<null>((r) => (timer = setTimeout(() => r(null), ms)));
  const st = await Promise.race([child.status, late]);
  clearTimeout(timer);
  if (st === null) child.kill("SIGKILL");
  await child.status;
  return { code: st === null ? null : st.code, err: await err };
}

for (const workers of ["2", "auto"]) {
  Deno.test(`a second router on a running router's port is refused (--workers ${workers})`, async () => {
    const first = await spawnRouter([...DEAD, "--workers", "2"]);
    try {
      const second = await exitWithin(
        [...DEAD, "--port", String(first.port), "--workers", workers],
        30_000,
      );
      assert.notEqual(
        second.code,
        null,
        `the second router listened on the taken port:\n${second.err}`,
      );
      assert.equal(second.code, 2, second.err);
      assert.match(
        second.err,
        new RegExp(`--host/--port: cannot listen on 127\\.0\\.0\\.1:${first.port}: .*in use`, "i"),
      );
    } finally {
      await first.stop();
    }
  });
}

Deno.test("a backend down at start is logged once", async () => {
  const r = await spawnRouter([...DEAD, "--workers", "1"]);
  try {
    const down = r.stderr().split("\n").filter((l) => l.includes("out of service"));
    assert.equal(down.length, 2, `one line per backend (P and D):\n${down.join("\n")}`);
  } finally {
    await r.stop();
  }
});
