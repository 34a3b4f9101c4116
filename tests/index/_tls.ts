/**
 * What the TLS tests of the block index share (tls_test.ts on one Redis,
 * cluster_tls_test.ts on a Redis Cluster): an index node trusting a CA, and
 * a real server process started with `--index-redis rediss://...` and
 * `--index-redis-tls-ca` whose save a probe node finds over TLS.
 */

import assert from "node:assert/strict";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B } from "../../lib/client/sim_engine.ts";
import { RedisBlockIndex } from "../../lib/index/block_index.ts";
import { Logger } from "../../lib/log.ts";
import { hostSim, type ServerProc, startServer, uid } from "../server/harness.ts";
import { waitFor } from "./_redis.ts";

/** An index node at `url` (cluster seeds with `cluster`) trusting the PEM `tlsCa`, started, with its log lines. */
export function tlsNode(
  url: string,
  id: string,
  tlsCa: string,
  cluster: boolean,
  timeoutMs: number,
) {
  const logs: string[] = [];
  const index = new RedisBlockIndex({
    url,
    cluster,
    tlsCa,
    nodeId: id,
    advertiseAddr: `${id}.local:50055`,
    listSealed: () => [],
    timeoutMs,
    nodeTtlMs: 60_000,
    log: new Logger("debug", {}, (line) => logs.push(line)),
  });
  index.start();
  return { index, logs };
}

/**
 * A server with `--index-redis url` (`cluster`: `--index-redis-cluster`) and
 * `--index-redis-tls-ca ca.file` saves a 4-block prefix, which a probe node
 * trusting `ca.pem` finds owned by it; then `check(srv)`. Everything started
 * here is stopped before it returns.
 */
export async function serverSaveFoundOverTls(
  url: string,
  cluster: boolean,
  ca: { file: string; pem: string },
  timeoutMs: number,
  check: (srv: ServerProc) => void | Promise<void>,
): Promise<void> {
  const srv = await startServer([
    "--index-redis",
    url,
    ...(cluster ? ["--index-redis-cluster"] : []),
    "--index-redis-tls-ca",
    ca.file,
    "--node-id",
    "node-a",
    "--index-timeout-ms",
    String(timeoutMs),
  ]);
  const probe = tlsNode(url, "probe", ca.pem, cluster, timeoutMs);
  const namespace = uid("ns");
  const sim = hostSim(srv, {
    instanceId: uid("inst"),
    namespace,
    model: { ...LLAMA_3_1_8B, numLayers: 2 },
    numBlocks: 16,
  });
  try {
    await sim.register();
    const hs = chainedBlockHashes(syntheticTokens(5, 16 * 4), 16);
    const ids = [0, 1, 2, 3];
    sim.fill(ids, hs);
    await sim.save(ids, hs);
    await waitFor(
      "the save is advertised over TLS",
      async () => (await probe.index.lookup(namespace, hs)).length === 4,
    );
    const r = await probe.index.lookup(namespace, hs);
    assert.deepEqual(r.owners, [{ nodeId: "node-a", addr: srv.grpc, length: 4 }]);
    assert.equal(await srv.metric("pegaflow_index_redis_up"), 1);
    await check(srv);
  } finally {
    sim.close();
    await probe.index.close();
    await srv.stop();
  }
}
