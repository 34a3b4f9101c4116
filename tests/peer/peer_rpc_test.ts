/**
 * The peer RPC socket's edges (the fetches through it are in
 * peer_tier_test.ts and the multi-process tests): its flag, a start refused
 * when its port is taken, the addresses a handshake may hand over, and a
 * connect that never completes.
 */
import assert from "node:assert/strict";
import { parseServeArgs } from "../../lib/server/config.ts";
import { parseRpcAddr, PeerLinks, PeerRpcError } from "../../lib/peer/link.ts";
import { runServerToEnd } from "../server/harness.ts";

Deno.test("--peer-rpc-port parses, defaults to any free port, and is refused out of range naming the flag", () => {
  const d = parseServeArgs([]);
  assert.equal(d.kind, "config");
  if (d.kind === "config") assert.equal(d.config.peer.rpcPort, 0);
  const r = parseServeArgs(["--peer-rpc-port", "50057"]);
  assert.equal(r.kind, "config");
  if (r.kind === "config") assert.equal(r.config.peer.rpcPort, 50057);
  for (const bad of ["70000", "-1", "port"]) {
    const x = parseServeArgs(["--peer-rpc-port", bad]);
    assert.equal(x.kind, "exit", `--peer-rpc-port ${bad} was accepted`);
    if (x.kind === "exit") {
      assert.match(x.output, /--peer-rpc-port must be an integer in 0\.\.65535/);
    }
  }
  Deno.env.set("PEGAFLOW_PEER_RPC_PORT", "50058");
  try {
    const e = parseServeArgs([]);
    if (e.kind === "config") assert.equal(e.config.peer.rpcPort, 50058);
    else assert.fail(e.output);
  } finally {
    Deno.env.delete("PEGAFLOW_PEER_RPC_PORT");
  }
});

Deno.test("a server whose --peer-rpc-port is taken refuses to start and says which flag", async () => {
  const taken = Deno.listen({ hostname: "0.0.0.0", port: 0 });
  try {
    const r = await runServerToEnd([
      "--index-redis",
      "redis://127.0.0.1:1",
      "--transport",
      "tcp",
      "--peer-rpc-port",
      String(taken.addr.port),
    ]);
    assert.notEqual(r.code, 0, "the server started");
    assert.match(
      r.stderr + r.stdout,
      new RegExp(`cannot listen for peer RPC on port ${taken.addr.port} \\(--peer-rpc-port\\)`),
    );
  } finally {
    taken.close();
  }
});

Deno.test("a peer RPC address from another node is read as host:port, or refused naming it", () => {
  assert.deepEqual(parseRpcAddr("10.0.0.7:50057"), { hostname: "10.0.0.7", port: 50057 });
  assert.deepEqual(parseRpcAddr("node-7.local:1"), { hostname: "node-7.local", port: 1 });
  assert.deepEqual(parseRpcAddr("[fd00::7]:50057"), { hostname: "fd00::7", port: 50057 });
  for (const bad of ["10.0.0.7", ":50057", "10.0.0.7:0", "10.0.0.7:65536", "h:12x"]) {
    assert.equal(parseRpcAddr(bad), `peer RPC address "${bad}" is not host:port`, bad);
  }
});

Deno.test("a lock whose connect never completes (the owner drops SYNs) ends at its deadline", async () => {
  // A listener with a backlog of 0 and one connection it never accepts: the
  // kernel drops further SYNs, so a connect waits (for minutes, left alone).
  const py = new Deno.Command("/usr/bin/python3", {
    args: [
      "-c",
      "import socket, sys\n" +
      "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(0)\n" +
      "print(s.getsockname()[1], flush=True); sys.stdin.read()",
    ],
    stdin: "piped",
    stdout: "piped",
  }).spawn();
  const reader = py.stdout.getReader();
  const port = Number(new TextDecoder().decode((await reader.read()).value).trim());
  const filler = await Deno.connect({ hostname: "127.0.0.1", port });
  const links = new PeerLinks();
  try {
    const t0 = performance.now();
    await assert.rejects(
      links.lock(
        "127.0.0.1:1",
        {
          namespace: "ns",
          blockHashes: [new Uint8Array([1])],
          layoutFingerprint: "f",
          requester: "r",
          lockTtlMs: 0,
          shiftedExtents: true,
          lockId: new Uint8Array(0),
        },
        300,
        `127.0.0.1:${port}`,
      ),
      (e: PeerRpcError) => {
        assert.equal(e.code, 4, e.message); // DEADLINE_EXCEEDED
        assert.match(e.message, /no connection to 127\.0\.0\.1:\d+ within 300 ms/);
        return true;
      },
    );
    const took = performance.now() - t0;
    assert.ok(took >= 290 && took < 1500, `the call ended at its deadline (${took} ms)`);
  } finally {
    links.close();
    filler.close();
    reader.releaseLock();
    await py.stdin.close();
    await py.status;
    await py.stdout.cancel();
  }
});
