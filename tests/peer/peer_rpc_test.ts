/**
 * The peer RPC socket's edges (the fetches through it are in
 * peer_tier_test.ts and the multi-process tests): its flag, a start refused
 * when its port is taken, and the addresses a handshake may hand over.
 */
import assert from "node:assert/strict";
import { parseServeArgs } from "../../lib/server/config.ts";
import { parseRpcAddr } from "../../lib/peer/link.ts";
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
