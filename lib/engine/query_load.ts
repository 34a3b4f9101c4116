/**
 * "Query and load": a QueryPrefetch that names targets (`load_into`) starts
 * the hit's load before it answers, as if a Load of every rank had arrived
 * with the new lease and the hit's leading targets.
 *
 * Why: a warm request otherwise waits for the query's answer to reach the
 * engine, for the engine to allocate and send Load, and for the server to
 * wake for it (about 2 ms on the H100 between query and copy) before its
 * copy starts. An engine whose load targets exist before the scheduler
 * allocates (the connector's staging blocks) can name them in the query.
 *
 * All-or-nothing per answer: every rank of the instance is named once; if
 * any rank's load is refused, the lease (the shares no load spent) is
 * released and the answer says which rank and why (its load state is marked
 * failed where the server could open it), so the engine recomputes.
 *
 * @module
 */
import { invalid } from "./errors.ts";
import type { Instance } from "./instances.ts";
import type { AcceptedLoad, LoadArgs, LoadResult } from "./load.ts";
import { rankIndex } from "./rank.ts";

/** One rank's load of a query-and-load. */
export interface RankLoadTarget {
  tpRank: number;
  ppRank: number;
  loadStateShm: string;
}

/** The targets of a query-and-load: one per hash asked, and every rank once. */
export interface LoadInto {
  blockIds: number[];
  ranks: RankLoadTarget[];
}

/** How one rank's load went: `error` empty = submitted. */
export interface RankLoadOutcome {
  tpRank: number;
  ppRank: number;
  error: string;
  numBlocks: number;
}

export interface QueryAnswer {
  hits: number;
  leaseId: Uint8Array | null;
  ttlMs: number;
  loading?: boolean;
}

/** The engine calls a query-and-load composes (KvEngine's own). */
export interface QueryLoadPorts {
  instance(id: string, what: string): Instance;
  query(instanceId: string, hashes: Uint8Array[], requestId: string, engineId: string): QueryAnswer;
  /** A Load's checks; a refusal throws (load.ts). */
  accept(args: LoadArgs): AcceptedLoad;
  /** Runs an accepted load; settles at its submit, a refusal rejects. */
  queue(a: AcceptedLoad): Promise<LoadResult>;
  /** Drops an accepted load (its state fails). */
  abandon(a: AcceptedLoad, why: string): void;
  release(leaseId: Uint8Array): void;
}

/** A QueryPrefetch with `load_into`, as the engine calls it. */
export interface QueryLoadRequest {
  instanceId: string;
  hashes: Uint8Array[];
  requestId: string;
  into: LoadInto;
  /** The sender's engine id ("" = not checked): another engine's is refused first. */
  engineId: string;
}

/** Refuses a `load_into` that does not name one target per hash and every rank once. */
export function checkLoadInto(
  inst: Instance,
  hashes: number,
  into: LoadInto,
  requestId: string,
): void {
  const fields = { instance: inst.id, requestId: requestId || undefined };
  const who = `instance "${inst.id}" request "${requestId}": QueryPrefetch load_into`;
  if (into.blockIds.length !== hashes) {
    throw invalid(`${who} names ${into.blockIds.length} targets for ${hashes} hashes (one each)`, {
      ...fields,
      expected: hashes,
      got: into.blockIds.length,
    });
  }
  if (into.ranks.length !== inst.worldSize) {
    throw invalid(
      `${who} names ${into.ranks.length} ranks; every rank of the instance once (${inst.worldSize})`,
      { ...fields, expected: inst.worldSize, got: into.ranks.length },
    );
  }
  const seen = new Set<number>();
  // Each rank's copy publishes its own progress words: two in one block read as one load.
  const byState = new Map<string, RankLoadTarget>();
  for (const r of into.ranks) {
    const i = rankIndex(r.tpRank, r.ppRank, inst.tpSize);
    if (r.tpRank >= inst.tpSize || r.ppRank >= inst.ppSize || seen.has(i)) {
      throw invalid(
        `${who} names tp_rank ${r.tpRank} pp_rank ${r.ppRank} ${
          seen.has(i) ? "twice" : `(tp_size ${inst.tpSize}, pp_size ${inst.ppSize})`
        }`,
        fields,
      );
    }
    seen.add(i);
    const other = byState.get(r.loadStateShm);
    if (other) {
      throw invalid(
        `${who} names load state "${r.loadStateShm}" for tp_rank ${other.tpRank} pp_rank ${other.ppRank} and tp_rank ${r.tpRank} pp_rank ${r.ppRank}; each rank needs its own`,
        fields,
      );
    }
    // An empty name is that rank's own refusal (accept: "Load needs load_state_shm").
    if (r.loadStateShm) byState.set(r.loadStateShm, r);
  }
}

/**
 * Query, then on a hit every rank's load: each is checked now (a refusal is
 * named in the answer), then queued before the answer is sent, so the copy
 * is submitted within this handler (the load stage runs a free slot's job
 * synchronously). The copy is a warm request's critical path and the
 * engine's own path is not: with merged staging ranges the submit costs
 * ~0.1-0.3 ms, where answering first and queueing on the next macrotask
 * started the copy ~1 ms after the answer on the H100 host (the wake-up and
 * the stage hop). A later refusal (the queue full) is reported in the
 * rank's load state. Any refusal gives the lease's unspent shares back.
 */
export function queryAndLoad(
  ports: QueryLoadPorts,
  req: QueryLoadRequest,
): QueryAnswer & { loads: RankLoadOutcome[] } {
  const { instanceId, hashes, requestId, into, engineId } = req;
  const inst = ports.instance(instanceId, "QueryPrefetch");
  // Another engine's: refused before its targets are checked or its load states opened.
  inst.checkEngine(engineId, `QueryPrefetch (request "${requestId}")`, "request", {
    requestId: requestId || undefined,
  });
  checkLoadInto(inst, hashes.length, into, requestId);
  const q = ports.query(instanceId, hashes, requestId, engineId);
  if (q.loading || q.hits === 0 || q.leaseId === null) return { ...q, loads: [] };
  const leaseId = q.leaseId;
  let released = false;
  // A refused rank left its share unspent: give the lease back now rather than at its TTL.
  const giveBack = () => {
    if (released) return;
    released = true;
    try {
      ports.release(leaseId);
    } catch {
      // Every share was spent (a rank failed after consuming its own): nothing left to give back.
    }
  };
  const targets = into.blockIds.slice(0, q.hits);
  const accepted: AcceptedLoad[] = [];
  const loads = into.ranks.map((r): RankLoadOutcome => {
    try {
      accepted.push(ports.accept({
        instanceId,
        requestId,
        tpRank: r.tpRank,
        ppRank: r.ppRank,
        leaseId,
        blockIds: targets,
        loadStateShm: r.loadStateShm,
        engineId,
      }));
      return { tpRank: r.tpRank, ppRank: r.ppRank, error: "", numBlocks: targets.length };
    } catch (e) {
      return { tpRank: r.tpRank, ppRank: r.ppRank, error: (e as Error).message, numBlocks: 0 };
    }
  });
  const refused = loads.find((l) => l.error);
  if (refused) {
    for (const a of accepted) {
      ports.abandon(a, `tp_rank ${refused.tpRank} pp_rank ${refused.ppRank} was refused`);
    }
    giveBack();
    return { ...q, loads };
  }
  for (const a of accepted) ports.queue(a).catch(giveBack);
  return { ...q, loads };
}
