/**
 * The index's Lua scripts: each index call is ONE script call (one round trip,
 * atomic; `EVAL` for the calls that change the index, lib/index/connection.ts
 * says why), however many blocks it names. KEYS[1] is always the namespace's
 * registry `pf:{ns}:nodes` (lib/index/keys.ts), so Redis Cluster routes the
 * call to that namespace's slot. The lookup script also reads the per-node
 * block sets it finds in the registry; their names carry the same `{ns}`
 * hash tag, so they are in the same slot — the pattern job queues such as
 * BullMQ rely on in Cluster (docs/index.md says what that assumes).
 *
 * Hashes arrive packed in one argument (`count × hashBytes`) and are split
 * here. Liveness is judged by Redis's own `TIME`, never a client clock.
 *
 * A registry field `"<inc> <deadline> <addr>"` is live while `deadline` (ms)
 * is in the future.
 *
 * @module
 */

import type { Buffer } from "node:buffer";
import { tagNodeSetKey, tagNodesKey } from "./keys.ts";

/** Hashes per SADD/SREM/SMISMEMBER call: far below Lua's C stack limit for unpack (8000). */
const UNPACK_CHUNK = 1024;
/** Registry TTL in node TTLs: a namespace whose nodes are all gone disappears. */
export const REGISTRY_TTLS = 2;
/**
 * Lookup reads each live node's membership in chunks that start small (a
 * node without the first blocks costs one short call) and double.
 */
const FIRST_LOOKUP_CHUNK = 16;
const MAX_LOOKUP_CHUNK = 512;

/**
 * `now` in ms, `parse(field)` → inc, addr of a live node field, `split(blob, n)` → hashes,
 * `extend(key, ms)` → the key's TTL raised to `ms`, never lowered (the registry is shared:
 * a node run with a shorter TTL must not shorten it under the others' registrations).
 * Globals are read once into locals: a global read in a Redis script goes through the
 * sandbox's metatable, which is measurable over 625 iterations.
 */
const PRELUDE = `
if redis.replicate_commands then redis.replicate_commands() end
local call, sub, unpack = redis.call, string.sub, unpack
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function parse(v)
  if not v then return nil end
  local inc, dl, addr = string.match(v, '^(%S+) (%d+) (.*)$')
  if not inc or tonumber(dl) <= now then return nil end
  return inc, addr
end
local function split(blob, size)
  local out, n = {}, 0
  for i = 1, #blob, size do n = n + 1; out[n] = sub(blob, i, i + size - 1) end
  return out
end
local function extend(key, ms)
  if call('PTTL', key) < ms then call('PEXPIRE', key, ms) end
end
local function each_chunk(hs, f)
  for i = 1, #hs, ${UNPACK_CHUNK} do f(unpack(hs, i, math.min(i + ${UNPACK_CHUNK - 1}, #hs))) end
end
`;

/**
 * advertise: KEYS = registry, own set. ARGV = node, inc, addr, nodeTtlMs,
 * join, hashBytes, packed hashes. Without `join`, the node's own registry
 * field must be live with `inc` — otherwise Redis lost or expired it and
 * nothing is written (returns 0: the node re-joins under a new incarnation
 * and re-advertises all it holds; or, when the field is live with another
 * incarnation — another live process under this node id — that process's
 * address). A `join` takes the field unless it is live with another
 * incarnation AND another address: that is another live process, which
 * keeps the id (nothing is written; returns its address). A live field with
 * this address is this node's own previous life (a restart, an older
 * incarnation of this process): the join voids it. Returns 1.
 */
export const ADVERTISE_LUA = PRELUDE + `
local node, inc, addr, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local cur, curaddr = parse(call('HGET', KEYS[1], node))
if ARGV[5] ~= '1' then
  if cur ~= inc then return cur and curaddr or 0 end
elseif cur and cur ~= inc and curaddr ~= addr then
  return curaddr
end
call('HSET', KEYS[1], node, inc .. ' ' .. (now + ttl) .. ' ' .. addr)
extend(KEYS[1], ttl * ${REGISTRY_TTLS})
each_chunk(split(ARGV[7], tonumber(ARGV[6])), function(...) call('SADD', KEYS[2], ...) end)
call('PEXPIRE', KEYS[2], ttl)
return 1
`;

/**
 * What {@link ADVERTISE_LUA} takes after the script, in its order: numkeys, KEYS, ARGV. `join`:
 * (re-)register `inc` instead of checking it (refused while another live process, at another
 * address, holds the node id there); no hashes (`count` 0) with `join` registers the
 * incarnation with an empty set, which voids the node's older entries in that namespace.
 */
