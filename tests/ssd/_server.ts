/**
 * Helpers for the SSD tests that drive a real server process (host backend,
 * real gRPC): the SSD flags, a polling wait with a deadline, QueryPrefetch
 * polled until ready, simulated engines of a given shape, a server with
 * one registered rank for a test body (withSsdServer), and a server whose
 * SSD alone holds a prefix (ssdResidentPrefix).
 */
import assert from "node:assert/strict";
import type { PegaflowClient } from "../../lib/client/client.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LLAMA_3_1_8B, type ModelShape, SimEngine } from "../../lib/client/sim_engine.ts";
import { type ServerProc, startServer, uid } from "../server/harness.ts";
import { parseServeArgs } from "../../lib/server/config.ts";

/** Llama-3.1-8B cut to 4 layers: 256 KiB blocks at TP=1. */
export const MODEL: ModelShape = { ...LLAMA_3_1_8B, numLayers: 4 };

/** A small SSD tier in `dir` (4 MiB segments so tests stay small). */
export const SSD_FLAGS = (dir: string): string[] => [
  "--ssd-cache-path",
  dir,
  "--ssd-cache-capacity",
  "128mb",
  "--ssd-segment-size",
  "4mb",
];

/**
 * What an in-process server of these tests runs (lib/server/server.ts `startServer`): host
 * backend, an ephemeral port, a 64 MiB pool and a 16 MiB SSD tier in `dir`.
 */
export function inProcessSsdConfig(dir: string) {
  const parsed = parseServeArgs([
    "--addr",
    "127.0.0.1:0",
    "--backend",
    "host",
    "--pool-size",
    "64mb",
    "--ssd-cache-path",
    dir,
    "--ssd-cache-capacity",
    "16mb",
    "--ssd-segment-size",
    "4mb",
  ]);
  if (parsed.kind !== "config") {
    throw new Error(`the test server's flags did not parse (${parsed.kind})`);
  }
  return parsed.config;
}

/** Polls `fn` every 20 ms until it holds; throws naming `what` after `ms`. */
export async function until(
  what: string,
  fn: () => Promise<boolean>,
  ms = 20_000,
): Promise<void> {
  const end = Date.now() + ms;
  while (!(await fn())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

/** Polls QueryPrefetch with one request id until it is ready; returns hits, lease, and polls answered loading. */
export async function queryUntilReady(
  sim: SimEngine,
  hashes: Uint8Array[],
  reqId: string,
  ms = 20_000,
) {
  const end = Date.now() + ms;
  let loading = 0;
  for (;;) {
    const q = await sim.query(hashes, reqId);
    if (q.kind === "ready") return { ...q, loading };
    if (Date.now() > end) throw new Error(`request ${reqId} still loading after ${ms} ms`);
    loading++;
    await new Promise((r) => setTimeout(r, 5));
  }
}

/** A simulated engine rank on the host backend, 64 blocks per layer. */
export function sim(
  client: PegaflowClient,
  namespace: string,
  opts: { model?: ModelShape; tpRank?: number; tpSize?: number; instanceId?: string } = {},
): SimEngine {
  return SimEngine.create({
    client,
    instanceId: opts.instanceId ?? uid("ssd"),
    namespace,
    model: opts.model ?? MODEL,
    tpRank: opts.tpRank,
    tpSize: opts.tpSize,
    numBlocks: 64,
    backend: "host",
  });
}

/**
 * A real server with an SSD tier on a temp dir and one registered simulated engine rank (a
 * namespace of its own), handed to `body`; the rank is unregistered, the server stopped and the
 * dir removed afterwards, also when `body` throws.
 */
export async function withSsdServer(
  prefix: string,
  body: (srv: ServerProc, eng: SimEngine) => Promise<void>,
): Promise<void> {
  const dir = await Deno.makeTempDir({ prefix });
  let srv: ServerProc | undefined;
  let eng: SimEngine | undefined;
  try {
    srv = await startServer(SSD_FLAGS(dir));
    eng = sim(srv.client, uid("ns"));
    await eng.register();
    await body(srv, eng);
  } finally {
    if (eng && srv) await srv.client.unregisterContext(eng.instanceId).catch(() => {});
    eng?.close();
    await srv?.stop();
    await Deno.remove(dir, { recursive: true });
  }
}

/**
 * A real server (SSD flags on `dir`, plus `flags`) whose SSD holds `blocks` blocks of
 * `namespace` (hashes of seed `seed`) and whose RAM holds none of them: saved by an engine that
 * is then unregistered, written behind, and cleaned out of RAM. The caller stops the server.
 */
export async function ssdResidentPrefix(
  dir: string,
  namespace: string,
  seed: number,
  blocks: number,
  flags: string[] = [],
): Promise<{ srv: ServerProc; hashes: Uint8Array[] }> {
  const srv = await startServer([...SSD_FLAGS(dir), ...flags]);
  const hashes = chainedBlockHashes(syntheticTokens(seed, 16 * blocks), 16);
  const writer = sim(srv.client, namespace);
  try {
    await writer.register();
    const ids = Array.from({ length: blocks }, (_, i) => i);
    writer.fill(ids, hashes);
    assert.equal((await writer.save(ids, hashes)).blocksSaved, blocks);
    await until(
      "write-behind",
      async () => (await srv.metric("pegaflow_ssd_write_blocks_total")) === blocks,
    );
    await srv.client.unregisterContext(writer.instanceId);
    assert.equal((await srv.http_post("/cache/memory/cleanup")).status, 200);
  } catch (e) {
    await srv.stop();
    throw e;
  } finally {
    writer.close();
  }
  return { srv, hashes };
}
