/**
 * What RegisterContext checks before anything is mapped: the client speaks
 * this protocol version, the namespace and instance id follow the name rule,
 * the engine id is not over-long, the topology numbers agree, every array has one
 * entry per layer, every layer's geometry is in bounds and overlap-free,
 * all layers share one segment shape (one block shape per namespace), and
 * layers sharing a region do not overlap each other. Pure: no state, no I/O.
 * Also what a registration is known by: its fingerprint (the holder asking
 * again, or another engine) and the token its rank's Session must present.
 *
 * @module
 */
import { createHash } from "node:crypto";
import { invalid, precondition } from "./errors.ts";
import { footprint, type Geometry, validateGeometry } from "./geometry.ts";
import {
  MAX_BLOCK_ITEMS,
  MAX_LAYER_NAME_CHARS,
  MAX_LAYERS,
  MAX_NAME_CHARS,
  MAX_PARALLEL,
  REGION_HANDLE_BYTES,
} from "../limits.ts";

/**
 * The protocol version RegisterContext requires (client_version must equal it). Bumped when a
 * client of the previous version would be accepted and then fail: "pegaflow-2" is the Session
 * that presents RegisterContext's registration token (a "pegaflow-1" client registered, then
 * had its token-less Session refused; now it is refused at RegisterContext, naming both).
 * The Python client mirrors it (python/pegaflow/client.py `PROTOCOL_VERSION`).
 */
export const PROTOCOL_VERSION = "pegaflow-2";
/**
 * What a namespace or instance id may contain. Both end up in storage keys
 * (`namespace:hash`: ':' is the separator), SSD record headers, Redis keys,
 * log fields and metric labels; this set needs no escaping in any of them and
 * fits hex digests, UUIDs and model names ("llama-3.1-8b.tp2.bf16").
 */
export const NAME_PATTERN = /^[A-Za-z0-9._-]+$/;

/**
 * Throws INVALID_ARGUMENT naming the field unless `value` is 1..128 characters
 * of [A-Za-z0-9._-]; `who` prefixes the message.
 *
 * @example
 * ```ts
 * checkName("namespace", "llama-3.1-8b.tp2", 'instance "a"'); // ok
 * checkName("namespace", "llama:8b", 'instance "a"');         // throws
 * ```
 */
export function checkName(field: string, value: string, who: string): void {
  if (value.length === 0) throw invalid(`${who}: ${field} is empty`);
  if (value.length > MAX_NAME_CHARS) {
    throw invalid(`${who}: ${field} is ${value.length} characters, at most ${MAX_NAME_CHARS}`);
  }
  if (!NAME_PATTERN.test(value)) {
    const bad = [...value].find((ch) => !NAME_PATTERN.test(ch))!;
    throw invalid(
      `${who}: ${field} ${JSON.stringify(value)} contains ${
        JSON.stringify(bad)
      }; allowed: 1..${MAX_NAME_CHARS} characters of [A-Za-z0-9._-]`,
    );
  }
}

/** Registration of one rank (transport-neutral mirror of RegisterContextRequest). */
export interface RegisterArgs {
  instanceId: string;
  namespace: string;
  tpRank: number;
  tpSize: number;
  ppRank: number;
  ppSize: number;
  worldSize: number;
  deviceId: number;
  layerNames: string[];
  regionHandles: Uint8Array[];
  geometry: Geometry[];
  clientVersion: string;
  /**
   * Every TP rank holds the same KV bytes (MLA): blocks are stored once for
   * all TP ranks. Part of the namespace's layout. Default false.
   */
  kvSharedAcrossTp?: boolean;
  /**
   * The engine incarnation the rank belongs to (vLLM's `kv_transfer_config.engine_id`): every
   * rank of an instance sends the same one; a rank with another one is refused while the
   * instance exists (register.ts). Empty or absent: not checked (an older client).
   */
  engineId?: string;
}

/** Longest engine_id accepted (a uuid4 is 36): it is kept per instance and named in refusals. */
export const MAX_ENGINE_ID_CHARS = 256;

/**
 * How a refusal names an engine id: quoted (escaped), or what an empty one means.
 *
 * @example
 * ```ts
 * engineIdText("9b1f-…"); // "\"9b1f-…\""
 * engineIdText("");       // "none (a client that sends no engine_id)"
 * ```
 */
export function engineIdText(id: string): string {
  return id === "" ? "none (a client that sends no engine_id)" : JSON.stringify(id);
}

