/**
 * Test harness: starts `main.ts` as a real child process on ephemeral ports,
 * parses its one stdout line for the bound addresses, and stops it (SIGTERM,
 * then SIGKILL) when the test ends. Server stderr is kept for assertions and
 * printed when a test fails to start it.
 */
import assert from "node:assert/strict";
import { PegaflowClient, type PegaflowError } from "../../lib/client/client.ts";
import { SimEngine, type SimEngineOptions } from "../../lib/client/sim_engine.ts";
import { serverRunArgs } from "../../lib/server/v8_flags.ts";

const DENO = Deno.execPath();
const ROOT = new URL("../../", import.meta.url).pathname;
/** Start-up budget: compile + pool + bind on a loaded 2-core machine. */
const START_TIMEOUT_MS = 60_000;

/** A running server child. */
export interface ServerProc {
  grpc: string;
  http: string;
  /** The `--uds` socket path from the readiness line (null without --uds). */
  uds: string | null;
  pid: number;
  /** Resolves when the server process exits (however it ends). */
  status: Promise<Deno.CommandStatus>;
  client: PegaflowClient;
  /** Server log lines so far (JSON strings). */
  logs(): string[];
  /** GET/POST on the HTTP side. */
  http_get(path: string): Promise<Response>;
  http_post(path: string, body?: unknown): Promise<Response>;
  /** Metric value by name and optional exact label string, e.g. `{method="Save",status="OK"}`. */
  metric(name: string, labels?: string): Promise<number>;
  stop(): Promise<void>;
}

/**
 * `deno run` arguments of a test server: host backend, ephemeral ports, `defaults`, a 64 MiB pool
 * unless `flags` names one, then `flags`.
 */
function serverArgs(defaults: string[], flags: string[]): string[] {
  const args = [
    ...serverRunArgs(), // as `deno task serve` runs it
    "main.ts",
    "--addr",
    "127.0.0.1:0",
    "--http-addr",
    "127.0.0.1:0",
    "--backend",
    "host",
    ...defaults,
  ];
  if (!flags.includes("--pool-size")) args.push("--pool-size", "64mb");
  return [...args, ...flags];
}

/**
 * Starts a server with these extra flags (defaults: host backend, 64 MiB pool, ephemeral ports);
 * `netns` runs it inside that network namespace (`ip netns exec`, which execs: the pid is the
 * server's).
 */
export async function startServer(
  flags: string[] = [],
  env: Record<string, string> = {},
  netns?: string,
): Promise<ServerProc> {
  const args = serverArgs(["--log-level", "debug"], flags);
  const child = new Deno.Command(netns ? "ip" : DENO, {
    args: netns ? ["netns", "exec", netns, DENO, ...args] : args,
    cwd: ROOT,
    stdout: "piped",
    stderr: "piped",
    env,
  }).spawn();
  const lines: string[] = [];
  const decoder = new TextDecoder();
  (async () => {
    let buf = "";
    for await (const chunk of child.stderr) {
      buf += decoder.decode(chunk, { stream: true });
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        lines.push(buf.slice(0, i));
        buf = buf.slice(i + 1);
      }
    }
  })();
  const reader = child.stdout.getReader();
  let out = "";
  const deadline = Date.now() + START_TIMEOUT_MS;
  let listening: { grpc: string; http: string; uds: string | null } | undefined;
  while (!listening) {
    const timer = new Promise<null>((r) =>
      setTimeout(() => r(null), Math.max(0, deadline - Date.now()))
    );
    const r = await Promise.race([reader.read(), timer]);
    if (r === null || r.done) {
      try {
        child.kill("SIGKILL");
      } catch (_e) { /* already gone */ }
      await child.status;
      throw new Error(`server did not announce its ports; stderr:\n${lines.join("\n")}`);
    }
    out += decoder.decode(r.value);
    const nl = out.indexOf("\n");
    if (nl >= 0) listening = JSON.parse(out.slice(0, nl)).listening;
  }
  // Keep draining stdout so the child never blocks on a full pipe.
  (async () => {
    while (!(await reader.read()).done) { /* drain */ }
  })();
  const client = new PegaflowClient(listening.grpc);
  const base = `http://${listening.http}`;
  const proc: ServerProc = {
    grpc: listening.grpc,
    http: listening.http,
    uds: listening.uds,
    pid: child.pid,
    status: child.status,
    client,
    logs: () => lines,
    http_get: (p) => fetch(base + p),
    http_post: (p, body) =>
      fetch(base + p, {
        method: "POST",
        body: body === undefined ? undefined : JSON.stringify(body),
      }),
    async metric(name, labels = "") {
      const text = await (await fetch(base + "/metrics")).text();
      for (const line of text.split("\n")) {
        if (line.startsWith(name + labels + " ")) {
          return Number(line.slice(name.length + labels.length + 1));
        }
      }
      return NaN;
    },
    async stop() {
      client.close();
      try {
        child.kill("SIGTERM");
      } catch (_e) { /* already gone */ }
      const t = setTimeout(() => {
        try {
          child.kill("SIGKILL");
        } catch (_e) { /* already gone */ }
      }, 10_000);
      await child.status;
      clearTimeout(t);
    },
  };
  return proc;
}