export function advertiseArgs(
  tag: string,
  who: { node: string; inc: string; addr: string; ttlMs: number; join: boolean },
  p: { hashBytes: number; blob: Buffer },
): (string | number | Buffer)[] {
  const { node, inc, addr, ttlMs, join } = who;
  const keys = [tagNodesKey(tag), tagNodeSetKey(tag, node, inc)];
  return [keys.length, ...keys, node, inc, addr, ttlMs, join ? "1" : "0", p.hashBytes, p.blob];
}

/** withdraw: KEYS = registry, own set. ARGV = hashBytes, packed hashes. Returns how many were held. */
export const WITHDRAW_LUA = PRELUDE + `
local n = 0
each_chunk(split(ARGV[2], tonumber(ARGV[1])), function(...) n = n + call('SREM', KEYS[2], ...) end)
return n
`;

/**
 * heartbeat: KEYS = registry, own set. ARGV = node, inc, addr, nodeTtlMs.
 * Extends the node's deadline and its set's TTL if its field is live with
 * `inc` (returns 1); otherwise writes nothing and returns 0 (lost), or the
 * address of the live field of another incarnation (another live process
 * under this node id). Drops expired registry fields on the way.
 */
export const HEARTBEAT_LUA = PRELUDE + `
local node, inc, ttl = ARGV[1], ARGV[2], tonumber(ARGV[4])
local raw = call('HGETALL', KEYS[1])
local mine, other = 0, nil
for i = 1, #raw, 2 do
  local finc, faddr = parse(raw[i + 1])
  if not finc then call('HDEL', KEYS[1], raw[i])
  elseif raw[i] == node then
    if finc == inc then mine = 1 else other = faddr end
  end
end
if mine == 0 then return other or 0 end
call('HSET', KEYS[1], node, inc .. ' ' .. (now + ttl) .. ' ' .. ARGV[3])
extend(KEYS[1], ttl * ${REGISTRY_TTLS})
call('PEXPIRE', KEYS[2], ttl)
return 1
`;

/**
 * lookup: KEYS = registry. ARGV = asking node (left out), set key prefix,
 * hashBytes, packed hashes. Walks the hashes in order and stops at the
 * first block no live node holds; every block of the prefix is checked
 * (chained hashes make a gap unlikely, not impossible: eviction is per
 * block). For each owner it counts the blocks it holds without a gap from
 * the first one. A node that holds none of a chunk is not asked about later
 * chunks (the answer may then be shorter than possible, never longer).
 * Returns `{prefix, node1, addr1, run1, node2, addr2, run2, ...}`.
 */
export const LOOKUP_LUA = PRELUDE + `
local self, prefix_key = ARGV[1], ARGV[2]
local hs = split(ARGV[4], tonumber(ARGV[3]))
local raw = call('HGETALL', KEYS[1])
local all, active = {}, {}
for i = 1, #raw, 2 do
  local inc, addr = parse(raw[i + 1])
  if inc and raw[i] ~= self then
    local nd = { name = raw[i], key = prefix_key .. raw[i] .. ':' .. inc, addr = addr, run = 0 }
    all[#all + 1] = nd
    active[#active + 1] = nd
  end
end
local prefix, pos, chunk = 0, 1, ${FIRST_LOOKUP_CHUNK}
while pos <= #hs and #active > 0 do
  local last = math.min(#hs, pos + chunk - 1)
  local covered, still = {}, {}
  for _, nd in ipairs(active) do
    local r = call('SMISMEMBER', nd.key, unpack(hs, pos, last))
    local hit = false
    for j = 1, #r do
      if r[j] == 1 then
        hit = true
        covered[j] = true
        if nd.run == pos + j - 2 then nd.run = pos + j - 1 end
      end
    end
    if hit then still[#still + 1] = nd end
  end
  local j = 1
  while j <= last - pos + 1 and covered[j] do j = j + 1 end
  prefix = pos + j - 2
  if j <= last - pos + 1 then break end
  active, pos, chunk = still, last + 1, math.min(chunk * 2, ${MAX_LOOKUP_CHUNK})
end
local out = { prefix }
for _, nd in ipairs(all) do
  if nd.run > 0 then
    out[#out + 1] = nd.name
    out[#out + 1] = nd.addr
    out[#out + 1] = nd.run
  end
end
return out
`;
