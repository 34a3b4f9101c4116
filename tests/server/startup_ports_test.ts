/**
 * A listening address that is taken refuses the start BEFORE the pinned pool
 * is built (building a default pool takes seconds): the log has no pool line
 * at all, and its one error line names the flag and the address; exit
 * status 1 (docs/server.md, "Flags"). Real server processes, one per flag
 * the server binds: --addr (behind the GOAWAY guard, and without it),
 * --http-addr, --uds, --peer-rpc-port, --xfer-port. And a transfer endpoint
 * that cannot open (no RDMA device for --transport rdma) names --transport.
 */
import assert from "node:assert/strict";
import { runServerToEnd } from "./harness.ts";

/** Log lines of the pool being built: none may come before a refused port. */
const POOL_LINES = ["pool creation progress", "native engine open", "pinned pool ready"];

/** The JSON log lines of a run's stderr (anything else is skipped). */
function logLines(stderr: string): Record<string, unknown>[] {
  return stderr.split("\n").flatMap((l) => {
    try {
      return [JSON.parse(l) as Record<string, unknown>];
    } catch {
      return [];
    }
  });
}

/**
 * Runs a server with `flags` to its end and checks it was refused with exit
 * status 1, before any pool line, by one `start-up failed` line whose error
 * matches `error`. Returns the log lines.
 */
async function refusedBeforePool(
  flags: string[],
  error: RegExp,
): Promise<Record<string, unknown>[]> {
  const r = await runServerToEnd(["--pool-progress-ms", "10", ...flags]);
  assert.equal(r.code, 1, `exit status ${r.code}; stderr:\n${r.stderr}`);
  assert.equal(r.stdout, "", "no listening line");
  const lines = logLines(r.stderr);
  const failed = lines.filter((l) => l.msg === "start-up failed");
  assert.equal(failed.length, 1, r.stderr);
  assert.match(String(failed[0].error), error);
  const early = lines.filter((l) => POOL_LINES.includes(String(l.msg)));
  assert.deepEqual(early.map((l) => l.msg), [], "the pool was built before the port was checked");
  return lines;
}

/** A TCP listener on `hostname`, any free port, held by the test. */
function taken(hostname: string): Deno.TcpListener {
  return Deno.listen({ hostname, port: 0 });
}

Deno.test("a taken --addr refuses the start before the pool, naming the flag and address", async () => {
  const l = taken("127.0.0.1");
  try {
    const addr = `127.0.0.1:${l.addr.port}`;
    await refusedBeforePool(
      ["--addr", addr],
      new RegExp(`^--addr ${addr}: cannot listen: .*in use`),
    );
  } finally {
    l.close();
  }
});

Deno.test("a taken --addr without the GOAWAY guard is refused before the pool too", async () => {
  const l = taken("127.0.0.1");
  try {
    const addr = `127.0.0.1:${l.addr.port}`;
    await refusedBeforePool(
      ["--goaway-guard", "false", "--addr", addr],
      new RegExp(`^--addr ${addr}: cannot listen: .*in use`),
    );
  } finally {
    l.close();
  }
});

Deno.test("--http-addr on --addr's port with --goaway-guard false is refused before the pool, naming --http-addr", async () => {
  const l = taken("127.0.0.1");
  const addr = `127.0.0.1:${l.addr.port}`;
  l.close(); // free: only the server's own two flags want it
  await refusedBeforePool(
    ["--goaway-guard", "false", "--addr", addr, "--http-addr", addr],
    new RegExp(`^--http-addr ${addr}: cannot listen: .*in use`),
  );
});

Deno.test("a taken --http-addr refuses the start before the pool, naming the flag and address", async () => {
  const l = taken("127.0.0.1");
  try {
    const addr = `127.0.0.1:${l.addr.port}`;
    await refusedBeforePool(
      ["--http-addr", addr],
      new RegExp(`^--http-addr ${addr}: cannot listen: .*in use`),
    );
  } finally {
    l.close();
  }
});

Deno.test("a --uds socket another process serves on is refused before the pool, naming it", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-early-" });
  const path = `${dir}/grpc.sock`;
  const l = Deno.listen({ transport: "unix", path });
  try {
    await refusedBeforePool(["--uds", path], new RegExp(`^--uds ${path}: .*${path} is in use`));
    assert.ok(Deno.lstatSync(path).isSocket, "the other process's socket is left alone");
    for (const beside of [`${path}.up`, `${path}.rpc`]) {
      assert.throws(() => Deno.lstatSync(beside), Deno.errors.NotFound, `${beside} left behind`);
    }
  } finally {
    l.close();
    await Deno.remove(dir, { recursive: true });
  }
});

/** Flags of a node with the cross-node index (nothing dials Redis before the listening line). */
const INDEXED = ["--index-redis", "redis://127.0.0.1:1", "--transport", "tcp"];

Deno.test("a taken --peer-rpc-port refuses the start before the pool, naming the flag", async () => {
  const l = taken("0.0.0.0");
  try {
    const port = l.addr.port;
    await refusedBeforePool(
      [...INDEXED, "--peer-rpc-port", String(port)],
      new RegExp(`cannot listen for peer RPC on port ${port} \\(--peer-rpc-port\\): .*in use`),
    );
  } finally {
    l.close();
  }
});

Deno.test("a taken --xfer-port (--transport tcp) refuses the start before the pool, naming the flag", async () => {
  const l = taken("0.0.0.0");
  try {
    const port = l.addr.port;
    const lines = await refusedBeforePool(
      [...INDEXED, "--xfer-port", String(port)],
      new RegExp(`^--xfer-port ${port}: cannot listen on 0\\.0\\.0\\.0:${port}: .*in use`),
    );
    assert.ok(!lines.some((x) => x.msg === "peer RPC open"), "the peer RPC socket stays closed");
  } finally {
    l.close();
  }
});

Deno.test({
  name: "a transfer endpoint that cannot open (--transport rdma, no RDMA device) names the flag",
  ignore: (() => {
    try {
      return Deno.readDirSync("/sys/class/infiniband").next().done !== true;
    } catch {
      return false;
    }
  })(),
  async fn() {
    const r = await runServerToEnd(["--index-redis", "redis://127.0.0.1:1", "--transport", "rdma"]);
    assert.equal(r.code, 1, r.stderr);
    const failed = logLines(r.stderr).filter((l) => l.msg === "start-up failed");
    assert.equal(failed.length, 1, r.stderr);
    assert.match(
      String(failed[0].error),
      /^--transport rdma: cannot open the transfer endpoint: .*PF_ENODEV/,
    );
  },
});
