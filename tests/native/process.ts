import assert from "node:assert/strict";

/** Test helpers for processes: spawn a Deno child and read its stdout line by line; count this
 * process's threads by name. */

/** A running child with a line reader over its stdout. */
export interface Child {
  proc: Deno.ChildProcess;
  /** Next stdout line (without the newline); null at EOF. */
  line(): Promise<string | null>;
  /** Closes the child's stdin (its signal to finish). */
  closeStdin(): Promise<void>;
}

const DENO = Deno.execPath();

/** Starts `deno run -A <script> ...args` with piped stdin/stdout. */
export function spawnDeno(
  script: string | URL,
  args: string[],
  env: Record<string, string> = {},
): Child {
  const path = script instanceof URL ? decodeURIComponent(script.pathname) : script;
  const proc = new Deno.Command(DENO, {
    args: ["run", "-A", path, ...args],
    stdin: "piped",
    stdout: "piped",
    stderr: "inherit",
    env,
  }).spawn();
  const reader = proc.stdout.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  let eof = false;
  const writer = proc.stdin.getWriter();
  return {
    proc,
    async line() {
      for (;;) {
        const nl = buf.indexOf("\n");
        if (nl >= 0) {
          const l = buf.slice(0, nl);
          buf = buf.slice(nl + 1);
          return l;
        }
        if (eof) {
          if (buf.length === 0) return null;
          const l = buf;
          buf = "";
          return l;
        }
        const { value, done } = await reader.read();
        if (done) eof = true;
        else buf += value;
      }
    },
    async closeStdin() {
      await writer.close();
    },
  };
}

/** Hex string → bytes. */
export function unhex(s: string): Uint8Array {
  const out = new Uint8Array(s.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(s.slice(2 * i, 2 * i + 2), 16);
  return out;
}

/**
 * How many of this process's threads are named `name` (/proc/self/task/TID/comm), once
 * at least `atLeast` are (threads name themselves as they start: up to 2 s).
 */
export async function threadsNamed(name: string, atLeast = 0): Promise<number> {
  const count = () =>
    [...Deno.readDirSync("/proc/self/task")].filter((t) => {
      try {
        return Deno.readTextFileSync(`/proc/self/task/${t.name}/comm`).trim() === name;
      } catch {
        return false; // the thread ended while we listed
      }
    }).length;
  let n = count();
  for (let i = 0; i < 200 && n < atLeast; i++) {
    await new Promise((r) => setTimeout(r, 10));
    n = count();
  }
  return n;
}

/**
 * Threads of each name in `atLeast` (counted once that many are named, up to 2 s) in a
 * child process with an engine of `backend` open, then after it closed
 * (thread_names_child.ts).
 */
export async function threadNamesOf(
  backend: "host" | "cuda",
  atLeast: Record<string, number>,
): Promise<{ open: Record<string, number>; closed: Record<string, number> }> {
  const args = Object.entries(atLeast).map(([n, min]) => `${n}=${min}`);
  const child = spawnDeno(new URL("./thread_names_child.ts", import.meta.url), [backend, ...args]);
  const timer = setTimeout(() => child.proc.kill("SIGKILL"), 30_000);
  try {
    const line = await child.line();
    assert.ok(line, "the child printed nothing");
    assert.equal((await child.proc.status).code, 0);
    return JSON.parse(line);
  } finally {
    clearTimeout(timer);
    await child.closeStdin().catch(() => {});
  }
}
