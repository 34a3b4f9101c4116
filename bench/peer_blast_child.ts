/**
 * Child of bench/peer_fetch.ts, run inside the requesting node's network
 * namespace: the raw TCP throughput of the path from the owner's transfer
 * listener (`pf_tcp_blast`: plain connections, unframed bytes, received into
 * this process's own pinned pool, each stream its slice). Prints `{"ns": N}`
 * and the process's CPU during that blast (`cpuUs`).
 *
 * `deno run -A bench/peer_blast_child.ts <host:port> <streams> <bytes>`
 *
 * @module
 */
import { Engine } from "../ffi/mod.ts";
import { tcpBlast } from "../ffi/xfer.ts";
import { cpuUsage } from "node:process";
import { benchCli, positiveInt } from "./cli.ts";

const args = benchCli({
  usage: "deno run -A bench/peer_blast_child.ts <host:port> <streams> <bytes>",
  about: "Child of bench/peer_fetch.ts: the raw TCP throughput from a transfer listener into " +
    "this process's pinned pool\n(one warm-up blast, then one timed).",
  positionals: {
    "host:port": "the owner's transfer listener",
    streams: "TCP connections",
    bytes: "bytes in all, split evenly over the streams",
  },
  writes: 'one JSON line on stdout, {"ns": N, "bytes": B, "cpuUs": C}; no file',
});
const [addr, streamsArg, bytesArg] = args.positionals;
const streams = positiveInt("<streams>", streamsArg, 1);
const bytes = positiveInt("<bytes>", bytesArg, 1);
const engine = Engine.open({ backend: "host" });
const pool = engine.createPool(bytes, { pretouch: true });
try {
  // A blast that stalls fails by this deadline instead of hanging the bench.
  const timeoutMs = 120_000;
  await tcpBlast(addr, streams, Math.floor(bytes / streams), timeoutMs, { pool }); // warm-up
  const cpu0 = cpuUsage();
  const ns = await tcpBlast(addr, streams, Math.floor(bytes / streams), timeoutMs, { pool });
  // This process's CPU during the timed blast (its receive threads included), µs.
  const { user, system } = cpuUsage(cpu0);
  console.log(
    JSON.stringify({ ns, bytes: streams * Math.floor(bytes / streams), cpuUs: user + system }),
  );
} finally {
  pool.close();
  engine.close();
}
