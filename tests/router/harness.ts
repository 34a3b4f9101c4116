/**
 * Test harness: runs fake backends and the router as real processes on ephemeral ports, and
 * cleans them up. Shared by the router tests and the router benchmark.
 *
 * @module
 */

import type { Behaviour, Recorded } from "./fake_backend.ts";

const REPO_ROOT = new URL("../../", import.meta.url).pathname;
const FAKE_BACKEND = new URL("./fake_backend.ts", import.meta.url).pathname;
const ROUTER_MAIN = new URL("../../router.ts", import.meta.url).pathname;
/** A child that has not printed its address by then is considered broken. */
const START_TIMEOUT_MS = 30_000;

/** A spawned process that printed a JSON line with its port. */
interface Spawned {
  child: Deno.ChildProcess;
  port: number;
  /** Everything the child wrote to stderr so far. */
  stderr: () => string;
  stop: () => Promise<void>;
}

async function spawnWithPort(
  args: string[],
  env: Record<string, string>,
): Promise<Spawned> {
  const child = new Deno.Command(Deno.execPath(), {
    args,
    cwd: REPO_ROOT,
    env,
    stdin: "null",
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  let errText = "";
  let resolvePort!: (p: number) => void;
  let rejectPort!: (e: Error) => void;
  const portP = new Promise<number>((res, rej) => {
    resolvePort = res;
    rejectPort = rej;
  });
  const pump = async (stream: ReadableStream<Uint8Array>, isErr: boolean) => {
    let buf = "";
    for await (const chunk of stream.pipeThrough(new TextDecoderStream())) {
      if (isErr) errText += chunk;
      if (isErr) continue;
      buf += chunk;
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        if (!line.startsWith("{")) continue;
        const j = JSON.parse(line) as { port?: number };
        if (typeof j.port === "number") resolvePort(j.port);
      }
    }
  };
  const pumps = Promise.all([pump(child.stdout, false), pump(child.stderr, true)]);
  const timer = setTimeout(
    () =>
      rejectPort(
        new Error(
          `child did not start within ${START_TIMEOUT_MS} ms: ${args.join(" ")}\n${errText}`,
        ),
      ),
    START_TIMEOUT_MS,
  );
  child.status.then((s) =>
    rejectPort(
      new Error(`child exited (${s.code}) before listening: ${args.join(" ")}\n${errText}`),
    )
  );
  let port: number;
  try {
    port = await portP;
  } catch (e) {
    try {
      child.kill("SIGKILL");
    } catch (_alreadyExited) {
      // The child is gone already; its status is awaited below.
    }
    await child.status;
    await pumps;
    throw e;
  } finally {
    clearTimeout(timer);
  }
  let stopped: Promise<void> | undefined;
  return {
    child,
    port,
    stderr: () => errText,
    stop: () =>
      stopped ??= (async () => {
        try {
          child.kill("SIGKILL");
        } catch (_alreadyExited) {
          // Exited on its own; nothing to kill.
        }
        await child.status;
        await pumps;
      })(),
  };
}

/** A running fake backend. */
export interface FakeBackend {
  url: string;
  port: number;
  control(patch: Partial<Behaviour>): Promise<void>;
  requests(): Promise<Recorded[]>;
  healthChecks(): Promise<number>;
  release(): Promise<void>;
  reset(): Promise<void>;
  stop(): Promise<void>;
}

/**
 * Starts `tests/router/fake_backend.ts` as a separate process.
 *
 * @example
 * ```ts
 * const p = await spawnBackend("P0");
 * await p.control({ failNext: 1 });
 * ```
 */
export async function spawnBackend(name: string, extraArgs: string[] = []): Promise<FakeBackend> {
  const s = await spawnWithPort(
    ["run", "--allow-net", FAKE_BACKEND, "--port", "0", "--name", name, ...extraArgs],
    {},
  );
  const url = `http://127.0.0.1:${s.port}`;
  const post = async (path: string, body?: unknown) => {
    const res = await fetch(url + path, { method: "POST", body: JSON.stringify(body ?? {}) });
    await res.body?.cancel();
    if (!res.ok) throw new Error(`${name}${path} answered HTTP ${res.status}`);
  };
  const rec = async () =>
    (await (await fetch(url + "/_record")).json()) as {
      requests: Recorded[];
      healthChecks: number;
    };
  return {
    url,
    port: s.port,
    control: (patch) => post("/_control", patch),
    requests: async () => (await rec()).requests,
    healthChecks: async () => (await rec()).healthChecks,
    release: () => post("/_release"),
    reset: () => post("/_reset"),
    stop: s.stop,
  };
}

/** A running router process. */
export interface RouterProcess {
  url: string;
  port: number;
  pid: number;
  /** Settles when the process exits. */
  status: Promise<Deno.CommandStatus>;
  stderr(): string;
  metrics(): Promise<string>;
  stop(): Promise<void>;
}

/**
 * Starts `router.ts` as a separate process on an ephemeral port.
 *
 * @example
 * ```ts
 * const r = await spawnRouter(["--prefill", p.url, "--decode", d.url]);
 * ```
 */
export async function spawnRouter(
  args: string[],
  env: Record<string, string> = {},
  opts: { legacyAbort?: boolean } = {},
): Promise<RouterProcess> {
  // `deno task router` runs with --unstable-no-legacy-abort (legacyAbort runs without it) and
  // --unstable-net (SO_REUSEPORT for --workers).
  const flags = opts.legacyAbort
    ? ["--unstable-net"]
    : ["--unstable-no-legacy-abort", "--unstable-net"];
  const s = await spawnWithPort(
    ["run", "--allow-all", ...flags, ROUTER_MAIN, "--port", "0", ...args],
    env,
  );
  const url = `http://127.0.0.1:${s.port}`;
  return {
    url,
    port: s.port,
    pid: s.child.pid,
    status: s.child.status,
    stderr: s.stderr,
    metrics: async () => await (await fetch(url + "/metrics")).text(),
    stop: s.stop,
  };
}

/** Runs the router CLI to completion (for flags it must refuse). */
export async function runRouterCli(
  args: string[],
  env: Record<string, string> = {},
): Promise<{ code: number; stderr: string }> {
  const out = await new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      "--allow-all",
      "--unstable-no-legacy-abort",
      "--unstable-net",
      ROUTER_MAIN,
      ...args,
    ],
    cwd: REPO_ROOT,
    env,
    stdin: "null",
    stdout: "piped",
    stderr: "piped",
  }).output();
  return { code: out.code, stderr: new TextDecoder().decode(out.stderr) };
}

