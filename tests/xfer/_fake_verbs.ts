/**
 * Test helper: the RDMA transport over `fake_ibverbs.c`, a software stand-in
 * for libibverbs.so.1 (built here with gcc, loaded by the library through
 * `PEGAFLOW_LIBIBVERBS`), and a connected pair of RDMA endpoints in this
 * process. The stand-in models the verbs rules the transport depends on;
 * it is not hardware (docs/transfer.md, "The RDMA data path").
 */
import { CompletionRing, Engine, type Pool } from "../../ffi/mod.ts";
import { XferEndpoint, type XferPeer } from "../../ffi/xfer.ts";

const SOURCE = decodeURIComponent(new URL("./fake_ibverbs.c", import.meta.url).pathname);
const CSRC = decodeURIComponent(new URL("../../csrc", import.meta.url).pathname);
/** Where the stand-in is built, under the repository's ignored build/ folder. */
const FAKE_VERBS_CACHE = decodeURIComponent(
  new URL("../../build/fake_ibverbs", import.meta.url).pathname,
);
const GCC_FLAGS = ["-O1", "-g", "-std=gnu11", "-shared", "-fPIC", "-pthread"];

const CONTROLS = {
  fake_hold: { parameters: ["i32"], result: "void" },
  fake_release: { parameters: [], result: "i32" },
  fake_parked: { parameters: [], result: "i32" },
  fake_fail_post: { parameters: ["i32", "i32"], result: "void" },
  fake_defer_flush: { parameters: ["i32"], result: "i32" },
  fake_wait_polled: { parameters: ["i32", "i32"], result: "i32" },
  fake_deliver_flush: { parameters: [], result: "i32" },
  fake_deferred: { parameters: [], result: "i32" },
  fake_qp_count: { parameters: [], result: "i32" },
  fake_qp_state: { parameters: ["i32"], result: "i32" },
  fake_count: { parameters: ["i32"], result: "u64" },
  fake_fail_recv: { parameters: ["i32"], result: "void" },
  fake_fail_modify: { parameters: ["i32", "i32"], result: "i32" },
  fake_pause_poll: { parameters: ["i32"], result: "void" },
  fake_fail_poll: { parameters: ["i32", "i32"], result: "i32" },
  fake_reset: { parameters: [], result: "void" },
} as const satisfies Deno.ForeignLibraryInterface;

/** The stand-in's controls (see fake_ibverbs.c). */
export type FakeVerbs = Deno.DynamicLibrary<typeof CONTROLS>["symbols"];

let built: { path: string; lib: FakeVerbs } | undefined;

let builtPath: Promise<string> | undefined;

/** The stand-in's source, the header it includes and gcc's flags, hashed: 16 hex digits. */
async function sourceKey(): Promise<string> {
  const text = [
    await Deno.readTextFile(SOURCE),
    await Deno.readTextFile(`${CSRC}/pf_verbs.h`),
    GCC_FLAGS.join(" "),
  ].join("\0");
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, "0")).join("")
    .slice(0, 16);
}

/** Removes the stand-ins built from other versions of the source (`keep` stays). */
async function pruneOthers(keep: string): Promise<void> {
  for await (const e of Deno.readDir(FAKE_VERBS_CACHE)) {
    const path = `${FAKE_VERBS_CACHE}/${e.name}`;
    if (path !== keep && /^libfake_ibverbs-[0-9a-f]{16}\.so$/.test(e.name)) {
      await Deno.remove(path).catch(() => {}); // another process's prune got it first
    }
  }
}

/**
 * Builds the stand-in once per version of its source and answers its path;
 * loads nothing here. The path is `build/fake_ibverbs/libfake_ibverbs-KEY.so`
 * (KEY: {@link sourceKey}), so every process of a test run, children
 * included, uses the one build, and nothing is left in the temp directory
 * (before: each process compiled into a new `pf-fake-ibverbs-*` temp
 * directory that was never removed, 18 per run of rdma_fake_test.ts). gcc
 * writes a file of its own that is renamed into place: a process running at
 * the same time sees the whole library or none.
 */
export function buildFakeVerbs(): Promise<string> {
  builtPath ??= (async () => {
    const path = `${FAKE_VERBS_CACHE}/libfake_ibverbs-${await sourceKey()}.so`;
    if (await Deno.stat(path).then(() => true, () => false)) return path;
    await Deno.mkdir(FAKE_VERBS_CACHE, { recursive: true });
    const tmp = `${path}.${Deno.pid}.tmp`;
    try {
      const out = await new Deno.Command("gcc", {
        args: [...GCC_FLAGS, `-I${CSRC}`, "-o", tmp, SOURCE],
        stdout: "piped",
        stderr: "piped",
      }).output();
      if (out.code !== 0) {
        throw new Error(
          `gcc fake_ibverbs.c exited ${out.code}: ${new TextDecoder().decode(out.stderr)}`,
        );
      }
      await Deno.rename(tmp, path);
    } finally {
      await Deno.remove(tmp).catch(() => {}); // renamed, or gcc wrote nothing
    }
    await pruneOthers(path);
    return path;
  })();
  return builtPath;
}

