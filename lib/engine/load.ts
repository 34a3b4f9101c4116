/**
 * Load, for one rank: open the engine's load state (so every refusal is
 * visible to a polling engine too), check the rank, the target block ids
 * and the lease, consume the lease (the last check and the only state
 * change before the copy), write ONE scatter batch for all the rank's layers
 * with per-layer progress words (lib/transfer/plan.ts), and submit. The RPC
 * returns at submit; completion releases the pins and closes the shm.
 *
 * A refused Load leaves its lease exactly as it was (the store checks the
 * target count before the rank's consume is spent).
 *
 * @module
 */
import { LEASE_ID_BYTES, MAX_NAME_CHARS } from "../limits.ts";
import type { Submission } from "../pipeline/stage.ts";
import type { LoadTicket } from "../storage/store.ts";
import type { TransferPlanner } from "../transfer/plan.ts";
import { type EngineContext, round3 } from "./context.ts";
import {
  Code,
  EngineError,
  type ErrorFields,
  invalid,
  precondition,
  withContext,
} from "./errors.ts";
import { type Instance, type RankCtx, requestWho } from "./instances.ts";
import {
  armLoadState,
  checkLoadState,
  claimLoadState,
  completeLoadState,
  failLoadState,
  LOAD_STATE_BYTES,
  loadStateOwner,
  OFF_PROGRESS,
  STATE_REJECTED,
} from "./load_state.ts";
import { LoadStateMaps } from "./load_state_maps.ts";
import { checkName } from "./registration.ts";
import { checkTargets } from "./targets.ts";
import { type BatchWriter, ClientMemoryFault, type ShmPort } from "./ports.ts";

export interface LoadArgs {
  instanceId: string;
  requestId?: string;
  tpRank: number;
  ppRank: number;
  leaseId: Uint8Array;
  blockIds: number[];
  loadStateShm: string;
  /** The engine reads the load only once whole (async mode): the copy may take several lanes. */
  whole?: boolean;
  /** The sender's engine id: another engine's is refused (`Instance.checkEngine`); "" = not checked. */
  engineId?: string;
}

export interface LoadResult {
  numBlocks: number;
  numLayers: number;
  bytes: number;
  /** Resolves when the scatter finished (ok or not); the RPC does not wait for it. */
  done: Promise<void>;
}

/** A Load admitted by the load stage. */
export interface LoadJob {
  /** performance.now() when the Load reached the engine (for the debug log). */
  tEntry: number;
  args: LoadArgs;
  inst: Instance;
  rank: RankCtx;
  shm: ShmPort;
  /** The instance's owner tag, written into the load state's header (load_state.ts OFF_OWNER). */
  owner: number;
}

/** A Load that passed its checks ({@link LoadRunner.accept}), holding its open load state. */
export interface AcceptedLoad {
  job: LoadJob;
  fields: ErrorFields;
}

/** Runs Loads; one per engine (it owns the scatter batch and its planner). */
export class LoadRunner {
  /** Load states stay mapped between an instance's loads (load_state_maps.ts). */
  readonly states: LoadStateMaps;

  constructor(
    readonly ctx: EngineContext,
    readonly batch: BatchWriter,
    readonly planner: TransferPlanner,
  ) {
    this.states = new LoadStateMaps(
      (name, bytes) => ctx.native.openShm(name, bytes),
      (instance) => ctx.instances.has(instance),
      ctx.log,
    );
  }

