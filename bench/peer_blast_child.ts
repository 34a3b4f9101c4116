/**
 * Child of bench/peer_fetch.ts, run inside the requesting node's network
 * namespace: the raw TCP throughput of the path from the owner's transfer
 * listener (`pf_tcp_blast`: plain connections, unframed bytes, received into
 * this process's own pinned pool, each stream its slice). Prints `{"ns": N}`.
 *
 * `deno run -A bench/peer_blast_child.ts <host:port> <streams> <bytes>`
 *
 * @module
 */
import { Engine } from "../ffi/mod.ts";
import { tcpBlast } from "../ffi/xfer.ts";

const [addr, streamsArg, bytesArg] = Deno.args;
const streams = Number(streamsArg), bytes = Number(bytesArg);
const engine = Engine.open({ backend: "host" });
const pool = engine.createPool(bytes, { pretouch: true });
try {
  await tcpBlast(addr, streams, Math.floor(bytes / streams), pool); // warm-up
  const ns = await tcpBlast(addr, streams, Math.floor(bytes / streams), pool);
  console.log(JSON.stringify({ ns, bytes: streams * Math.floor(bytes / streams) }));
} finally {
  pool.close();
  engine.close();
}
