/**
 * bench/thread_cpu.ts, the peer bench's CPU accounting by thread name, over
 * a real process: a Python child whose threads name themselves, burn a set
 * amount of CPU (its own clock, no wall time) and exit on cue.
 */
import assert from "node:assert/strict";
import { cpuDeltaMs, sampleCpu } from "../../bench/thread_cpu.ts";
import { withinOrThrow } from "../../lib/timer_limit.ts";

/**
 * Thread "burner-1" burns 200 ms of CPU and waits; on the first stdin line it
 * exits and "burner-2" burns 100 ms (it lives on until stdin ends); each step
 * ends with a line on stdout.
 */
const CHILD = `
import sys, threading, time
def named(n):
    open(f"/proc/self/task/{threading.get_native_id()}/comm", "w").write(n)
def burn(s):
    t = time.thread_time()
    while time.thread_time() - t < s: pass
go1, go2, burnt, end = (threading.Event() for _ in range(4))
def one():
    named("burner-1"); burn(0.2); go1.set()
    go2.wait()
def two():
    named("burner-2"); go2.wait(); burn(0.1); burnt.set()
    end.wait()
t1 = threading.Thread(target=one); t2 = threading.Thread(target=two)
t1.start(); t2.start(); go1.wait()
print("ready", flush=True)
sys.stdin.readline(); go2.set(); t1.join(); burnt.wait()
print("done", flush=True)
sys.stdin.readline(); end.set()
`;

Deno.test("a thread that exits between two samples takes nothing away from its group's CPU", async () => {
  const child = new Deno.Command("/usr/bin/python3", {
    args: ["-c", CHILD],
    stdin: "piped",
    stdout: "piped",
  }).spawn();
  const lines = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  const stdin = child.stdin.getWriter();
  // The child's next line (reads are chunks, not lines), within 30 s: a child that never says
  // it would hang the suite.
  let buffered = "";
  const next = async (): Promise<string | undefined> => {
    const deadline = Date.now() + 30_000;
    while (!buffered.includes("\n")) {
      const r = await withinOrThrow(
        lines.read(),
        deadline - Date.now(),
        () => new Error("the child did not answer within 30 s"),
      );
      if (r.done) return undefined;
      buffered += r.value;
    }
    const at = buffered.indexOf("\n");
    const line = buffered.slice(0, at).trim();
    buffered = buffered.slice(at + 1);
    return line;
  };

  try {
    assert.equal(await next(), "ready");
    const roles = { P: [child.pid] };
    const s0 = sampleCpu(roles);
    await stdin.write(new TextEncoder().encode("go\n"));
    assert.equal(await next(), "done"); // burner-1 exited (200 ms before), burner-2 burned 100 ms
    const d = cpuDeltaMs(s0, sampleCpu(roles));
    const burner = d["P burner"];
    assert.ok(burner !== undefined && burner >= 90 && burner < 150, `P burner ${burner} ms`);
  } finally {
    try {
      child.kill("SIGKILL"); // done or stuck: nothing more is read from it
    } catch { /* exited */ }
    await stdin.close().catch(() => {});
    await lines.cancel().catch(() => {});
    await child.status;
  }
});
