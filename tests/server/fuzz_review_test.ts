/**
 * A seeded, bounded fuzz of the server's handling of bad input from engines,
 * over both transports: real gRPC (grpc-js, a raw bytes-in/bytes-out client)
 * and the framed local RPC socket beside `--uds`. For every Engine RPC it
 * sends (a) random bytes, (b) valid messages with one field mutated, (c)
 * calls in the wrong order; on the local RPC socket also truncated frames,
 * bad lengths, unknown method ids and a frame split byte by byte.
 *
 * After each batch: the server answers Health; every bad input got a status
 * other than OK / INTERNAL / UNKNOWN / CANCELLED (an INTERNAL or UNKNOWN
 * means an unexpected exception, a CANCELLED an answer the transport could
 * not carry) whose text names what was wrong; no lease or pin is left once
 * the test's leases are spent; no region of an unregistered instance stays
 * mapped; the log has no "rpc failed unexpectedly" line; the data saved
 * before the batch still loads byte-exact.
 *
 * Deterministic: one seed (FUZZ_SEED) drives every random choice.
 */
import assert from "node:assert/strict";
import { Buffer } from "node:buffer";
import * as grpc from "@grpc/grpc-js";
import { BinaryWriter } from "@bufbuild/protobuf/wire";
import {
  LoadRequest,
  QueryPrefetchRequest,
  QueryPrefetchResponse,
  RegisterContextRequest,
  ReleaseRequest,
  SaveRequest,
  SessionRequest,
  UnregisterContextRequest,
  WaitPrefetchRequest,
} from "../../proto/pegaflow.ts";
import { PROTOCOL_VERSION } from "../../lib/client/client.ts";
import { chainedBlockHashes, syntheticTokens } from "../../lib/client/hashes.ts";
import { LoadState } from "../../lib/client/load_state.ts";
import { LLAMA_3_1_8B, type SimEngine } from "../../lib/client/sim_engine.ts";
import {
  hostSim,
  metricBecomes,
  type ServerProc,
  shmMappings,
  startServer,
  uid,
} from "./harness.ts";
import { mulberry32 } from "../_seeded.ts";

const FUZZ_SEED = 0x5eed_f022;
const MODEL = { ...LLAMA_3_1_8B, numLayers: 2 };
const NUM_BLOCKS = 16;
/** Random byte strings per RPC and transport. */
const RANDOM_BODIES = 24;
const CALL_DEADLINE_MS = 15_000;
const MB = 1 << 20;
/** Longest error text a refusal may carry (an id of any length is cut, never echoed whole). */
const MAX_DETAILS_CHARS = 4096;

const S = grpc.status;
/** What bad input may be answered with: a status that blames the input, never the server. */
const REFUSALS = new Set<number>([
  S.INVALID_ARGUMENT,
  S.NOT_FOUND,
  S.ALREADY_EXISTS,
  S.RESOURCE_EXHAUSTED,
  S.FAILED_PRECONDITION,
]);

/** The seeded draws the fuzzing makes. */
function rng(seed: number) {
  const next = mulberry32(seed);
  return {
    next,
    int: (n: number) => Math.floor(next() * n),
    bytes(n: number): Uint8Array {
      const b = new Uint8Array(n);
      for (let i = 0; i < n; i++) b[i] = Math.floor(next() * 256);
      return b;
    },
    pick<T>(xs: readonly T[]): T {
      return xs[Math.floor(next() * xs.length)];
    },
  };
}
type Rng = ReturnType<typeof rng>;

interface Answer {
  code: number;
  details: string;
  body?: Uint8Array;
}

const ENGINE_METHODS = [
  "RegisterContext",
  "Save",
  "QueryPrefetch",
  "WaitPrefetch",
  "Load",
  "Release",
  "UnregisterContext",
  "Session",
  "Health",
] as const;
type Method = typeof ENGINE_METHODS[number];
/** Method ids of the local RPC socket (lib/local_rpc/wire.ts). */
const LOCAL_IDS: Partial<Record<Method, number>> = {
  QueryPrefetch: 1,
  Load: 2,
  Release: 3,
  Save: 4,
  Health: 5,
  WaitPrefetch: 6,
};

const raw = (x: Uint8Array) => Buffer.from(x);

/** Every Engine method as a bytes-in, bytes-out gRPC call. */
class RawGrpc {
  readonly c: grpc.Client & Record<string, (...a: unknown[]) => unknown>;
  constructor(address: string) {
    const def = (name: string) => ({
      path: `/pegaflow.Engine/${name}`,
      requestStream: false,
      responseStream: name === "Session",
      requestSerialize: raw,
      requestDeserialize: raw,
      responseSerialize: raw,
      responseDeserialize: raw,
    });
    const Ctor = grpc.makeGenericClientConstructor(
      Object.fromEntries(ENGINE_METHODS.map((m) => [m, def(m)])),
      "Engine",
    );
    this.c = new Ctor(address, grpc.credentials.createInsecure(), {
      "grpc.max_send_message_length": 64 * MB,
      "grpc.max_receive_message_length": 64 * MB,
    }) as never;
  }

  call(method: Method, body: Uint8Array): Promise<Answer> {
    if (method === "Session") return this.#session(body);
    return new Promise((resolve) => {
      this.c[method](
        raw(body),
        { deadline: Date.now() + CALL_DEADLINE_MS },
        (err: grpc.ServiceError | null, res?: Buffer) =>
          resolve(
            err
              ? { code: err.code, details: err.details ?? err.message }
              : { code: 0, details: "", body: res },
          ),
      );
    });
  }

  /** A session that is still open after a moment is a valid one: cancelled, answered OK. */
  #session(body: Uint8Array): Promise<Answer> {
    return new Promise((resolve) => {
      const call = this.c.Session(raw(body), {
        deadline: Date.now() + CALL_DEADLINE_MS,
      }) as grpc.ClientReadableStream<Buffer>;
      let done = false;
      const finish = (a: Answer) => {
        if (done) return;
        done = true;
        clearTimeout(t);
        resolve(a);
      };
      const t = setTimeout(() => {
        finish({ code: 0, details: "session open" });
        call.cancel();
      }, 150);
      call.on("data", () => {});
      call.on("error", (e: grpc.ServiceError) => finish({ code: e.code, details: e.details }));
      call.on("end", () => finish({ code: 0, details: "session ended" }));
    });
  }

  close(): void {
    this.c.close();
  }
}

/** A raw local RPC connection: frames out, answers matched by call id. */
class RawFrames {
  #buf = new Uint8Array(0);
  #next = 1;
  #waiting = new Map<number, (a: Answer) => void>();
  #closed: Promise<void>;
  /** Answers with call id 0 (a bad frame: the connection is then closed). */
  readonly connErrors: Answer[] = [];