/** Polls `check` every `intervalMs` until it returns true or `timeoutMs` passes. */
export async function waitFor(
  what: string,
  check: () => Promise<boolean> | boolean,
  timeoutMs = 10_000,
  intervalMs = 25,
): Promise<void> {
  const deadline = performance.now() + timeoutMs;
  while (!(await check())) {
    if (performance.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    }
    await new Promise((r) => setTimeout(r, intervalMs));
  }
}

/** The value of a Prometheus sample line `name{labels} value`, or 0 when absent. */
export function metricValue(
  text: string,
  name: string,
  labels: Record<string, string> = {},
): number {
  for (const line of text.split("\n")) {
    if (!line.startsWith(name)) continue;
    const rest = line.slice(name.length);
    if (rest[0] !== "{" && rest[0] !== " ") continue;
    const ok = Object.entries(labels).every(([k, v]) => rest.includes(`${k}="${v}"`));
    if (ok) return Number(line.slice(line.lastIndexOf(" ") + 1));
  }
  return 0;
}

/**
 * One request on a connection of its own (a fresh client), so the kernel picks a router worker
 * anew; the body is read whole before the client goes.
 */
export async function fresh(url: string, init: RequestInit = {}): Promise<Response> {
  const client = Deno.createHttpClient({});
  try {
    const res = await fetch(url, { ...init, client });
    const body = new Uint8Array(await res.arrayBuffer());
    return new Response(body, { status: res.status, headers: res.headers });
  } finally {
    client.close();
  }
}
