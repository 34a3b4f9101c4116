/**
 * The block index's Redis key schema and argument packing. Every key of one
 * namespace carries the hash tag `{ns}` (or a digest of the namespace when it
 * cannot stand in a key as it is: {@link namespaceTag}), so on Redis Cluster
 * they all live in one slot and each Lua script stays inside one slot (a
 * script may not span slots).
 *
 * ```
 * pf:{<ns>}:nodes               HASH  node id → "<incarnation> <deadline ms> <advertise addr>"
 * pf:{<ns>}:n:<node id>:<inc>   SET   hash bytes of the blocks the node holds   (PEXPIRE: node TTL)
 * pf:{@<node id>}:namespaces    SET   tags of the namespaces the node joined    (lib/index/rejoin.ts)
 * ```
 *
 * Liveness and ownership expire together: the heartbeat extends the node's
 * deadline and its set's TTL, one field and one key per (node, namespace),
 * however many blocks the set holds. A dead node's whole set is dropped by
 * Redis's own expiry, and a node that re-joins under a new incarnation gets
 * a new, empty set (its old one expires unheard). docs/index.md weighs this
 * against a TTL per block.
 *
 * Hashes travel as ONE packed argument (`count × hashBytes` bytes), not one
 * argument per block: an argument costs the client ~2 µs to encode, so 625
 * separate keys cost ~1 ms before Redis sees them.
 *
 * @module
 */

import { Buffer } from "node:buffer";
import { createHash } from "node:crypto";
import { IndexInputError } from "./errors.ts";
import { MAX_HASH_BYTES, MAX_NAME_CHARS } from "../limits.ts";

/** Longest node id or advertise address (a hostname plus a port fits easily). */
export const MAX_NODE_CHARS = 255;

/** Root of every key the index writes: `SCAN 0 MATCH pf:*` finds them all. */
const KEY_ROOT = "pf:";
/**
 * Namespace characters used in keys as they are: a `{` or `}` would move the
 * hash tag, whitespace or a control character makes keys unreadable in redis-cli.
 */
const NAMESPACE_RE = /^[A-Za-z0-9._:\-]+$/;
/** Node ids and addresses are stored space-separated in one field value. */
const NODE_RE = /^[\x21-\x7e]+$/;

/** Throws {@link IndexInputError} unless `ns` is a non-empty string (the store accepts any other). */
export function checkNamespace(ns: string): void {
  if (typeof ns !== "string" || ns.length === 0) {
    throw new IndexInputError("namespace must be a non-empty string", { got: String(ns) });
  }
}

/** Hex chars of SHA-256 kept for a namespace that cannot stand in a key as it is (128 bits). */
const NAMESPACE_DIGEST_CHARS = 32;
/** Namespaces seen; few per process (one per model layout), bounded anyway. */
const TAG_CACHE_MAX = 1024;
const tagCache = new Map<string, string>();

/**
 * The text inside the hash tag for a namespace: the namespace itself when it
 * is short and made of `A-Z a-z 0-9 . _ : -` (the store's own namespaces are
 * 16 hex chars), else `~` and 128 bits of its SHA-256 — the same on every
 * node, and `~` keeps the two forms apart. An engine may name its namespace
 * anything (`meta-llama/Llama-3.1-8B tp=2`), and a `{` or `}` in it would
 * move the hash tag.
 */
export function namespaceTag(ns: string): string {
  checkNamespace(ns);
  let tag = tagCache.get(ns);
  if (tag !== undefined) return tag;
  // A namespace registration accepts is used in keys as it is; a longer one is digested.
  tag = ns.length <= MAX_NAME_CHARS && NAMESPACE_RE.test(ns)
    ? ns
    : "~" + createHash("sha256").update(ns).digest("hex").slice(0, NAMESPACE_DIGEST_CHARS);
  if (tagCache.size >= TAG_CACHE_MAX) tagCache.clear();
  tagCache.set(ns, tag);
  return tag;
}

/** Throws {@link IndexInputError} unless `value` is a printable token (node id, address). */
export function checkNodeToken(what: string, value: string): void {
  if (
    typeof value !== "string" || value.length === 0 || value.length > MAX_NODE_CHARS ||
    !NODE_RE.test(value)
  ) {
    throw new IndexInputError(
      `${what} must be 1..${MAX_NODE_CHARS} printable characters without spaces, got "${value}"`,
      { got: String(value) },
    );
  }
}