/** Unique ids per test so parallel files never share names. */
export function uid(prefix: string): string {
  return `${prefix}-${Deno.pid}-${Math.random().toString(36).slice(2, 8)}`;
}

/** Shared-memory names this process's regions mapped into `pid`, read from /proc. */
export function shmMappings(pid: number, needle: string): string[] {
  const maps = Deno.readTextFileSync(`/proc/${pid}/maps`);
  return maps.split("\n").filter((l) => l.includes("/dev/shm/") && l.includes(needle));
}

/** A simulated engine on the host backend, talking to `srv`. */
export function hostSim(
  srv: ServerProc,
  o: Omit<SimEngineOptions, "client" | "backend">,
): SimEngine {
  return SimEngine.create({ client: srv.client, ...o, backend: "host" });
}

/**
 * For `assert.rejects`: the call was refused with gRPC status `name` (e.g. `"INVALID_ARGUMENT"`)
 * and, when given, details matching `detail`.
 */
export function refusedWith(name: string, detail?: RegExp): (e: unknown) => true {
  return (e: unknown) => {
    const pe = e as PegaflowError;
    assert.equal(pe.codeName, name, pe.message);
    if (detail) assert.match(pe.details, detail);
    return true;
  };
}

/**
 * Runs `main.ts` to its end with these extra flags (defaults: host backend, 64 MiB pool,
 * ephemeral ports) and environment, for starts that must be refused; kills it if it still runs
 * after the start-up budget.
 */
export async function runServerToEnd(
  flags: string[],
  env: Record<string, string> = {},
): Promise<{ code: number; stdout: string; stderr: string }> {
  const { status, stdout, stderr } = await spawnServer(flags, env).ended();
  return { code: status.code, stdout, stderr };
}

/** Generous bound for server-side bookkeeping that follows a load's last word. */
const SETTLE_MS = 10_000;

/** Polls a metric until it equals `want` (bookkeeping after a copy is asynchronous). */
export async function metricBecomes(srv: ServerProc, name: string, want: number): Promise<void> {
  const deadline = Date.now() + SETTLE_MS;
  let got = await srv.metric(name);
  while (got !== want && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 20));
    got = await srv.metric(name);
  }
  if (got !== want) throw new Error(`${name}: ${got} after ${SETTLE_MS} ms, want ${want}`);
}

/** A server child watched from its first line: for what happens while it starts. */
export interface StartingServer {
  pid: number;
  /** The first JSON log line whose `msg` is `msg`; rejects if the process ends without one. */
  logged(msg: string): Promise<Record<string, unknown>>;
  kill(signal: Deno.Signal): void;
  /** The process's end: status, stdout and stderr in full (SIGKILLed after the start-up budget). */
  ended(): Promise<{ status: Deno.CommandStatus; stdout: string; stderr: string }>;
}

/**
 * Spawns `main.ts` with these extra flags (defaults: host backend, 64 MiB pool, ephemeral
 * ports) and environment, without waiting for it to start.
 */
export function spawnServer(flags: string[], env: Record<string, string> = {}): StartingServer {
  const child = new Deno.Command(DENO, {
    args: serverArgs([], flags),
    cwd: ROOT,
    stdout: "piped",
    stderr: "piped",
    env,
  }).spawn();
  const timer = setTimeout(() => child.kill("SIGKILL"), START_TIMEOUT_MS);
  const text = (s: ReadableStream<Uint8Array>) => new Response(s).text();
  let stderr = "";
  const waiters: { msg: string; resolve: (l: Record<string, unknown>) => void }[] = [];
  const lineOf = (msg: string) =>
    stderr.split("\n").map((l) => {
      try {
        return JSON.parse(l) as Record<string, unknown>;
      } catch {
        return undefined;
      }
    }).find((l) => l?.msg === msg);
  const errDone = (async () => {
    const dec = new TextDecoder();
    for await (const chunk of child.stderr) {
      stderr += dec.decode(chunk, { stream: true });
      for (const w of waiters.splice(0)) {
        const l = lineOf(w.msg);
        if (l) w.resolve(l);
        else waiters.push(w);
      }
    }
    stderr += dec.decode();
  })();
  const end = Promise.all([child.status, text(child.stdout), errDone]).then(([status, stdout]) => {
    clearTimeout(timer);
    return { status, stdout, stderr };
  });
  return {
    pid: child.pid,
    logged: (msg) =>
      new Promise((resolve, reject) => {
        const l = lineOf(msg);
        if (l) return resolve(l);
        waiters.push({ msg, resolve });
        end.then(() => reject(new Error(`the server ended without logging ${msg}:\n${stderr}`)));
      }),
    kill: (signal) => child.kill(signal),
    ended: () => end,
  };
}
