/**
 * Pipelined batches of index commands that name keys of several namespaces (the heartbeat over
 * every joined namespace plus the node's record, the re-join's voids). On one Redis a batch is
 * one pipeline, as it always was. On Redis Cluster a pipeline may only hold keys of one slot
 * (ioredis refuses the rest), and namespaces sit on different masters: the batch goes as one
 * pipeline per hash tag — every key of a namespace carries `{ns}`, the node's record `{@node}`
 * (lib/index/keys.ts) — all sent at once, so it still costs one round trip of wall time.
 *
 * @module
 */

import type { Cluster } from "ioredis";
import { type IndexPipeline, indexPipeline, type IndexRedis } from "./connection.ts";
import { nodeSetKey, nodesKey } from "./keys.ts";
import { HEARTBEAT_LUA } from "./scripts.ts";

/** One command of a batch: a key it names (its hash tag routes it) and how to queue it. */
export interface BatchCommand {
  key: string;
  send(p: IndexPipeline): void;
}

/** The hash tag of `key` (the text between its first `{` and the next `}`), else the key. */
function hashTag(key: string): string {
  const open = key.indexOf("{");
  const close = open < 0 ? -1 : key.indexOf("}", open + 1);
  return close > open + 1 ? key.slice(open + 1, close) : key;
}

/**
 * Runs `cmds` pipelined and answers their replies in their order; throws the first error (or
 * when a pipeline was discarded), naming `what`.
 *
 * @example
 * ```ts
 * const [a, b] = await execBatch(redis, [
 *   { key: nodesKey("ns1"), send: (p) => p.pexpire(nodesKey("ns1"), 1000) },
 *   { key: nodesKey("ns2"), send: (p) => p.pexpire(nodesKey("ns2"), 1000) },
 * ], "heartbeat");
 * ```
 */
export async function execBatch(
  redis: IndexRedis,
  cmds: readonly BatchCommand[],
  what: string,
): Promise<unknown[]> {
  const groups = new Map<string, number[]>();
  if ((redis as Cluster).isCluster) {
    cmds.forEach((c, i) => {
      const tag = hashTag(c.key);
      const g = groups.get(tag);
      if (g) g.push(i);
      else groups.set(tag, [i]);
    });
  } else {
    groups.set("", cmds.map((_, i) => i));
  }
  const answers = new Array<unknown>(cmds.length);
  await Promise.all([...groups.values()].map(async (idx) => {
    const p = indexPipeline(redis);
    for (const i of idx) cmds[i].send(p);
    const out = await p.exec();
    if (!out) throw new Error(`${what} pipeline was discarded`);
    out.forEach(([err, v], j) => {
      if (err) throw err;
      answers[idx[j]] = v;
    });
  }));
  return answers;
}

/** The heartbeat of `who` in each namespace, in order (lib/index/scripts.ts, HEARTBEAT_LUA). */
export function heartbeatCommands(
  who: { node: string; inc: string; addr: string; ttlMs: number },
  namespaces: readonly string[],
): BatchCommand[] {
  return namespaces.map((ns) => ({
    key: nodesKey(ns),
    send: (p) =>
      p.eval( // EVAL, not EVALSHA: lib/index/connection.ts (evalAlways) says why
        HEARTBEAT_LUA,
        2,
        nodesKey(ns),
        nodeSetKey(ns, who.node, who.inc),
        who.node,
        who.inc,
        who.addr,
        who.ttlMs,
      ),
  }));
}

/** A read of `ns`'s registry TTL: answers only if the master of `ns`'s slot does; changes nothing. */
export function reachCommand(ns: string): BatchCommand {
  return { key: nodesKey(ns), send: (p) => p.pttl(nodesKey(ns)) };
}
