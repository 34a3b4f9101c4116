/**
 * Pool placement over NUMA nodes (policy; the library binds pages and reads
 * sysfs). On a host with several nodes, a GPU copies fastest to and from host
 * memory on its own node: crossing the inter-socket link costs bandwidth and
 * latency on every byte. So the one pinned pool is cut into one part per node
 * that a served device sits on, each part's pages bound to that node where
 * they are pre-touched (`pf_pool_create_split`), and a device's saves
 * allocate in its own node's part (the store's allocator prefers it and
 * spills over to another part only when its own is full). A load reads a
 * block wherever it was saved: a block saved by a device on node 0 and loaded
 * by one on node 1 crosses the link once, as it would without the split.
 *
 * @module
 */
import type { PoolPart } from "../ffi/mod.ts";

/**
 * Parts are cut at multiples of this: a multiple of every page size a pool is
 * mapped with here (4 KiB, 2 MiB huge pages) and of the allocator's unit.
 */
export const PART_ALIGN_BYTES = 2 << 20;

/** The NUMA nodes this host has online (`/sys/devices/system/node/online`); [0] when unknown. */
export function onlineNodes(
  read: () => string = () => Deno.readTextFileSync("/sys/devices/system/node/online"),
): number[] {
  let text: string;
  try {
    text = read().trim();
  } catch {
    return [0]; // no sysfs (a container without it): treat as one node
  }
  return parseNodeList(text);
}

/** Parses a kernel node list ("0", "0-3", "0,2-3"). */
export function parseNodeList(text: string): number[] {
  const out = new Set<number>();
  for (const item of text.split(",")) {
    const m = /^(\d+)(?:-(\d+))?$/.exec(item.trim());
    if (!m) throw new Error(`"${text}" is not a NUMA node list (e.g. 0-1,3)`);
    const lo = Number(m[1]);
    const hi = m[2] === undefined ? lo : Number(m[2]);
    for (let n = lo; n <= hi; n++) out.add(n);
  }
  return [...out].sort((a, b) => a - b);
}

/** How the pool is split: parts in pool order and the part each device saves into. */
export interface PoolPlacement {
  /** What `pf_pool_create_split` gets: bytes and the node to bind (-1: unbound). */
  readonly parts: PoolPart[];
  /** The node each part was planned for (also where unbound: a test's fake node). */
  readonly partNodes: number[];
  /** Served device → index of the part on its node. */
  readonly partOfDevice: ReadonlyMap<number, number>;
}

/**
 * Plans the split of a `poolBytes` pool for `devices` whose nodes are
 * `nodeOf` (-1 or absent: unknown). Undefined (one unsplit pool) when the
 * devices sit on fewer than two known nodes or a part would be smaller than
 * {@link PART_ALIGN_BYTES}. Parts are equal (the last takes the rest); a
 * part's pages are bound only when its node is in `online`.
 *
 * @example
 * ```ts
 * const p = planPlacement(64 << 30, [0, 1, 2, 3], new Map([[0, 0], [1, 0], [2, 1], [3, 1]]), [0, 1]);
 * // p.parts = [{bytes: 32 GiB, node: 0}, {bytes: 32 GiB, node: 1}]; p.partOfDevice.get(2) === 1
 * ```
 */
export function planPlacement(
  poolBytes: number,
  devices: readonly number[],
  nodeOf: ReadonlyMap<number, number>,
  online: readonly number[],
): PoolPlacement | undefined {
  const nodes = [...new Set(devices.map((d) => nodeOf.get(d) ?? -1).filter((n) => n >= 0))]
    .sort((a, b) => a - b);
  if (nodes.length < 2) return undefined;
  const each = Math.floor(poolBytes / nodes.length / PART_ALIGN_BYTES) * PART_ALIGN_BYTES;
  if (each === 0) return undefined;
  const parts = nodes.map((node, i) => ({
    bytes: i === nodes.length - 1 ? poolBytes - each * (nodes.length - 1) : each,
    node: online.includes(node) ? node : -1,
  }));
  const partOfDevice = new Map<number, number>();
  for (const d of devices) {
    const i = nodes.indexOf(nodeOf.get(d) ?? -1);
    if (i >= 0) partOfDevice.set(d, i);
  }
  return { parts, partNodes: nodes, partOfDevice };
}