/**
 * Builds the stand-in, points `PEGAFLOW_LIBIBVERBS` at it and opens its
 * controls (the same loaded copy the library uses: one path, one handle).
 * Process-wide: only for a process of its own (rdma_fake_test.ts runs the
 * cases that call it each in a child).
 */
export async function fakeVerbs(): Promise<{ path: string; lib: FakeVerbs }> {
  if (built) return built;
  const path = await buildFakeVerbs();
  Deno.env.set("PEGAFLOW_LIBIBVERBS", path);
  built = { path, lib: Deno.dlopen(path, CONTROLS).symbols };
  return built;
}

/** QP state numbers (`enum ibv_qp_state`). */
export const QPS = { RESET: 0, INIT: 1, RTR: 2, RTS: 3, ERR: 6 } as const;

/** `fake_count`'s counters. */
export const COUNT = {
  posts: 0,
  failedPosts: 1,
  flushes: 2,
  cqOverruns: 3,
  lostCompletions: 4,
  failedPolls: 5,
} as const;

/** Two RDMA endpoints of this process, connected both ways. */
export interface RdmaPair {
  fake: FakeVerbs;
  /** The requester: its pool, its ring, its peer towards B. */
  poolA: Pool;
  ringA: CompletionRing;
  epA: XferEndpoint;
  peerA: XferPeer;
  /** The target. */
  poolB: Pool;
  epB: XferEndpoint;
  peerB: XferPeer;
  /** Ordinal (fake_qp_state) of A's first QP; its others follow. */
  qpA: number;
  close(): Promise<void>;
}

/** Options of {@link rdmaPair}. */
export interface PairOptions {
  poolBytes?: number;
  /** QPs per peer. */
  streams?: number;
  stripeBytes?: number;
  /** A's ring capacity (B's is 4096). */
  ringA?: number;
  immTag?: number;
  /** false: both peers are left unconnected (the test connects them). Default true. */
  connect?: boolean;
}

/** Opens two RDMA endpoints over the stand-in and connects a peer of each to the other. */
export async function rdmaPair(o: PairOptions = {}): Promise<RdmaPair> {
  const { lib: fake } = await fakeVerbs();
  fake.fake_reset();
  const engine = Engine.open({ backend: "host" });
  const bytes = o.poolBytes ?? 16 << 20;
  const poolA = engine.createPool(bytes);
  const poolB = engine.createPool(bytes);
  const ringA = new CompletionRing(o.ringA ?? 4096);
  const ringB = new CompletionRing(4096);
  const base = { transport: "rdma", streams: o.streams ?? 2, stripeBytes: o.stripeBytes } as const;
  const epA = XferEndpoint.open({ ...base, pool: poolA, ring: ringA });
  const epB = XferEndpoint.open({ ...base, pool: poolB, ring: ringB, immTag: o.immTag });
  const qpA = fake.fake_qp_count();
  const peerA = epA.createPeer();
  const peerB = epB.createPeer();
  if (o.connect ?? true) {
    await peerA.connect(peerB.info(), 1000);
    await peerB.connect(peerA.info(), 1000);
  }
  return {
    fake,
    poolA,
    ringA,
    epA,
    peerA,
    poolB,
    epB,
    peerB,
    qpA,
    async close() {
      fake.fake_reset();
      fake.fake_deliver_flush();
      fake.fake_release();
      await epA.close();
      await epB.close();
      await ringA.shutdown();
      await ringB.shutdown();
      ringA.destroy();
      ringB.destroy();
      poolA.close();
      poolB.close();
      engine.close();
    },
  };
}

/** Another pair of peers between the pair's endpoints, connected both ways (closed with them). */
export async function addPeers(
  pair: RdmaPair,
): Promise<{ peerA: XferPeer; peerB: XferPeer; qpA: number }> {
  const qpA = pair.fake.fake_qp_count();
  const peerA = pair.epA.createPeer();
  const peerB = pair.epB.createPeer();
  await peerA.connect(peerB.info(), 1000);
  await peerB.connect(peerA.info(), 1000);
  return { peerA, peerB, qpA };
}

/** Resolves `p`, or rejects naming `what` after `ms` (so a hang fails the test). */
export async function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: nothing after ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([p, late]);
  } finally {
    clearTimeout(timer);
  }
}

/** True if `p` has settled within `ms` (it keeps running either way). */
export async function settlesWithin(p: Promise<unknown>, ms: number): Promise<boolean> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const r = await Promise.race([
    p.then(() => true, () => true),
    new Promise<boolean>((resolve) => timer = setTimeout(() => resolve(false), ms)),
  ]);
  clearTimeout(timer);
  return r;
}
