/**
 * Request decoding that blames the client. grpc-js answers INTERNAL ("Error
 * deserializing request") when a service's deserializer throws, which tells
 * an engine the server is broken when the bytes it sent are. So the service
 * definition's deserializers never throw: a request that does not decode
 * becomes an {@link Undecodable} marker, and the handler answers
 * INVALID_ARGUMENT with the reason (see grpc_service.ts).
 *
 * u64 fields: ts-proto (forceLong default) decodes them to JS numbers and
 * throws "Value is larger than Number.MAX_SAFE_INTEGER" without naming the
 * field. Only on that failure path, the request is decoded again through a
 * reader that turns every u64 above 2^53 - 1 into NaN (ts-proto's
 * longToNumber lets NaN through); the NaN is then found in the decoded
 * message, whose path names the field (`geometry[1].block_stride`). The fast
 * path is the plain generated decode, untouched.
 *
 * @module
 */
import type { Buffer } from "node:buffer";
import { BinaryReader } from "@bufbuild/protobuf/wire";
import type * as grpc from "@grpc/grpc-js";
import {
  ConnectTransferRequest,
  EngineService,
  HealthRequest,
  LoadRequest,
  type MessageFns,
  PeerService,
  QueryBlocksForTransferRequest,
  QueryPrefetchRequest,
  RegisterContextRequest,
  ReleaseRequest,
  ReleaseTransferLockRequest,
  SaveRequest,
  SessionRequest,
  UnregisterContextRequest,
  WaitPrefetchRequest,
} from "../../proto/pegaflow.ts";

const UNDECODABLE = Symbol("undecodable request");

/** What a deserializer hands the handler for bytes that are not the request message. */
export interface Undecodable {
  readonly [UNDECODABLE]: string;
}

/** The reason a request did not decode, or undefined for a decoded request. */
export function undecodableReason(req: unknown): string | undefined {
  return typeof req === "object" && req !== null && UNDECODABLE in req
    ? (req as Undecodable)[UNDECODABLE]
    : undefined;
}

type Method = keyof typeof EngineService;

/** Each RPC's request message (a missing RPC is a compile error). */
const REQUEST_TYPES: { [M in Method]: { name: string; fns: MessageFns<unknown> } } = {
  registerContext: { name: "RegisterContextRequest", fns: RegisterContextRequest },
  save: { name: "SaveRequest", fns: SaveRequest },
  queryPrefetch: { name: "QueryPrefetchRequest", fns: QueryPrefetchRequest },
  waitPrefetch: { name: "WaitPrefetchRequest", fns: WaitPrefetchRequest },
  load: { name: "LoadRequest", fns: LoadRequest },
  release: { name: "ReleaseRequest", fns: ReleaseRequest },
  unregisterContext: { name: "UnregisterContextRequest", fns: UnregisterContextRequest },
  session: { name: "SessionRequest", fns: SessionRequest },
  health: { name: "HealthRequest", fns: HealthRequest },
};

const MAX_SAFE = BigInt(Number.MAX_SAFE_INTEGER);

/** A reader whose u64 above 2^53 - 1 reads as "NaN" (a value no integer field decodes to). */
class MarkingReader extends BinaryReader {
  override uint64(): bigint | string {
    const v = super.uint64();
    return BigInt(v) > MAX_SAFE ? "NaN" : v;
  }
}

/** ts-proto's camelCase property back to the .proto field name. */
function protoName(prop: string): string {
  return prop.replace(/[A-Z]/g, (c) => "_" + c.toLowerCase());
}

/** Path of the first NaN in a decoded message (depth-first), or undefined. */
function findNaN(v: unknown, path: string): string | undefined {
  if (typeof v === "number") return Number.isNaN(v) ? path : undefined;
  if (Array.isArray(v)) {
    for (let i = 0; i < v.length; i++) {
      const p = findNaN(v[i], `${path}[${i}]`);
      if (p) return p;
    }
    return undefined;
  }
  if (typeof v === "object" && v !== null && !(v instanceof Uint8Array)) {
    for (const [k, x] of Object.entries(v)) {
      const p = findNaN(x, path ? `${path}.${protoName(k)}` : protoName(k));
      if (p) return p;
    }
  }
  return undefined;
}

/** Why `bytes` are not a `name`, as precisely as the bytes allow. */
function explain(name: string, fns: MessageFns<unknown>, bytes: Uint8Array, err: unknown): string {
  try {
    const field = findNaN(fns.decode(new MarkingReader(bytes)), "");
    if (field) {
      return `${name}.${field} is above 2^53 - 1 (${Number.MAX_SAFE_INTEGER}), the largest u64 this server accepts`;
    }
  } catch (_e) {
    // Not a u64 problem: the original decode error says what is wrong.
  }
  return `request is not a valid pegaflow.${name} (${bytes.length} bytes): ${
    (err as Error)?.message ?? String(err)
  }`;
}

function decodeAs(name: string, fns: MessageFns<unknown>, bytes: Uint8Array): unknown {
  try {
    return fns.decode(bytes);
  } catch (e) {
    return { [UNDECODABLE]: explain(name, fns, bytes, e) } satisfies Undecodable;
  }
}

/** `def` with deserializers that never throw (see the module comment). */
function lenient<M extends string>(
  def: Record<M, unknown>,
  types: { [K in M]: { name: string; fns: MessageFns<unknown> } },
): grpc.ServiceDefinition {
  const out: Record<string, grpc.MethodDefinition<unknown, unknown>> = {};
  for (const m of Object.keys(def) as M[]) {
    const d = def[m] as grpc.MethodDefinition<unknown, unknown>;
    const { name, fns } = types[m];
    out[m] = { ...d, requestDeserialize: (b: Buffer) => decodeAs(name, fns, b) };
  }
  return out;
}

/**
 * The generated service definition with deserializers that never throw (see
 * the module comment); pass it to `server.addService`.
 */
export function lenientService(): grpc.ServiceDefinition {
  return lenient(EngineService, REQUEST_TYPES);
}

/** The `Peer` service's request messages. */
const PEER_REQUEST_TYPES: {
  [M in keyof typeof PeerService]: { name: string; fns: MessageFns<unknown> };
} = {
  queryBlocksForTransfer: {
    name: "QueryBlocksForTransferRequest",
    fns: QueryBlocksForTransferRequest,
  },
  releaseTransferLock: { name: "ReleaseTransferLockRequest", fns: ReleaseTransferLockRequest },
  connectTransfer: { name: "ConnectTransferRequest", fns: ConnectTransferRequest },
};

/** The `Peer` service definition, lenient like {@link lenientService}. */
export function lenientPeerService(): grpc.ServiceDefinition {
  return lenient(PeerService, PEER_REQUEST_TYPES);
}