/**
 * Hex of a region handle's bytes: the Map key under which layers that share
 * one region are grouped (here for the overlap check, in the engine for one
 * import per region).
 *
 * @example
 * ```ts
 * keyHex(new Uint8Array([0x2f, 0x70])); // "2f70"
 * ```
 */
export function keyHex(b: Uint8Array): string {
  let s = "";
  for (let i = 0; i < b.length; i++) s += b[i].toString(16).padStart(2, "0");
  return s;
}

/**
 * The words a refusal of another engine's registration of a held rank
 * carries ("instance "x" tp_rank 0 pp_rank 0 is registered by another
 * engine ..."). Part of the protocol: the Python client
 * (python/pegaflow/registration.py, `HELD_BY_ANOTHER_ENGINE`) tells this
 * FAILED_PRECONDITION, which clears when the holder leaves, from a refusal of
 * the request itself.
 */
export const HELD_BY_ANOTHER_ENGINE = "is registered by another engine";

/** 64 bits: tells one engine's registration from another's (not a defence against forgery). */
const FINGERPRINT_HEX_CHARS = 16;

/**
 * What makes two registrations of one rank the same one: namespace, sizes,
 * device, TP sharing, and every layer's name (in order), region handle and
 * geometry. A hex SHA-256 prefix, computed once per RegisterContext and kept
 * on the rank: a rank asked for again answers ALREADY_EXISTS only when the
 * fingerprints agree (the holder asking again); otherwise the request comes
 * from another engine, whose saves and loads would use the holder's memory.
 * Call after {@link validateRegistration} (handles are then all 64 bytes, so
 * their concatenation is unambiguous).
 *
 * @example
 * ```ts
 * registrationFingerprint(args); // "3f9a0c61d2e4b758"
 * ```
 */
export function registrationFingerprint(a: RegisterArgs): string {
  const h = createHash("sha256");
  const g = a.geometry.map((x) => [
    x.numBlocks,
    x.blockStride,
    x.segStride,
    x.segBytes,
    x.numSegments,
    x.baseOffset,
    x.regionBytes,
  ]);
  h.update(JSON.stringify([
    a.namespace,
    a.tpSize,
    a.ppSize || 1,
    a.worldSize,
    a.deviceId,
    a.kvSharedAcrossTp ?? false,
    a.layerNames,
    g,
  ]));
  for (const handle of a.regionHandles) h.update(handle);
  return h.digest("hex").slice(0, FINGERPRINT_HEX_CHARS);
}

/**
 * Throws INVALID_ARGUMENT / FAILED_PRECONDITION naming the rank and layer
 * unless `a` is a registration the engine can map; returns the rank's label
 * for later messages and the effective PP size (0 means 1).
 *
 * @example
 * ```ts
 * const { who, ppSize } = validateRegistration(args);
 * ```
 */
export function validateRegistration(a: RegisterArgs): { who: string; ppSize: number } {
  // JSON.stringify: an id that breaks the name rule is shown escaped, never raw.
  const who = `instance ${JSON.stringify(a.instanceId)} tp_rank ${a.tpRank} pp_rank ${a.ppRank}`;
  if (a.clientVersion !== PROTOCOL_VERSION) {
    throw precondition(
      `${who}: client version "${a.clientVersion}" does not match the server's "${PROTOCOL_VERSION}"; use a client of the server's protocol version`,
    );
  }
  // Checked on every rank, before anything is stored: no rank of an instance
  // with a bad name gets in (not only the last one, at seal).
  checkName("instance_id", a.instanceId, `tp_rank ${a.tpRank} pp_rank ${a.ppRank}`);
  checkName("namespace", a.namespace, who);
  const ppSize = a.ppSize || 1;
  if (a.tpSize < 1 || a.tpSize > MAX_PARALLEL) {
    throw invalid(`${who}: tp_size ${a.tpSize} out of range 1..${MAX_PARALLEL}`);
  }
  if (ppSize > MAX_PARALLEL) {
    throw invalid(`${who}: pp_size ${ppSize} out of range 1..${MAX_PARALLEL}`);
  }
  if (a.tpRank >= a.tpSize) throw invalid(`${who}: tp_rank ${a.tpRank} >= tp_size ${a.tpSize}`);
  if (a.ppRank >= ppSize) throw invalid(`${who}: pp_rank ${a.ppRank} >= pp_size ${ppSize}`);
  if (a.worldSize !== a.tpSize * ppSize) {
    throw invalid(`${who}: world_size ${a.worldSize} != tp_size ${a.tpSize} * pp_size ${ppSize}`);
  }
  const engineId = a.engineId ?? "";
  if (engineId.length > MAX_ENGINE_ID_CHARS) {
    throw invalid(
      `${who}: engine_id is ${engineId.length} characters, at most ${MAX_ENGINE_ID_CHARS}`,
      {
        instance: a.instanceId,
        tpRank: a.tpRank,
        ppRank: a.ppRank,
        expected: `<= ${MAX_ENGINE_ID_CHARS}`,
        got: engineId.length,
      },
    );
  }
  checkLayers(a, who);
  checkSharedRegions(a, who);
  return { who, ppSize };
}