  /**
   * The whole Load RPC: {@link accept}, then {@link queue}; a refusal is a rejection.
   */
  load(
    args: LoadArgs,
    instance: (id: string) => Instance,
    enqueue: (job: LoadJob) => Submission<LoadJob, LoadResult>,
  ): Promise<LoadResult> {
    try {
      return this.queue(this.accept(args, instance), enqueue);
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /**
   * A Load's checks, synchronously: its load state opened and checked, the
   * rank, the lease id, every target. A refusal throws, with the load state
   * marked failed when it could be opened. The accepted load holds the open
   * state until {@link queue} or {@link abandon}.
   */
  accept(args: LoadArgs, instance: (id: string) => Instance): AcceptedLoad {
    const tEntry = performance.now();
    const fields = loadFields(args);
    // Attach the load state first so that any refusal is visible to a polling engine too.
    if (!args.loadStateShm) {
      throw invalid(`instance "${args.instanceId}": Load needs load_state_shm`, fields);
    }
    let shm: ShmPort;
    try {
      shm = this.states.acquire(args.instanceId, args.loadStateShm, LOAD_STATE_BYTES);
    } catch (e) {
      throw invalid(
        `instance "${args.instanceId}": cannot open load state "${args.loadStateShm}": ${
          (e as Error).message
        }`,
        fields,
      );
    }
    // The rank's layer count once known: a refusal then marks exactly that many layers done.
    let numLayers: number | undefined;
    // Only a block whose header says it is a load state, and not another instance's
    // load, gets the refusal written into it.
    let writable = false;
    try {
      const who = `instance "${args.instanceId}"` +
        (args.requestId ? ` request "${args.requestId}"` : "");
      const owner = this.#stateOp(
        () => checkLoadState(shm, args.loadStateShm),
        who,
        args.loadStateShm,
        fields,
      );
      // Another instance's load in flight (its header names it, it holds the block): nothing
      // of this one goes there. Rearmed by its engine (owner 0), or done, the block is free.
      writable = owner === 0 || ownedBy(owner, args.instanceId) ||
        !this.states.busy(owner, args.loadStateShm);
      // An id outside the name rule names no instance: the request is malformed (not "unknown").
      checkName("instance_id", args.instanceId, "Load");
      const inst = instance(args.instanceId);
      // Another engine's Load under this instance id would scatter into this engine's blocks.
      inst.checkEngine(args.engineId, requestWho("Load", args), "request", fields);
      const rank = inst.rankCtx(args.tpRank, args.ppRank, "Load");
      numLayers = rank.layers.length;
      if (args.leaseId.length !== LEASE_ID_BYTES) {
        throw invalid(
          `instance "${args.instanceId}": lease id is ${args.leaseId.length} bytes, expected ${LEASE_ID_BYTES}`,
          { ...fields, expected: LEASE_ID_BYTES, got: args.leaseId.length },
        );
      }
      checkTargets(loadWho(inst, rank, args), fields, rank, args.blockIds);
      // Last, so that every other refusal keeps its own status (an unknown instance's too).
      if (!writable) throw this.#taken(who, args.loadStateShm, owner, fields);
      // Accepted: the block is this instance's load from now on, queued or not.
      const mine = loadStateOwner(inst.id);
      this.#stateOp(() => claimLoadState(shm, mine), who, args.loadStateShm, fields);
      this.states.begin(mine, args.loadStateShm);
      return { job: { args, inst, rank, shm, tEntry, owner: mine }, fields };
    } catch (e) {
      // Another object's bytes, another version's layout, another instance's load: not ours to write.
      if (writable) this.#failState(shm, args.loadStateShm, STATE_REJECTED, numLayers);
      this.#releaseShm(args, shm);
      throw e;
    }
  }

  /** An accepted load that will not run (another rank's was refused): its state fails and closes. */
  abandon(a: AcceptedLoad, why: string): void {
    const { args, rank, shm } = a.job;
    this.ctx.log.debug("load abandoned", { ...a.fields, why });
    this.#failState(shm, args.loadStateShm, STATE_REJECTED, rank.layers.length);
    this.#releaseShm(args, shm, a.job.owner);
  }

  /**
   * `enqueue` (the load stage) runs {@link submit} for an accepted load.
   * Resolves at its submit; a refusal (queue full, the lease) rejects and
   * marks the state failed.
   */
  async queue(
    a: AcceptedLoad,
    enqueue: (job: LoadJob) => Submission<LoadJob, LoadResult>,
  ): Promise<LoadResult> {
    const { args, inst, rank, shm } = a.job;
    let handedOff = false;
    try {
      const sub = enqueue(a.job);
      if (sub.status === "refused") {
        throw new EngineError(
          Code.RESOURCE_EXHAUSTED,
          `instance "${inst.id}": load queue full`,
          a.fields,
        );
      }
      const out = await sub.done();
      if (out.status === "done") {
        handedOff = true;
        return out.value;
      }
      if (out.status === "failed") throw out.error;
      throw new EngineError(
        Code.RESOURCE_EXHAUSTED,
        `load ${out.status} by the load queue`,
        a.fields,
      );
    } catch (e) {
      this.#failState(shm, args.loadStateShm, STATE_REJECTED, rank.layers.length);
      throw e;
    } finally {
      if (!handedOff) this.#releaseShm(args, shm, a.job.owner);
    }
  }

  /** The load stage's worker: the whole submit is synchronous; errors become a rejected promise. */
  run(job: LoadJob): Promise<LoadResult> {
    try {
      return Promise.resolve(this.#submit(job));
    } catch (e) {
      return Promise.reject(e);
    }
  }

  #submit(job: LoadJob): LoadResult {
    const { args, inst, rank, shm } = job;
    const tStart = performance.now();
    const who = loadWho(inst, rank, args);
    const fields = loadFields(args);
    inst.begin("Load");
    let view: LoadTicket;
    try {
      // Last check, and the only state change before the copy: the store checks
      // the target count against the lease before this rank's consume is spent,
      // so every refusal up to here leaves the lease usable by a corrected retry.
      view = this.ctx.store.consumeLease(args.leaseId, inst.id, rank.rank, {
        tpRank: rank.tpRank,
        layers: rank.layers.map((l) => l.layerId),
        count: args.blockIds.length,
      });
    } catch (e) {
      inst.end();
      throw withContext(e, who, fields);
    }
    const tLease = performance.now();
    if (view.blockCount === 0) return this.#nothingToCopy(job, view, who);
    try {
      this.#stateOp(
        () => armLoadState(shm, rank.layers.length, job.owner),
        who,
        args.loadStateShm,
        fields,
      );
      // ONE scatter batch for every layer of the rank, in registration order.
      this.planner.writeLoad(
        this.batch,
        view,
        rank.layers,
        args.blockIds,
        { shm, offset: OFF_PROGRESS },
        { whole: args.whole === true },
      );
      const t0 = performance.now();
      let copy;
      try {
        copy = this.ctx.native.submit(this.batch);
      } catch (e) {
        // pf_copy_submit resets the progress words: a shrunk block fails it.
        if (!(e instanceof ClientMemoryFault)) throw e;
        throw precondition(
          `${who}: load state "${args.loadStateShm}" is gone: ${e.message}`,
          fields,
        );
      }
      // Ranges after the merge of contiguous segments (the batch is reused by the next load).
      const segments = this.batch.numSegs;
      const times = {
        tEntry: job.tEntry,
        tStart,
        tLease,
        t0,
        tSubmitted: performance.now(),
        segments,
      };
      const bytes = rank.layers.reduce((n, l) => n + l.slotBytes, 0) * args.blockIds.length;
      const done = this.#whenDone(job, view, copy, times);
      return { numBlocks: args.blockIds.length, numLayers: rank.layers.length, bytes, done };
    } catch (e) {
      this.ctx.store.loadDone(view);
      inst.end();
      throw e;
    }
  }