/** `pf:{ns}:nodes`: the namespace's node registry (liveness and addresses). */
export function nodesKey(ns: string): string {
  return tagNodesKey(namespaceTag(ns));
}

/** {@link nodesKey} of the namespace whose {@link namespaceTag} is `tag`. */
export function tagNodesKey(tag: string): string {
  return `${KEY_ROOT}{${tag}}:nodes`;
}

/** `pf:{ns}:n:`: prefix of the per-node block sets; the lookup script appends `<node>:<inc>`. */
export function nodeSetPrefix(ns: string): string {
  return tagSetPrefix(namespaceTag(ns));
}

function tagSetPrefix(tag: string): string {
  return `${KEY_ROOT}{${tag}}:n:`;
}

/** `pf:{ns}:n:<node>:<inc>`: the set of blocks `node` holds under incarnation `inc`. */
export function nodeSetKey(ns: string, node: string, inc: string): string {
  return tagNodeSetKey(namespaceTag(ns), node, inc);
}

/** {@link nodeSetKey} of the namespace whose {@link namespaceTag} is `tag`. */
export function tagNodeSetKey(tag: string, node: string, inc: string): string {
  return `${tagSetPrefix(tag)}${node}:${inc}`;
}

/**
 * `pf:{@<node>}:namespaces`: the tags of the namespaces `node` joined, read by its next process
 * (lib/index/rejoin.ts). Its own hash tag, so its own slot on Cluster: `@` starts no namespace
 * tag, and a `}` in a node id only shortens the tag (a shared slot, never a shared key).
 */
export function nodeNamespacesKey(node: string): string {
  return `${KEY_ROOT}{@${node}}:namespaces`;
}

/** Hashes of one call packed back to back; every hash of a call has the same length. */
export interface PackedHashes {
  blob: Buffer;
  hashBytes: number;
  count: number;
}

/**
 * Validates the namespace and the hashes and packs them into one buffer (one
 * allocation per call). Throws {@link IndexInputError} naming the hash's
 * position and length.
 *
 * @example
 * ```ts
 * const p = packHashes("ab12", [new Uint8Array(32), new Uint8Array(32)]);
 * // p.blob.length === 64, p.hashBytes === 32, p.count === 2
 * ```
 */
export function packHashes(ns: string, hashes: readonly Uint8Array[]): PackedHashes {
  checkNamespace(ns);
  const hashBytes = hashes.length > 0 ? hashes[0]?.length ?? 0 : 0;
  for (let i = 0; i < hashes.length; i++) {
    const h = hashes[i];
    if (!(h instanceof Uint8Array)) {
      throw new IndexInputError(`hash ${i} must be a Uint8Array`, {
        namespace: ns,
        index: i,
        got: typeof h,
      });
    }
    if (h.length === 0 || h.length > MAX_HASH_BYTES) {
      throw new IndexInputError(
        `hash ${i} has ${h.length} bytes; a block hash has 1..${MAX_HASH_BYTES}`,
        { namespace: ns, index: i, expected: `1..${MAX_HASH_BYTES}`, got: h.length },
      );
    }
    if (h.length !== hashBytes) {
      throw new IndexInputError(
        `hash ${i} has ${h.length} bytes but hash 0 has ${hashBytes}: one call takes hashes of one length`,
        { namespace: ns, index: i, expected: hashBytes, got: h.length },
      );
    }
  }
  const blob = Buffer.allocUnsafe(hashes.length * hashBytes);
  for (let i = 0; i < hashes.length; i++) blob.set(hashes[i], i * hashBytes);
  return { blob, hashBytes, count: hashes.length };
}

/**
 * Hex text → bytes (the store reports hashes as hex). Throws
 * {@link IndexInputError} on odd length or a non-hex character.
 */
export function hexBytes(hex: string): Uint8Array {
  if (hex.length % 2 !== 0 || !/^[0-9a-fA-F]*$/.test(hex)) {
    throw new IndexInputError(`"${hex}" is not a hex block hash`, { got: hex });
  }
  return Buffer.from(hex, "hex");
}
