/**
 * An in-process KvEngine over the real host backend and a real store, for
 * the engine's own tests: the native port can hold a batch's completion
 * back (as a busy event loop would deliver it late) while the native layer
 * has already finished the copy and written its progress words.
 */
import * as grpc from "@grpc/grpc-js";
import { type EngineOptions, KvEngine } from "../../lib/engine/engine.ts";
import { engineServiceImpl } from "../../lib/server/grpc_service.ts";
import type { Sessions } from "../../lib/server/sessions.ts";
import { lenientService } from "../../lib/server/decode.ts";
import type { ServerMetrics } from "../../lib/server/metrics.ts";
import { openNative } from "../../lib/engine/native_adapter.ts";
import type { CopyDone, NativePort } from "../../lib/engine/ports.ts";
import { KvStore } from "../../lib/storage/store.ts";
import { Logger } from "../../lib/log.ts";
import { PegaflowClient } from "../../lib/client/client.ts";
import { LLAMA_3_1_8B, SimEngine } from "../../lib/client/sim_engine.ts";
import { PROTOCOL_VERSION } from "../../lib/engine/engine.ts";

export const MODEL = { ...LLAMA_3_1_8B, numLayers: 4 };
export const silent = new Logger("error", {}, () => {});

/**
 * The Engine service over `engine` on a grpc-js server in this process, on an
 * ephemeral loopback port (the caller force-shuts it down).
 */
export async function serveEngine(
  engine: KvEngine,
  sessions: Sessions,
  metrics: ServerMetrics,
  log: Logger,
): Promise<{ server: grpc.Server; port: number }> {
  const server = new grpc.Server();
  server.addService(lenientService(), engineServiceImpl(engine, sessions, metrics, log));
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync(
      "127.0.0.1:0",
      grpc.ServerCredentials.createInsecure(),
      (e, p) => e ? reject(e) : resolve(p),
    )
  );
  return { server, port };
}

/** A native port whose next submitted batch reports its completion only once released. */
export interface HeldNative {
  port: NativePort;
  /**
   * Holds the completion of the next batch submitted: `release` reports it as
   * it was, `fail` as a failed copy (the native layer finished it either way).
   */
  holdNext(): { release: () => void; fail: () => void; submitted: Promise<void> };
}

function holding(native: NativePort): HeldNative {
  let hold: { gate: Promise<boolean>; onSubmit: () => void } | undefined;
  const port: NativePort = {
    ...native,
    submit(b) {
      const copy = native.submit(b);
      const h = hold;
      if (!h) return copy;
      hold = undefined;
      h.onSubmit();
      return copy.then(
        (d: CopyDone) =>
          h.gate.then((failed) => failed ? Promise.reject(new Error("injected copy failure")) : d),
        (e: unknown) => h.gate.then(() => Promise.reject(e)),
      );
    },
  };
  return {
    port,
    holdNext() {
      let open!: (failed: boolean) => void;
      let onSubmit!: () => void;
      const gate = new Promise<boolean>((r) => open = r);
      const submitted = new Promise<void>((r) => onSubmit = r);
      hold = { gate, onSubmit };
      return { release: () => open(false), fail: () => open(true), submitted };
    },
  };
}

/** The host backend's native port over a 64 MiB pool: what the in-process engine tests run on. */
export function openTestNative(): ReturnType<typeof openNative> {
  return openNative({
    backend: "host",
    devices: [0],
    poolBytes: 64 << 20,
    useHugepages: false,
    transferPath: "auto",
  }, silent);
}

/** What {@link setup} may change: the defaults suit most engine tests. */
export interface SetupOptions {
  /** One namespace for every instance (DP instances sharing blocks); default one each. */
  namespace?: string;
  /** Stage sizes (`loadConcurrency`, `saveQueueDepth`, ...) and the tiers below RAM. */
  engine?: Partial<Pick<EngineOptions, StageOption | "tiers">>;
  /** The store's clock (lease and inflight expiry), for tests that move time. */
  clock?: () => number;
  /** TP size of every instance: `sims` then holds each instance's ranks in order. Default 1. */
  tpSize?: number;
}

type StageOption = "saveConcurrency" | "saveQueueDepth" | "loadConcurrency" | "loadQueueDepth";

/**
 * An engine, its store and native port, and the simulated ranks of `instances` registered
 * (TP 1 unless `opts.tpSize`: instance-major, `sims[i * tpSize + tpRank]`).
 */
export async function setup(instances: string[], numBlocks = 64, opts: SetupOptions = {}) {
  const native = await openTestNative();
  const held = holding(native);
  const store = new KvStore({ capacityBytes: native.poolBytes, clock: opts.clock });
  const engine = new KvEngine({
    native: held.port,
    store,
    log: silent,
    leaseTtlMs: 60_000,
    ...opts.engine,
  });
  // The simulated engines only need their regions here; no server connection is made.
  const client = new PegaflowClient("127.0.0.1:1");
  const tpSize = opts.tpSize ?? 1;
  const sims = instances.flatMap((instanceId) =>
    Array.from({ length: tpSize }, (_, tpRank) => {
      const sim = SimEngine.create({
        client,
        instanceId,
        namespace: opts.namespace ?? `ns-${instanceId}`,
        model: MODEL,
        numBlocks,
        backend: "host",
        tpRank,
        tpSize,
      });
      engine.register({ ...sim.registration(), clientVersion: PROTOCOL_VERSION });
      return sim;
    })
  );
  const teardown = async () => {
    await engine.close();
    await native.close();
    for (const s of sims) s.close();
    client.close();
  };
  return { engine, store, native, held, sims, teardown };
}