/** One entry per layer in every array, names unique, handles sized, geometry valid, one block shape. */
function checkLayers(a: RegisterArgs, who: string): void {
  const n = a.layerNames.length;
  if (n === 0) throw invalid(`${who}: layer_names is empty`);
  if (n > MAX_LAYERS) throw invalid(`${who}: ${n} layers, at most ${MAX_LAYERS}`);
  if (a.regionHandles.length !== n || a.geometry.length !== n) {
    throw invalid(
      `${who}: ${n} layer_names but ${a.regionHandles.length} region_handles and ${a.geometry.length} geometry entries`,
    );
  }
  const seen = new Set<string>();
  for (let i = 0; i < n; i++) {
    const name = a.layerNames[i];
    if (!name) throw invalid(`${who}: layer ${i} has an empty name`);
    if (name.length > MAX_LAYER_NAME_CHARS) {
      throw invalid(
        `${who}: layer ${i} name "${
          name.slice(0, 64)
        }…" is ${name.length} characters, at most ${MAX_LAYER_NAME_CHARS}`,
        { expected: `<= ${MAX_LAYER_NAME_CHARS}`, got: name.length },
      );
    }
    if (seen.has(name)) throw invalid(`${who}: layer "${name}" listed twice`);
    seen.add(name);
    if (a.regionHandles[i].length !== REGION_HANDLE_BYTES) {
      throw invalid(
        `${who} layer "${name}": region handle is ${
          a.regionHandles[i].length
        } bytes, expected ${REGION_HANDLE_BYTES}`,
      );
    }
    validateGeometry(a.geometry[i], `${who} layer "${name}"`);
  }
  // Every block of a namespace has one shape in the pool: one segment size and count for all layers.
  for (let i = 1; i < n; i++) {
    if (
      a.geometry[i].segBytes !== a.geometry[0].segBytes ||
      a.geometry[i].numSegments !== a.geometry[0].numSegments
    ) {
      throw invalid(
        `${who}: layer "${a.layerNames[i]}" has ${a.geometry[i].numSegments} x ${
          a.geometry[i].segBytes
        }-byte segments, ` +
          `layer "${a.layerNames[0]}" ${a.geometry[0].numSegments} x ${
            a.geometry[0].segBytes
          }; all layers must agree`,
      );
    }
  }
  // A block holds every (layer, rank slot, segment) of the namespace: past the limit no block
  // could ever be stored, so the first rank is refused, not the last one at seal.
  const slots = a.kvSharedAcrossTp ? 1 : a.tpSize;
  const items = n * slots * a.geometry[0].numSegments;
  if (items > MAX_BLOCK_ITEMS) {
    throw invalid(
      `${who}: ${n} layers x ${slots} TP rank slots x ${
        a.geometry[0].numSegments
      } segments = ${items} items per block, at most ${MAX_BLOCK_ITEMS}`,
      {
        instance: a.instanceId,
        tpRank: a.tpRank,
        ppRank: a.ppRank,
        expected: `<= ${MAX_BLOCK_ITEMS}`,
        got: items,
      },
    );
  }
}

/** Layers sharing one region must not overlap each other and must agree on its size. */
function checkSharedRegions(a: RegisterArgs, who: string): void {
  const n = a.layerNames.length;
  const byHandle = new Map<string, number[]>();
  for (let i = 0; i < n; i++) {
    const k = keyHex(a.regionHandles[i]);
    const list = byHandle.get(k) ?? [];
    list.push(i);
    byHandle.set(k, list);
  }
  for (const idx of byHandle.values()) {
    const spans = idx.map((i) => [...footprint(a.geometry[i]), i] as const).sort((x, y) =>
      x[0] - y[0]
    );
    for (let j = 1; j < spans.length; j++) {
      if (spans[j][0] < spans[j - 1][1]) {
        throw invalid(
          `${who}: layers "${a.layerNames[spans[j - 1][2]]}" and "${
            a.layerNames[spans[j][2]]
          }" overlap in one region`,
        );
      }
    }
    const bytes = new Set(idx.map((i) => a.geometry[i].regionBytes));
    if (bytes.size > 1) {
      throw invalid(`${who}: layers sharing one region declare different region_bytes`);
    }
  }
}