  constructor(readonly conn: Deno.UnixConn) {
    this.#closed = this.#readLoop();
  }

  static async dial(path: string): Promise<RawFrames> {
    return new RawFrames(await Deno.connect({ transport: "unix", path }));
  }

  static frame(callId: number, method: number, payload: Uint8Array, len?: number): Uint8Array {
    const out = new Uint8Array(9 + payload.length);
    const dv = new DataView(out.buffer);
    dv.setUint32(0, len ?? 5 + payload.length, true);
    dv.setUint32(4, callId, true);
    out[8] = method;
    out.set(payload, 9);
    return out;
  }

  async #readLoop(): Promise<void> {
    const chunk = new Uint8Array(1 << 16);
    for (;;) {
      let n: number | null;
      try {
        n = await this.conn.read(chunk);
      } catch {
        n = null;
      }
      if (n === null) break;
      const grown = new Uint8Array(this.#buf.length + n);
      grown.set(this.#buf);
      grown.set(chunk.subarray(0, n), this.#buf.length);
      this.#buf = grown;
      while (this.#buf.length >= 4) {
        const dv = new DataView(this.#buf.buffer, this.#buf.byteOffset);
        const len = dv.getUint32(0, true);
        if (this.#buf.length < 4 + len) break;
        const id = dv.getUint32(4, true);
        const status = this.#buf[8];
        const body = this.#buf.slice(9, 4 + len);
        this.#buf = this.#buf.slice(4 + len);
        const a = { code: status, details: status ? text(body) : "", body };
        if (id === 0) this.connErrors.push(a);
        const w = this.#waiting.get(id);
        this.#waiting.delete(id);
        w?.(a);
      }
    }
    for (const w of this.#waiting.values()) w({ code: -1, details: "connection closed" });
    this.#waiting.clear();
  }

  /** Resolves when the server closed the connection. */
  get closed(): Promise<void> {
    return this.#closed;
  }

  async send(bytes: Uint8Array): Promise<void> {
    let off = 0;
    while (off < bytes.length) off += await this.conn.write(bytes.subarray(off));
  }

  /** One call; `split` writes the frame one byte at a time. */
  async call(methodId: number, payload: Uint8Array, split = false): Promise<Answer> {
    const id = this.#next++;
    const answered = new Promise<Answer>((r) => this.#waiting.set(id, r));
    const f = RawFrames.frame(id, methodId, payload);
    if (split) {
      for (let i = 0; i < f.length; i++) {
        await this.send(f.subarray(i, i + 1));
        if (i % 8 === 0) await new Promise((r) => setTimeout(r, 0));
      }
    } else await this.send(f);
    let t: ReturnType<typeof setTimeout> | undefined;
    const timeout = new Promise<Answer>((r) =>
      t = setTimeout(() => r({ code: -2, details: "no answer (hang)" }), CALL_DEADLINE_MS)
    );
    try {
      return await Promise.race([answered, timeout]);
    } finally {
      clearTimeout(t);
    }
  }

  close(): void {
    try {
      this.conn.close();
    } catch {
      // closed by the server
    }
  }
}

const text = (b: Uint8Array) => new TextDecoder().decode(b);

/** One RPC over gRPC, and over the local RPC socket where the method is served there. */
interface Transports {
  grpc: RawGrpc;
  local: RawFrames;
}
async function both(t: Transports, method: Method, body: Uint8Array): Promise<Answer[]> {
  const out = [await t.grpc.call(method, body)];
  const id = LOCAL_IDS[method];
  if (id !== undefined) out.push(await t.local.call(id, body));
  return out;
}

/** What the current batch found wrong (every finding of a batch is reported together). */
const findings: string[] = [];

/** A refusal of bad input: a status that blames the input, and text naming `names`. */
function assertRefused(what: string, a: Answer, names: RegExp, codes = REFUSALS): void {
  if (!codes.has(a.code)) {
    const code = grpc.status[a.code] ?? String(a.code);
    findings.push(`${what}: status ${a.code} (${code}) "${a.details.slice(0, 300)}"`);
  } else if (!names.test(a.details)) {
    findings.push(`${what}: the error does not match ${names}: "${a.details.slice(0, 300)}"`);
  } else if (a.details.length > MAX_DETAILS_CHARS) {
    // An id of any length is never echoed whole: gRPC trailers carry ~8 KiB (grpcio's cap).
    findings.push(`${what}: ${a.details.length}-character error text`);
  }
}

/** The checks run after every batch. */
async function afterBatch(srv: ServerProc, t: Transports, batch: string): Promise<void> {
  const h = await t.grpc.call("Health", new Uint8Array(0));
  assert.equal(h.code, 0, `${batch}: Health over gRPC: ${h.details}`);
  const hl = await t.local.call(5, new Uint8Array(0));
  assert.equal(hl.code, 0, `${batch}: Health over local RPC: ${hl.details}`);
  const found = findings.splice(0);
  assert.deepEqual(found, [], `${batch}: ${found.length} bad answers`);
  const long = srv.logs().filter((l) => l.length > 16_384).map((l) =>
    `${l.length}: ${l.slice(0, 200)}`
  );
  assert.deepEqual(long, [], `${batch}: a log line echoes an input whole`);
  const bad = srv.logs().filter((l) => l.includes("rpc failed unexpectedly"));
  assert.deepEqual(bad.map((l) => l.slice(0, 600)), [], `${batch}: unexpected failures logged`);
}

async function noLeasesOrPins(srv: ServerProc, batch: string): Promise<void> {
  try {
    await metricBecomes(srv, "pegaflow_leases", 0);
    await metricBecomes(srv, "pegaflow_pinned_blocks", 0);
    await metricBecomes(srv, "pegaflow_loads_inflight", 0);
    await metricBecomes(srv, "pegaflow_inflight_blocks", 0);
  } catch (e) {
    throw new Error(`${batch}: ${(e as Error).message}`);
  }
}

/** A query of `hashes` by `sim`, over gRPC, that must be a hit; returns the lease id. */
async function leaseOf(t: Transports, sim: SimEngine, hashes: Uint8Array[], req: string) {
  const a = await t.grpc.call(
    "QueryPrefetch",
    QueryPrefetchRequest.encode({
      instanceId: sim.instanceId,
      blockHashes: hashes,
      requestId: req,
      loadInto: undefined,
      engineId: "",
    }).finish(),
  );
  assert.equal(a.code, 0, a.details);
  const r = QueryPrefetchResponse.decode(a.body!).result;
  assert.ok(r?.$case === "ready" && r.value.numHitBlocks === hashes.length, JSON.stringify(r));
  return r.value.leaseId;
}

/** A valid Load of `lease` into `ids`, waited for through its load state; the bytes are checked. */
async function loadAndVerify(
  srv: ServerProc,
  sim: SimEngine,
  st: LoadState,
  lease: Uint8Array,
  ids: number[],
  hashes: Uint8Array[],
): Promise<void> {
  sim.clear(ids);
  st.rearm();
  await srv.client.load({
    instanceId: sim.instanceId,
    tpRank: 0,
    ppRank: 0,
    leaseId: lease,
    blockIds: ids,
    loadStateShm: st.name,
  });
  assert.equal(await st.waitAll(), 1, "the load landed");
  assert.deepEqual(sim.verify(ids, hashes), { badSegments: 0, first: undefined });
}

/** (a) random bytes as the body of every RPC, over both transports. */
async function randomBodies(t: Transports, r: Rng): Promise<void> {
  for (const method of ENGINE_METHODS) {
    for (let i = 0; i < RANDOM_BODIES; i++) {
      // Mostly short garbage; sometimes a valid-looking tag byte first, sometimes long.
      const n = r.next() < 0.1 ? 1000 + r.int(4000) : r.int(64);
      const body = r.bytes(n);
      if (n > 0 && r.next() < 0.5) body[0] = r.pick([0x0a, 0x12, 0x1a, 0x22, 0x08, 0x10, 0x28]);
      for (const a of await both(t, method, body)) {
        // Bytes that happen to decode are a valid request of random ids: OK is fine.
        if (a.code === 0) continue;
        assertRefused(`${method} random ${i} (${n} bytes)`, a, /./);
      }
    }
  }
}

/** Bodies that stress the decoder itself: each is refused naming the message, or decodes. */
const CRAFTED: [string, Uint8Array][] = [
  // 100,000 nested start-group tags (field 15, wire type 3): a recursive skip's stack.
  ["nested groups", new Uint8Array(100_000).fill((15 << 3) | 3)],
  // Field 1 claims 2^31 bytes.
  ["length past the end", new Uint8Array([0x0a, 0x80, 0x80, 0x80, 0x80, 0x08, 0x41])],
  // An 11-byte varint.
  ["overlong varint", new Uint8Array([0x08, ...new Array(10).fill(0xff), 0x01])],
  // Wire types 6 and 7 do not exist.
  ["wire type 6", new Uint8Array([0x0e, 0x00])],
  ["wire type 7", new Uint8Array([0x0f, 0x00])],
  // Field number 0.
  ["field 0", new Uint8Array([0x00, 0x01])],
  // An end-group tag with no start.
  ["stray end group", new Uint8Array([0x0c])],
];

async function craftedBodies(t: Transports): Promise<void> {
  for (const method of ENGINE_METHODS) {
    for (const [what, body] of CRAFTED) {
      for (const a of await both(t, method, body)) {
        if (a.code === 0) continue;
        assertRefused(`${method} ${what}`, a, /./);
      }
    }
  }
}

/** One mutated request: the RPC, what was changed, the encoded body, what its refusal names. */
interface Mutant {
  method: Method;
  what: string;
  body: Uint8Array;
  names: RegExp;
}

function registrationMutants(sim: SimEngine, r: Rng): Mutant[] {
  const base = { ...sim.registration(), clientVersion: PROTOCOL_VERSION };
  let n = 0;
  const m = (what: string, names: RegExp, over: Partial<RegisterContextRequest>): Mutant => ({
    method: "RegisterContext",
    what,
    names,
    body: RegisterContextRequest.encode({
      ...base,
      instanceId: `${base.instanceId}-m${n++}`,
      ...over,
    }).finish(),
  });
  const g0 = base.geometry[0];
  const geo = (over: Partial<typeof g0>) => [{ ...g0, ...over }, base.geometry[1]];
  const handle = (bytes: Uint8Array) => [bytes, base.regionHandles[1]];
  const enc = (s: string) => {
    const h = new Uint8Array(64);
    h.set(new TextEncoder().encode(s).subarray(0, 64));
    return h;
  };
  const huge = r.int(2) ? 0xffff_ffff : 0x8000_0000;
  return [
    m("tp_size 0", /tp_size 0/, { tpSize: 0 }),
    m("tp_size huge", /tp_size \d+ out of range/, { tpSize: huge }),
    m("pp_size huge", /pp_size \d+ out of range/, { ppSize: huge, worldSize: 1 }),
    m("tp_rank = tp_size", /tp_rank 1 >= tp_size 1/, { tpRank: 1 }),
    m("pp_rank huge", /pp_rank \d+ >= pp_size 1/, { ppRank: huge }),
    m("world_size 0", /world_size 0/, { worldSize: 0 }),
    m("world_size huge", /world_size \d+/, { worldSize: huge }),
    m("device_id -1", /device_id -1/, { deviceId: -1 }),
    m("device_id max", /device_id 2147483647/, { deviceId: 0x7fff_ffff }),
    m("layer listed twice", /listed twice/, {
      layerNames: [base.layerNames[0], base.layerNames[0]],
    }),
    m("empty layer name", /layer 1 has an empty name/, { layerNames: [base.layerNames[0], ""] }),
    m("layer name 1 MiB", /layer 1 name ".*" is 1048576 characters, at most 1024/, {
      layerNames: [base.layerNames[0], "x".repeat(MB)],
    }),
    m("fewer handles", /2 layer_names but 1 region_handles/, {
      regionHandles: [base.regionHandles[0]],
    }),
    m("no geometry", /0 geometry entries/, { geometry: [] }),
    m("handle 0 bytes", /region handle is 0 bytes, expected 64/, {
      regionHandles: handle(new Uint8Array(0)),
    }),
    m("handle 65 bytes", /region handle is 65 bytes, expected 64/, {
      regionHandles: handle(new Uint8Array(65)),
    }),
    m("handle 1 MiB", /region handle is 1048576 bytes, expected 64/, {
      regionHandles: handle(new Uint8Array(MB)),
    }),
    m("handle without NUL", /cannot map region/, {
      regionHandles: handle(new Uint8Array(64).fill(0x61)),
    }),
    m("handle outside /dev/shm", /cannot map region/, {
      regionHandles: handle(enc("/../../etc/passwd")),
    }),
    m("handle all zero", /cannot map region/, { regionHandles: handle(new Uint8Array(64)) }),
    m("num_blocks 0", /num_blocks must be >= 1/, { geometry: geo({ numBlocks: 0 }) }),
    m("num_blocks huge", /geometry reaches byte|overlap/, { geometry: geo({ numBlocks: huge }) }),
    m("seg_bytes 0", /seg_bytes must be >= 1/, { geometry: geo({ segBytes: 0 }) }),
    m("num_segments 0", /num_segments must be 1\.\.8, got 0/, {
      geometry: geo({ numSegments: 0 }),
    }),
    m("num_segments huge", /num_segments must be 1\.\.8/, { geometry: geo({ numSegments: huge }) }),
    m("block_stride 0", /seg_bytes \d+ > block_stride 0/, { geometry: geo({ blockStride: 0 }) }),
    m("region_bytes 0", /region_bytes must be >= 1/, { geometry: geo({ regionBytes: 0 }) }),
    m("region_bytes past the object", /cannot map region/, {
      geometry: geo({ regionBytes: g0.regionBytes * 2 }),
    }),
    m("base_offset 2^53-1", /geometry reaches byte/, {
      geometry: geo({ baseOffset: Number.MAX_SAFE_INTEGER }),
    }),
    m("seg_bytes mismatched", /all layers must agree/, {
      geometry: [g0, { ...g0, segBytes: g0.segBytes / 2 }],
    }),
    m("namespace empty", /namespace is empty/, { namespace: "" }),
    m("namespace 1 MiB", /namespace is 1048576 characters/, { namespace: "n".repeat(MB) }),
    m("namespace with ':'", /namespace "a:b" contains ":"/, { namespace: "a:b" }),
    m("instance id empty", /instance_id is empty/, { instanceId: "" }),
    m("instance id 1 MiB", /instance_id is 1048576 characters/, { instanceId: "i".repeat(MB) }),
    m("client version empty", /client version ""/, { clientVersion: "" }),
    m("client version 1 MiB", /client version .* does not match/, {
      clientVersion: "v".repeat(MB),
    }),
    m("instance id 1 MiB and an old client", /client version "pegaflow-0" does not match/, {
      instanceId: "i".repeat(MB),
      clientVersion: "pegaflow-0",
    }),
    {
      method: "RegisterContext",
      what: "seg_bytes 2^64-1",
      names: /geometry\[2\]\.seg_bytes is above 2\^53 - 1/,
      body: u64Field(
        RegisterContextRequest.encode({ ...base, instanceId: `${base.instanceId}-u64` }).finish(),
      ),
    },
  ];
}

/** The request with a third LayerGeometry whose seg_bytes is 2^64 - 1 (field 11.4). */
function u64Field(valid: Uint8Array): Uint8Array {
  const w = new BinaryWriter();
  w.uint32((11 << 3) | 2).fork();
  w.uint32((4 << 3) | 0).uint64(2n ** 64n - 1n);
  w.join();
  const extra = w.finish();
  // Repeated message fields concatenate: the extra entry becomes geometry[2].
  const out = new Uint8Array(valid.length + extra.length);
  out.set(valid);
  out.set(extra, valid.length);
  return out;
}

function saveMutants(sim: SimEngine, hashes: Uint8Array[], r: Rng): Mutant[] {
  const base: SaveRequest = {
    instanceId: sim.instanceId,
    tpRank: 0,
    ppRank: 0,
    layers: [],
    blockIds: [4, 5],
    blockHashes: [hashes[4], hashes[5]],
    requestId: "fz-save",
    engineId: "",
    discardHashes: [],
  };
  const m = (what: string, names: RegExp, over: Partial<SaveRequest>): Mutant => ({
    method: "Save",
    what,
    names,
    body: SaveRequest.encode({ ...base, ...over }).finish(),
  });
  const past = NUM_BLOCKS + r.int(0xffff_fff0);
  const layer = (layerName: string, ids = [4], hs = [hashes[4]]) => ({
    layerName,
    blockIds: ids,
    blockHashes: hs,
  });
  const L = sim.layerNames;
  return [
    m("block id = num_blocks", /block id 16 >= num_blocks 16/, { blockIds: [4, 16] }),
    m("block id past num_blocks", new RegExp(`block id ${past} >= num_blocks 16`), {
      blockIds: [past, 5],
    }),
    m("block id u32 max", /block id 4294967295 >= num_blocks 16/, { blockIds: [4, 0xffff_ffff] }),
    m("more ids than hashes", /3 block_ids but 2 block_hashes/, { blockIds: [4, 5, 6] }),
    m("ids without hashes", /2 block_ids but 0 block_hashes/, { blockHashes: [] }),
    m("hashes without ids", /0 block_ids but 2 block_hashes/, { blockIds: [] }),
    m("empty hash", /block hash 1 is 0 bytes \(1\.\.64\)/, {
      blockHashes: [hashes[4], new Uint8Array(0)],
    }),
    m("65-byte hash", /block hash 0 is 65 bytes/, { blockHashes: [new Uint8Array(65), hashes[5]] }),
    m("1 MiB hash", /block hash 0 is 1048576 bytes/, {
      blockHashes: [new Uint8Array(MB), hashes[5]],
    }),
    m("unknown layer", /layer "nope", which this rank did not register/, {
      blockIds: [],
      blockHashes: [],
      layers: [layer("nope")],
    }),
    m("empty layer name", /layer "", which this rank did not register/, {
      blockIds: [],
      blockHashes: [],
      layers: [layer("")],
    }),
    m("1 MiB layer name", /which this rank did not register/, {
      blockIds: [],
      blockHashes: [],
      layers: [layer("L".repeat(MB))],
    }),
    m("layer listed twice", /lists layer ".*" twice/, {
      blockIds: [],
      blockHashes: [],
      layers: [layer(L[0]), layer(L[0])],
    }),
    m("per-layer id past num_blocks", /layer "model\.layers\.001\.attn": block id 99/, {
      blockIds: [],
      blockHashes: [],
      layers: [layer(L[0]), layer(L[1], [99])],
    }),
    m("per-layer lists of different lengths", /1 block_ids but 2 block_hashes/, {
      blockIds: [],
      blockHashes: [],
      layers: [layer(L[0], [4], [hashes[4], hashes[5]])],
    }),
    m("too many hashes", /65537 block hashes; at most 65536/, {
      blockIds: Array.from({ length: 65_537 }, () => 4),
      blockHashes: Array.from({ length: 65_537 }, () => hashes[4]),
    }),
    m("both list forms", /both per-layer lists and the all-layers/, { layers: [layer(L[0])] }),
    m("tp_rank outside the topology", /tp_rank 1 pp_rank 0, outside its topology/, { tpRank: 1 }),
    m("tp_rank u32 max", /tp_rank 4294967295 pp_rank 0, outside its topology/, {
      tpRank: 0xffff_ffff,
    }),
    m("pp_rank outside the topology", /pp_rank 3, outside its topology/, { ppRank: 3 }),
    m("unknown instance", /instance "ghost" is not registered/, { instanceId: "ghost" }),
    m("empty instance", /Save: instance_id is empty/, { instanceId: "" }),
    m("1 MiB instance id", /Save: instance_id is 1048576 characters, at most 128/, {
      instanceId: "i".repeat(MB),
    }),
    m("instance id with ':'", /Save: instance_id "a:b" contains ":"/, { instanceId: "a:b" }),
    m("1 MiB request id and a bad block", /block id 16 >= num_blocks 16/, {
      blockIds: [4, 16],
      requestId: "r".repeat(MB),
    }),
  ];
}

function queryMutants(sim: SimEngine, hashes: Uint8Array[], st: string): Mutant[] {
  const base: QueryPrefetchRequest = {
    instanceId: sim.instanceId,
    blockHashes: hashes.slice(0, 4),
    requestId: "fz-query",
    loadInto: undefined,
    engineId: "",
  };
  const m = (what: string, names: RegExp, over: Partial<QueryPrefetchRequest>): Mutant => ({
    method: "QueryPrefetch",
    what,
    names,
    body: QueryPrefetchRequest.encode({ ...base, ...over }).finish(),
  });
  const into = (blockIds: number[], ranks = [{ tpRank: 0, ppRank: 0, loadStateShm: st }]) => ({
    blockIds,
    ranks,
  });
  return [
    m("no request id", /QueryPrefetch needs a request_id/, { requestId: "" }),
    m("empty hash", /block hash 2 is 0 bytes/, {
      blockHashes: [hashes[0], hashes[1], new Uint8Array(0)],
    }),
    m("65-byte hash", /block hash 0 is 65 bytes/, { blockHashes: [new Uint8Array(65)] }),
    m("too many hashes", /65537 block hashes; at most 65536/, {
      blockHashes: Array.from({ length: 65_537 }, () => hashes[0]),
    }),
    m("unknown instance", /instance "ghost" is not registered/, { instanceId: "ghost" }),
    m("1 MiB instance id", /instance_id is 1048576 characters, at most 128/, {
      instanceId: "i".repeat(MB),
    }),
    m("empty instance id", /instance_id is empty/, { instanceId: "" }),
    m("1 MiB request id, unknown instance", /is not registered/, {
      instanceId: "ghost",
      requestId: "r".repeat(MB),
    }),
    m("load_into: fewer targets than hashes", /names 3 targets for 4 hashes/, {
      loadInto: into([8, 9, 10]),
    }),
    m("load_into: no rank", /names 0 ranks; every rank of the instance once \(1\)/, {
      loadInto: into([8, 9, 10, 11], []),
    }),
    m("load_into: a rank outside the topology", /names tp_rank 7 pp_rank 0 \(tp_size 1/, {
      loadInto: into([8, 9, 10, 11], [{ tpRank: 7, ppRank: 0, loadStateShm: st }]),
    }),
    m("load_into: pp_rank u32 max", /names tp_rank 0 pp_rank 4294967295/, {
      loadInto: into([8, 9, 10, 11], [{ tpRank: 0, ppRank: 0xffff_ffff, loadStateShm: st }]),
    }),
  ];
}

/** WaitPrefetch mutants: each refused at once (none holds), naming what was wrong. */
function waitMutants(sim: SimEngine): Mutant[] {
  const base: WaitPrefetchRequest = {
    instanceId: sim.instanceId,
    requestId: "fz-wait",
    waitMs: 100,
    engineId: "",
  };
  const m = (what: string, names: RegExp, over: Partial<WaitPrefetchRequest>): Mutant => ({
    method: "WaitPrefetch",
    what,
    names,
    body: WaitPrefetchRequest.encode({ ...base, ...over }).finish(),
  });
  return [
    m("wait_ms 0", /wait_ms is 0; 1\.\.60000 is accepted/, { waitMs: 0 }),
    m("wait_ms u32 max", /wait_ms is 4294967295; 1\.\.60000 is accepted/, { waitMs: 0xffff_ffff }),
    m("no request id", /WaitPrefetch needs a request_id/, { requestId: "" }),
    m("1 MiB request id", /request_id "r{64}\.\.\." is 1048576 characters/, {
      requestId: "r".repeat(MB),
    }),
    m("unknown instance", /instance "ghost" is not registered/, { instanceId: "ghost" }),
    m("empty instance id", /WaitPrefetch \(request "fz-wait"\): instance_id is empty/, {
      instanceId: "",
    }),
    m("1 MiB instance id", /instance_id is 1048576 characters, at most 128/, {
      instanceId: "i".repeat(MB),
    }),
  ];
}

/** Load mutants against a live lease: every one is refused before the lease is spent. */
function loadMutants(sim: SimEngine, lease: Uint8Array, st: string, regionName: string): Mutant[] {
  const base: LoadRequest = {
    instanceId: sim.instanceId,
    tpRank: 0,
    ppRank: 0,
    leaseId: lease,
    blockIds: [8, 9, 10, 11],
    loadStateShm: st,
    requestId: "fz-load",
    whole: false,
    engineId: "",
  };
  const m = (what: string, names: RegExp, over: Partial<LoadRequest>): Mutant => ({
    method: "Load",
    what,
    names,
    body: LoadRequest.encode({ ...base, ...over }).finish(),
  });
  return [
    m("lease id 0 bytes", /lease id is 0 bytes, expected 16/, { leaseId: new Uint8Array(0) }),
    m("lease id 15 bytes", /lease id is 15 bytes, expected 16/, { leaseId: lease.slice(0, 15) }),
    m("lease id 17 bytes", /lease id is 17 bytes, expected 16/, {
      leaseId: new Uint8Array([...lease, 0]),
    }),
    m("lease id 1 MiB", /lease id is 1048576 bytes, expected 16/, { leaseId: new Uint8Array(MB) }),
    m(
      "more targets than the lease",
      /holds 4 blocks; a load names at most that many targets, got 5/,
      {
        blockIds: [8, 9, 10, 11, 12],
      },
    ),
    m("target = num_blocks", /target block id 16 >= num_blocks 16/, { blockIds: [8, 9, 10, 16] }),
    m("target u32 max", /target block id 4294967295 >= num_blocks 16/, {
      blockIds: [0xffff_ffff],
    }),
    m("no load state", /Load needs load_state_shm/, { loadStateShm: "" }),
    m("missing load state", /cannot open load state "\/pegaflow-fz-none"/, {
      loadStateShm: "/pegaflow-fz-none",
    }),
    m("load state outside /dev/shm", /cannot open load state/, {
      loadStateShm: "/../../etc/passwd",
    }),
    m("load state without a leading /", /cannot open load state/, { loadStateShm: "etc" }),
    m("1 MiB load state name", /cannot open load state/, { loadStateShm: "/" + "s".repeat(MB) }),
    m("a KV region as the load state", /magic 0x[0-9a-f]+ is not 0x534c4650/, {
      loadStateShm: regionName,
    }),
    m("tp_rank outside the topology", /tp_rank 1 pp_rank 0, outside its topology/, { tpRank: 1 }),
    m("pp_rank u32 max", /pp_rank 4294967295, outside its topology/, { ppRank: 0xffff_ffff }),
    m("unknown instance", /instance "ghost" is not registered/, { instanceId: "ghost" }),
    m("1 MiB instance id", /Load: instance_id is 1048576 characters, at most 128/, {
      instanceId: "i".repeat(MB),
    }),
    m("empty instance id", /Load: instance_id is empty/, { instanceId: "" }),
  ];
}

function otherMutants(r: Rng): Mutant[] {
  const rel = (what: string, names: RegExp, leaseId: Uint8Array): Mutant => ({
    method: "Release",
    what,
    names,
    body: ReleaseRequest.encode({ leaseId }).finish(),
  });
  const unreg = (what: string, instanceId: string, names = /is not registered/): Mutant => ({
    method: "UnregisterContext",
    what,
    names,
    body: UnregisterContextRequest.encode({ instanceId }).finish(),
  });
  const session = (what: string, names: RegExp, req: SessionRequest): Mutant => ({
    method: "Session",
    what,
    names,
    body: SessionRequest.encode(req).finish(),
  });
  return [
    rel("release: empty lease id", /lease id is 0 bytes, expected 16/, new Uint8Array(0)),
    rel("release: 15-byte lease id", /lease id is 15 bytes, expected 16/, r.bytes(15)),
    rel("release: 1 MiB lease id", /lease id is 1048576 bytes, expected 16/, new Uint8Array(MB)),
    rel("release: unknown lease", /lease/, r.bytes(16)),
    unreg("unregister: unknown instance", "ghost"),
    unreg("unregister: empty instance", "", /UnregisterContext: instance_id is empty/),
    unreg("unregister: 1 MiB instance id", "i".repeat(MB), /instance_id is 1048576 characters/),
    session("session: tp_rank 1024", /tp_rank 1024 out of range 0\.\.1023/, {
      instanceId: "ghost",
      tpRank: 1024,
      ppRank: 0,
    }),
    session("session: pp_rank u32 max", /pp_rank 4294967295 out of range/, {
      instanceId: "ghost",
      tpRank: 0,
      ppRank: 0xffff_ffff,
    }),
    session("session: empty instance id", /Session: instance_id is empty/, {
      instanceId: "",
      tpRank: 0,
      ppRank: 0,
    }),
    session("session: instance id with a space", /instance_id "engine 0" contains " "/, {
      instanceId: "engine 0",
      tpRank: 0,
      ppRank: 0,
    }),
    session("session: a 128-character instance id and a bad rank", /tp_rank 2048 out of range/, {
      instanceId: "i".repeat(128),
      tpRank: 2048,
      ppRank: 0,
    }),
    session("session: 1 MiB instance id", /instance_id is 1048576 characters/, {
      instanceId: "i".repeat(MB),
      tpRank: 2048,
      ppRank: 0,
    }),
  ];
}

async function sendMutants(t: Transports, mutants: Mutant[]): Promise<void> {
  for (const mu of mutants) {
    const answers = await both(t, mu.method, mu.body);
    answers.forEach((a, i) =>
      assertRefused(`${mu.method} ${mu.what} over ${i ? "local RPC" : "gRPC"}`, a, mu.names)
    );
  }
}

/** Bad frames on the local RPC socket: each closes only its own connection; nothing hangs. */
async function badFrames(path: string, r: Rng): Promise<void> {
  // Unknown method ids: UNIMPLEMENTED naming the id, the connection stays usable.
  const c = await RawFrames.dial(path);
  for (const id of [0, 7, 100, 255, r.int(248) + 7]) {
    const a = await c.call(id, r.bytes(r.int(32)));
    assert.equal(a.code, S.UNIMPLEMENTED, `method id ${id}: ${a.details}`);
    assert.match(a.details, new RegExp(`unknown method id ${id} \\(known: 1, 2, 3, 4, 5, 6\\)`));
  }
  // A frame split byte by byte is answered once, like a whole one.
  const q = QueryPrefetchRequest.encode({
    instanceId: "ghost",
    blockHashes: [r.bytes(32)],
    requestId: "split",
    loadInto: undefined,
    engineId: "",
  }).finish();
  assertRefused("split QueryPrefetch", await c.call(1, q, true), /instance "ghost"/);
  assert.equal((await c.call(5, new Uint8Array(0), true)).code, 0, "split Health");
  c.close();

  // Lengths below the header: INVALID_ARGUMENT with call id 0, then the connection closes.
  for (const len of [0, 1, 4]) {
    const b = await RawFrames.dial(path);
    await b.send(RawFrames.frame(9, 5, new Uint8Array(0), len));
    await b.closed;
    assert.equal(b.connErrors.length, 1, `len ${len}: one answer`);
    assertRefused(`frame len ${len}`, b.connErrors[0], /below the 5-byte header/);
    b.close();
  }
  // A length past the message limit: RESOURCE_EXHAUSTED, closed.
  for (const len of [0xffff_ffff, 0x7fff_ffff, 64 * MB + 6]) {
    const b = await RawFrames.dial(path);
    await b.send(RawFrames.frame(9, 1, new Uint8Array(0), len));
    await b.closed;
    assert.equal(b.connErrors.length, 1, `len ${len}: one answer`);
    assertRefused(`frame len ${len}`, b.connErrors[0], /exceeds the \d+-byte message limit/);
    b.close();
  }
  // Truncated frames: the peer goes away mid-frame (header only, half a payload, 3 bytes).
  for (const cut of [3, 9, 20]) {
    const b = await RawFrames.dial(path);
    const f = RawFrames.frame(9, 1, q);
    await b.send(f.subarray(0, cut));
    b.close();
  }
  // A frame whose length is short of its payload: the rest reads as the next frame's header.
  const d = await RawFrames.dial(path);
  const f = RawFrames.frame(11, 5, r.bytes(40), 5 + 3);
  await d.send(f);
  await Promise.race([d.closed, new Promise((res) => setTimeout(res, 500))]);
  d.close();
}

Deno.test("fuzz: bad input from engines over gRPC and the local RPC socket is refused, named, and harms nothing", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-fuzz-" });
  // The lease must outlive every Load mutant on a loaded 2-core machine (600 ms did not).
  const srv = await startServer(["--uds", `${dir}/grpc.sock`, "--lease-ttl-ms", "5000"]);
  const r = rng(FUZZ_SEED);
  const t: Transports = {
    grpc: new RawGrpc(srv.grpc),
    local: await RawFrames.dial(`${dir}/grpc.sock.rpc`),
  };
  const sim = hostSim(srv, {
    instanceId: uid("fz"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: NUM_BLOCKS,
  });
  const st = LoadState.create();
  const hashes = chainedBlockHashes(syntheticTokens(11, 16 * 8), 16);
  try {
    await sim.register();
    sim.fill([0, 1, 2, 3, 4, 5, 6, 7], hashes);
    await sim.save([0, 1, 2, 3], hashes.slice(0, 4));

    await randomBodies(t, r);
    await afterBatch(srv, t, "random bodies");
    await craftedBodies(t);
    await afterBatch(srv, t, "crafted bodies");

    await sendMutants(t, registrationMutants(sim, r));
    await afterBatch(srv, t, "RegisterContext mutants");
    const inst = (await (await srv.http_get("/instances")).json()).instances;
    assert.deepEqual(inst.map((i: { instanceId: string }) => i.instanceId), [sim.instanceId]);

    await sendMutants(t, saveMutants(sim, hashes, r));
    await afterBatch(srv, t, "Save mutants");
    const q4 = await sim.query(hashes.slice(0, 6), "fz-after-saves");
    assert.ok(q4.kind === "ready" && q4.hits === 4, "no refused save stored anything");
    if (q4.kind === "ready") await srv.client.release(q4.leaseId);

    await sendMutants(t, queryMutants(sim, hashes, st.name));
    await afterBatch(srv, t, "QueryPrefetch mutants");
    await noLeasesOrPins(srv, "QueryPrefetch mutants");

    await sendMutants(t, waitMutants(sim));
    await afterBatch(srv, t, "WaitPrefetch mutants");

    const lease = await leaseOf(t, sim, hashes.slice(0, 4), "fz-lease");
    await sendMutants(t, loadMutants(sim, lease, st.name, shmName(sim)));
    await afterBatch(srv, t, "Load mutants");
    // Every refusal left the lease usable, and no refused Load wrote into the KV.
    assert.deepEqual(sim.verify([4, 5, 6, 7], hashes.slice(4, 8)), {
      badSegments: 0,
      first: undefined,
    });
    await loadAndVerify(srv, sim, st, lease, [8, 9, 10, 11], hashes.slice(0, 4));

    await sendMutants(t, otherMutants(r));
    await afterBatch(srv, t, "Release, UnregisterContext and Session mutants");
    await noLeasesOrPins(srv, "mutants");

    await badFrames(`${dir}/grpc.sock.rpc`, r);
    await afterBatch(srv, t, "bad frames");

    // Unregistered, the instance leaves nothing mapped: not its regions (one was named as a
    // load state above), not its load state.
    await srv.client.unregisterContext(sim.instanceId);
    await noLeasesOrPins(srv, "unregister");
    for (const reg of sim.regions) {
      const n = text(reg.handle.subarray(0, reg.handle.indexOf(0))).slice(1);
      assert.deepEqual(shmMappings(srv.pid, n), [], `${n} unmapped`);
    }
    assert.deepEqual(shmMappings(srv.pid, st.name.slice(1)), [], "the load state is unmapped");
  } finally {
    st.close();
    t.grpc.close();
    t.local.close();
    await srv.client.unregisterContext(sim.instanceId).catch(() => {});
    sim.close();
    await srv.stop();
    await Deno.remove(dir, { recursive: true }).catch(() => {});
  }
});

/** The shm name of the sim's first region, from its handle. */
function shmName(sim: SimEngine): string {
  const h = sim.regions[0].handle;
  return text(h.subarray(0, h.indexOf(0)));
}

Deno.test("fuzz: calls in the wrong order are refused with the ids, and leak no lease, pin or mapping", async () => {
  const dir = await Deno.makeTempDir({ prefix: "pegaflow-fuzz-" });
  const srv = await startServer(["--uds", `${dir}/grpc.sock`, "--lease-ttl-ms", "400"]);
  const r = rng(FUZZ_SEED + 1);
  const t: Transports = {
    grpc: new RawGrpc(srv.grpc),
    local: await RawFrames.dial(`${dir}/grpc.sock.rpc`),
  };
  const id = uid("fzo");
  const sim = hostSim(srv, {
    instanceId: id,
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: NUM_BLOCKS,
  });
  const half = hostSim(srv, {
    instanceId: uid("fzh"),
    namespace: uid("ns"),
    model: MODEL,
    numBlocks: NUM_BLOCKS,
    tpSize: 2,
  });
  const st = LoadState.create();
  const hashes = chainedBlockHashes(syntheticTokens(12, 16 * 4), 16);
  const save = (instanceId: string) =>
    SaveRequest.encode({
      instanceId,
      tpRank: 0,
      ppRank: 0,
      layers: [],
      blockIds: [0, 1, 2, 3],
      blockHashes: hashes,
      requestId: "fz-order",
      engineId: "",
      discardHashes: [],
    }).finish();
  const query = (instanceId: string) =>
    QueryPrefetchRequest.encode({
      instanceId,
      blockHashes: hashes,
      requestId: "fz-order",
      loadInto: undefined,
      engineId: "",
    }).finish();
  const load = (instanceId: string, leaseId: Uint8Array, blockIds = [8, 9, 10, 11]) =>
    LoadRequest.encode({
      instanceId,
      tpRank: 0,
      ppRank: 0,
      leaseId,
      blockIds,
      loadStateShm: st.name,
      requestId: "fz-order",
      whole: false,
      engineId: "",
    }).finish();
  const release = (leaseId: Uint8Array) => ReleaseRequest.encode({ leaseId }).finish();
  const expectAll = async (what: string, m: Method, body: Uint8Array, names: RegExp) => {
    for (const [i, a] of (await both(t, m, body)).entries()) {
      assertRefused(`${what} over ${i ? "local RPC" : "gRPC"}`, a, names);
    }
  };
  try {
    // Save / Query / Load before RegisterContext.
    await expectAll(
      "Save before RegisterContext",
      "Save",
      save(id),
      new RegExp(`instance "${id}" is not registered`),
    );
    await expectAll(
      "Query before RegisterContext",
      "QueryPrefetch",
      query(id),
      new RegExp(`instance "${id}" is not registered`),
    );
    await expectAll(
      "Load before RegisterContext",
      "Load",
      load(id, r.bytes(16)),
      new RegExp(`instance "${id}" is not registered`),
    );

    // Before the topology is sealed (1 of 2 TP ranks registered).
    await half.register();
    const h = half.instanceId;
    await expectAll("Save before seal", "Save", save(h), /before the topology is sealed \(1\/2/);
    await expectAll(
      "Query before seal",
      "QueryPrefetch",
      query(h),
      /before the topology is sealed \(1\/2/,
    );
    await expectAll(
      "Load before seal",
      "Load",
      load(h, r.bytes(16)),
      /before the topology is sealed \(1\/2/,
    );

    await sim.register();
    sim.fill([0, 1, 2, 3], hashes);
    // Load before any QueryPrefetch: a lease id nobody was given.
    await expectAll("Load of a lease never granted", "Load", load(id, r.bytes(16)), /lease/);
    await sim.save([0, 1, 2, 3], hashes);

    // Double release; Load on a released lease.
    const l1 = await leaseOf(t, sim, hashes, "fz-l1");
    const first = await t.grpc.call("Release", release(l1));
    assert.equal(first.code, 0, first.details);
    await expectAll("second Release", "Release", release(l1), /lease/);
    await expectAll("Load of a released lease", "Load", load(id, l1), /lease/);

    // Load twice for one rank: the second finds the share spent.
    const l2 = await leaseOf(t, sim, hashes, "fz-l2");
    await loadAndVerify(srv, sim, st, l2, [8, 9, 10, 11], hashes);
    await expectAll("second Load of one rank", "Load", load(id, l2), /lease/);
    await expectAll("Release of a spent lease", "Release", release(l2), /lease/);

    // Load on an expired lease (TTL 400 ms).
    const l3 = await leaseOf(t, sim, hashes, "fz-l3");
    await new Promise((res) => setTimeout(res, 1000));
    await expectAll("Load of an expired lease", "Load", load(id, l3), /lease/);
    await expectAll("Release of an expired lease", "Release", release(l3), /lease/);
    await afterBatch(srv, t, "lease order");
    await noLeasesOrPins(srv, "lease order");

    // Another instance's lease: refused, and the owner's share is still there.
    const other = hostSim(srv, {
      instanceId: uid("fzx"),
      namespace: sim.namespace,
      model: MODEL,
      numBlocks: NUM_BLOCKS,
    });
    try {
      await other.register();
      const l5 = await leaseOf(t, sim, hashes, "fz-l5");
      await expectAll(
        "Load of another instance's lease",
        "Load",
        load(other.instanceId, l5),
        /lease/,
      );
      await loadAndVerify(srv, sim, st, l5, [8, 9, 10, 11], hashes);
      await srv.client.unregisterContext(other.instanceId);
    } finally {
      other.close();
    }

    // Query-and-load whose rank is refused (a target past num_blocks, no load state): the
    // answer names the rank and why, and the lease is given back at once.
    for (
      const [why, blockIds, shm, names] of [
        [
          "a target past num_blocks",
          [8, 9, 10, 99],
          st.name,
          /target block id 99 >= num_blocks 16/,
        ],
        ["no load state", [8, 9, 10, 11], "", /Load needs load_state_shm/],
        ["a missing load state", [8, 9, 10, 11], "/pegaflow-fz-none", /cannot open load state/],
      ] as const
    ) {
      const body = QueryPrefetchRequest.encode({
        instanceId: id,
        blockHashes: hashes,
        requestId: "fz-into",
        loadInto: { blockIds: [...blockIds], ranks: [{ tpRank: 0, ppRank: 0, loadStateShm: shm }] },
        engineId: "",
      }).finish();
      for (const [i, a] of (await both(t, "QueryPrefetch", body)).entries()) {
        assert.equal(a.code, 0, a.details);
        const res = QueryPrefetchResponse.decode(a.body!).result;
        assert.ok(res?.$case === "ready", `${why} over ${i ? "local RPC" : "gRPC"}`);
        assert.equal(res.value.loads.length, 1);
        assert.match(res.value.loads[0].error, names, why);
      }
      await noLeasesOrPins(srv, `query-and-load with ${why}`);
    }

    // One target named four times would scatter four leased blocks into one, three of them
    // lost under a state that reads done: refused naming it, the lease left for the corrected
    // Load (tests/engine/load_targets_hunt_test.ts), nothing leaks.
    const l6 = await leaseOf(t, sim, hashes, "fz-l6");
    st.rearm();
    const dup = await t.grpc.call("Load", load(id, l6, [12, 12, 12, 12]));
    assert.equal(dup.code, grpc.status.INVALID_ARGUMENT, dup.details);
    assert.match(dup.details, /target block id 12 is named twice \(targets 0 and 1\)/);
    assert.equal(await st.waitAll(), -1000);
    await loadAndVerify(srv, sim, st, l6, [12, 13, 14, 15], hashes);
    await noLeasesOrPins(srv, "duplicate targets");

    // Calls on a cleaned-up instance; its mappings are gone.
    const l4 = await leaseOf(t, sim, hashes, "fz-l4");
    const needle = shmName(sim).slice(1);
    assert.ok(shmMappings(srv.pid, needle).length > 0, "the region is mapped while registered");
    await srv.client.unregisterContext(id);
    assert.deepEqual(shmMappings(srv.pid, needle), [], "no mapping of the region after unregister");
    await expectAll(
      "Save after unregister",
      "Save",
      save(id),
      new RegExp(`instance "${id}" is not registered`),
    );
    await expectAll(
      "Query after unregister",
      "QueryPrefetch",
      query(id),
      new RegExp(`instance "${id}" is not registered`),
    );
    await expectAll(
      "Load after unregister",
      "Load",
      load(id, l4),
      new RegExp(`instance "${id}" is not registered`),
    );
    await expectAll("Release after unregister", "Release", release(l4), /lease/);
    await expectAll(
      "second UnregisterContext",
      "UnregisterContext",
      UnregisterContextRequest.encode({ instanceId: id }).finish(),
      new RegExp(`instance "${id}" is not registered`),
    );
    await srv.client.unregisterContext(h);
    await afterBatch(srv, t, "cleaned-up instance");
    await noLeasesOrPins(srv, "cleaned-up instance");
    for (const s of [sim, half]) {
      for (const reg of s.regions) {
        const n = text(reg.handle.subarray(0, reg.handle.indexOf(0))).slice(1);
        assert.deepEqual(shmMappings(srv.pid, n), [], `${n} unmapped`);
      }
    }
    assert.deepEqual(shmMappings(srv.pid, st.name.slice(1)), [], "the load state is unmapped");
  } finally {
    st.close();
    t.grpc.close();
    t.local.close();
    sim.close();
    half.close();
    await srv.stop();
    await Deno.remove(dir, { recursive: true }).catch(() => {});
  }
});