  /** A Load of 0 targets: this rank's share of the lease is consumed, the load is done. */
  #nothingToCopy(job: LoadJob, view: LoadTicket, who: string): LoadResult {
    const { args, inst, rank, shm } = job;
    this.ctx.store.loadDone(view);
    inst.end();
    // A throw here leaves the block to load()'s refusal path (marked failed, then closed).
    this.#stateOp(
      () => completeLoadState(shm, rank.layers.length),
      who,
      args.loadStateShm,
      loadFields(args),
    );
    this.#releaseShm(args, shm, job.owner);
    this.ctx.log.debug("load done", {
      instance: inst.id,
      request: args.requestId || undefined,
      rank: rank.rank,
      blocks: 0,
    });
    return { numBlocks: 0, numLayers: rank.layers.length, bytes: 0, done: Promise.resolve() };
  }

  /** Completion of a submitted scatter: metrics, log, failure state; always unpins and closes. */
  #whenDone(
    job: LoadJob,
    view: LoadTicket,
    copy: Promise<{ bytes: number; ns: number }>,
    t: {
      tEntry: number;
      tStart: number;
      tLease: number;
      t0: number;
      tSubmitted: number;
      segments: number;
    },
  ): Promise<void> {
    const { args, inst, rank, shm } = job;
    return copy.then(
      (d) => {
        const tDone = performance.now();
        this.ctx.metrics?.loadDone(d.bytes, (tDone - t.t0) / 1000, true, rank.deviceId);
        this.ctx.log.debug("load done", {
          instance: inst.id,
          request: args.requestId || undefined,
          rank: rank.rank,
          blocks: args.blockIds.length,
          bytes: d.bytes,
          segments: t.segments,
          whole: args.whole === true || undefined,
          admit_ms: round3(t.tStart - t.tEntry),
          prepare_ms: round3(t.t0 - t.tStart),
          lease_ms: round3(t.tLease - t.tStart),
          batch_ms: round3(t.t0 - t.tLease),
          submit_ms: round3(t.tSubmitted - t.t0),
          copy_ms: round3(tDone - t.t0),
          native_ms: round3(d.ns / 1e6),
          // Wall-clock ms of the submit and of the completion, to line up with an engine's clock.
          submitted_epoch_ms: round3(performance.timeOrigin + t.tSubmitted),
          done_epoch_ms: round3(performance.timeOrigin + tDone),
        });
      },
      (e) => {
        // Nothing is written into the load state here: the native layer wrote the
        // failure (state, then layers_ready) when the batch ended (pf_batch_done),
        // before this record was posted. The engine may have seen it and started
        // another load with the same block since; a write now would land on that one.
        this.ctx.metrics?.loadDone(0, (performance.now() - t.t0) / 1000, false, rank.deviceId);
        this.ctx.log.warn("load copy failed", {
          request: args.requestId || undefined,
          instance: inst.id,
          tp_rank: rank.tpRank,
          pp_rank: rank.ppRank,
          device: rank.deviceId,
          client_memory_fault: e instanceof ClientMemoryFault,
          error: (e as Error).message,
        });
      },
    ).finally(() => {
      this.ctx.store.loadDone(view);
      this.#releaseShm(args, shm, job.owner);
      inst.end();
    });
  }

  /**
   * Runs a guarded access to an engine's load state; a block the engine has
   * shrunk since it was opened fails the Load with FAILED_PRECONDITION.
   */
  #stateOp<T>(fn: () => T, who: string, name: string, fields: ErrorFields): T {
    try {
      return fn();
    } catch (e) {
      if (!(e instanceof ClientMemoryFault)) throw e;
      throw precondition(`${who}: load state "${name}" is gone: ${e.message}`, fields);
    }
  }

  /** The refusal of a load state whose header names another instance's load (refusal path only). */
  #taken(who: string, name: string, owner: number, fields: ErrorFields): EngineError {
    let holder = `another instance's load (owner tag 0x${owner.toString(16)})`;
    for (const id of this.ctx.instances.keys()) {
      if (loadStateOwner(id) === owner) holder = `a load of instance "${id}"`;
    }
    return invalid(
      `${who}: load state "${name}" is in use by ${holder}, still in flight; an engine names ` +
        `only load states it created, rearmed for each load`,
      fields,
    );
  }

  /** Best effort: a block the engine shrank cannot carry the failure any more. */
  #failState(shm: ShmPort, name: string, code: number, numLayers?: number): void {
    try {
      failLoadState(shm, code, numLayers);
    } catch (e) {
      if (!(e instanceof ClientMemoryFault)) throw e;
      this.ctx.log.warn("cannot mark load state failed: the engine shrank it", {
        shm: name,
        error: e.message,
      });
    }
  }

  /**
   * The load is done with its load state: kept mapped for the instance's next
   * load, or closed; an accepted load (`owner`: its tag) no longer holds it.
   */
  #releaseShm(args: LoadArgs, shm: ShmPort, owner?: number): void {
    if (owner !== undefined) this.states.end(owner, args.loadStateShm);
    this.states.release(args.instanceId, args.loadStateShm, LOAD_STATE_BYTES, shm);
  }
}

/** True when `owner` is `instance`'s tag (an id past the name rule is no instance's). */
function ownedBy(owner: number, instance: string): boolean {
  return instance.length <= MAX_NAME_CHARS && loadStateOwner(instance) === owner;
}

/** The load's ids, as its errors name them. */
function loadWho(inst: Instance, rank: RankCtx, args: LoadArgs): string {
  return `instance "${inst.id}" tp_rank ${rank.tpRank} pp_rank ${rank.ppRank}` +
    (args.requestId ? ` request "${args.requestId}"` : "");
}

function loadFields(args: LoadArgs): ErrorFields {
  return {
    instance: args.instanceId,
    tpRank: args.tpRank,
    ppRank: args.ppRank,
    requestId: args.requestId || undefined,
  };
}