/** Bytes of a registration token (32 hex characters: another engine cannot guess it). */
const REGISTRATION_TOKEN_BYTES = 16;

/**
 * A fresh registration token. The server issues one per registration of a rank
 * (RegisterContextResponse.registration_token) and the rank's Session presents
 * it (SessionRequest.registration_token): only a session of the rank's current
 * registration may supersede the rank's session, whose end cleans the instance up.
 *
 * @example
 * ```ts
 * newRegistrationToken(); // "9b1f0c3e5a7d2468ace0b1d3f5a7c9e1"
 * ```
 */
export function newRegistrationToken(): string {
  return keyHex(crypto.getRandomValues(new Uint8Array(REGISTRATION_TOKEN_BYTES)));
}

/**
 * The response header a Session's stream carries when the server takes it (sent at once,
 * before any event; lib/server/grpc_service.ts): a client tells a session that stood for its
 * registration (its end ends the registration) from one refused or that never reached the
 * server. grpcio shows an empty header block and none alike, so the Python client
 * (python/pegaflow/client.py `SESSION_TAKEN_HEADER`) looks for this one.
 */
export const SESSION_TAKEN_HEADER = "pegaflow-session-taken";

/** Why a session cannot stand for its rank ({@link sessionMismatch}). */
export type SessionMismatch = "no_token" | "other_token" | "not_registered";

/**
 * Whether a session presenting `token` ("" for none) may stand for a rank whose
 * registration holds token `held` (undefined: the rank is not registered). A
 * registered rank takes only its registration's token; a token for a rank not
 * registered (its registration ended, the server restarted) stands for nothing;
 * no token, only a rank not registered yet (such a session stands for no
 * registration: the rank's registration ends it, {@link unadoptedSessionText}).
 *
 * @example
 * ```ts
 * sessionMismatch("ab12", "ab12");   // undefined: it may
 * sessionMismatch("ab12", "");       // "no_token"
 * sessionMismatch(undefined, "ab12"); // "not_registered"
 * ```
 */
export function sessionMismatch(
  held: string | undefined,
  token: string,
): SessionMismatch | undefined {
  if (held === undefined) return token === "" ? undefined : "not_registered";
  if (token !== held) return token === "" ? "no_token" : "other_token";
  return undefined;
}

const MISMATCH_TEXT: Record<SessionMismatch, string> = {
  no_token: "is registered, and this session carries no registration token; a session " +
    "stands for the registration whose token RegisterContext answered (another engine's " +
    "session would take the rank from its holder): open it after RegisterContext, with that token",
  other_token: "is registered by another registration (this session's registration token is " +
    "not the rank's: another engine under this instance id holds the rank, or this token's " +
    "registration ended); register again, then open the session with the token it answers",
  not_registered: "is not registered (the registration this token came from ended, or the " +
    "server restarted); register the rank again and open the session with the token it answers",
};

/**
 * What a session opened with no token before its rank registered is told when the
 * registration ends it (lib/server/sessions.ts `registered`): it stands for no registration,
 * and adopting it would let whichever process opened a session first hold the rank's
 * registration (its end cleaning the engine up). `who` names it as in {@link sessionMismatchText}.
 *
 * @example
 * ```ts
 * unadoptedSessionText('Session: instance "x" tp_rank 0 pp_rank 0');
 * ```
 */
export function unadoptedSessionText(who: string): string {
  return `${who} was registered after this session opened; a session stands for a ` +
    "registration only with the token RegisterContext answered, and this one carries none: " +
    "open the session after RegisterContext, with that token";
}

/**
 * What a session that cannot stand for its rank is told; `who` names it
 * (`Session: instance "x" tp_rank 0 pp_rank 0`).
 *
 * @example
 * ```ts
 * sessionMismatchText('Session: instance "x" tp_rank 0 pp_rank 0', "no_token");
 * ```
 */
export function sessionMismatchText(who: string, why: SessionMismatch): string {
  return `${who} ${MISMATCH_TEXT[why]}`;
}
