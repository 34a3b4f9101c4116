/**
 * The READ of a locked prefix (docs/peer.md): the prefix is read in chunks,
 * each planned into pool space here (whole blocks, prefix order, the
 * "reclaimable" class) and submitted as ONE transfer batch while the earlier
 * ones are on the wire; each block is one checksum group, so the transport
 * hands back its CRC32C computed as the bytes landed, and a block is
 * committed only when that matches the owner's. Each chunk's space is freed
 * only after its completion record (the original system's #403).
 *
 * @module
 */
import type { RamFillBatch, TierHost } from "../storage/tier.ts";
import { hashHex } from "../storage/keys.ts";
import type { BlockRanges } from "../transfer/ranges.ts";
import { XferBatch, type XferPeer, type XferResult } from "../../ffi/xfer.ts";
import type { Logger } from "../log.ts";

/** Most READ batches one fetch puts in flight (a peer takes 256). */
const MAX_PIPELINE_CHUNKS = 64;

/**
 * Adds READ segments pairing remote block `rk`'s ranges with local block
 * `lk`'s, both in payload order and covering the same bytes.
 */
function pairRanges(
  batch: XferBatch,
  remote: BlockRanges,
  rk: number,
  local: BlockRanges,
  lk: number,
) {
  const r = remote.ranges, l = local.ranges;
  let i = 2 * remote.starts[rk], j = 2 * local.starts[lk], ri = 0, lj = 0;
  const iEnd = 2 * remote.starts[rk + 1], jEnd = 2 * local.starts[lk + 1];
  while (i < iEnd && j < jEnd) {
    const rb = r[i + 1], lb = l[j + 1];
    const n = Math.min(rb - ri, lb - lj);
    batch.seg(r[i] + ri, l[j] + lj, n);
    ri += n;
    lj += n;
    if (ri === rb) (i += 2, ri = 0);
    if (lj === lb) (j += 2, lj = 0);
  }
}

/** A prefix locked on its owner, as its lock answer describes it. */
export interface LockedPrefix {
  namespace: string;
  /** The owner's node id (logs). */
  owner: string;
  hashes: readonly Uint8Array[];
  /** Each block's pool ranges on the owner ({@link remoteExtents}). */
  remote: BlockRanges;
  payloadBytes: number;
  /** Each block's CRC32C, computed by the owner at seal time. */
  checksums: readonly number[];
}

/** How the READ went. */
export interface ReadOutcome {
  /** READ batches submitted (0: nothing could be planned or submitted). */
  chunks: number;
  /** Blocks that got pool space. */
  planned: number;
  /** Committed blocks (their checksums were recorded with the commit). */
  good: Uint8Array[];
  /** Blocks that landed with another CRC32C than the owner's (freed). */
  bad: number;
  /** Those blocks' indices in the prefix (the release reports them to the owner); one part's only. */
  badBlocks: number[];
  /** The first batch that failed (its blocks freed). */
  failed?: XferResult;
  /** Why planning or submitting stopped early, if it did. */
  refused?: string;
  /** True when nothing was read because the owner's lock would end before the READ could. */
  expired?: boolean;
  /** Bytes that landed, and ms from the first submit until the last batch's end. */
  readBytes: number;
  readEnd: number;
  tSubmit: number;
  tPlanned: number;
}

/** Nothing read (fresh arrays: a caller may keep them). */
const none = () => ({ chunks: 0, good: [], bad: 0, badBlocks: [], readBytes: 0, readEnd: 0 });

/** How {@link readLockedPrefix} plans and reports. */
export interface ReadOptions {
  /** The fills' filler name (the tier's). */
  filler: string;
  chunkBytes: number;
  /**
   * Deadline of each READ batch: the fetch's, cut to what is left of the owner's lock (a READ
   * past it could read ranges the owner reused). Below 1 ms nothing is read.
   */
  deadlineMs: number;
  log: Logger;
  dropPeer: () => void;
}

/** One READ batch in flight and the pool space it lands in. */
interface Chunk {
  /** Pool space of this chunk's blocks: one plan, settled once. */
  fill: RamFillBatch;
  /** Index in the prefix of the chunk's first block. */
  from: number;
  done: Promise<XferResult>;
  submittedAt: number;
}

/** What settling the chunks brought: the verified blocks and the wire's numbers. */
type Settled = Pick<
  ReadOutcome,
  "good" | "bad" | "badBlocks" | "failed" | "readBytes" | "readEnd"
>;

/**
 * Reads `p` from `peer` into pool space from `host`. Throws only for a bug (a
 * batch that ended OK without its checksums), after freeing every chunk.
 */
export async function readLockedPrefix(
  host: TierHost,
  peer: XferPeer,
  p: LockedPrefix,
  o: ReadOptions,
): Promise<ReadOutcome> {
  const tSubmit = performance.now();
  const held = p.remote.starts.length - 1;
  if (p.hashes.length !== held || p.checksums.length !== held) {
    const refused = `${p.hashes.length} blocks to read, the lock answer covers ${held}`;
    return { ...none(), planned: 0, refused, tSubmit, tPlanned: tSubmit };
  }
  if (!(o.deadlineMs >= 1)) {
    const refused = `the owner's lock ends in ${Math.round(o.deadlineMs)} ms, before a READ could`;
    return { ...none(), planned: 0, refused, expired: true, tSubmit, tPlanned: tSubmit };
  }
  const { chunks, planned, refused } = submitChunks(host, peer, p, o);
  const tPlanned = performance.now();
  if (chunks.length === 0) {
    return { ...none(), planned, refused, tSubmit, tPlanned };
  }
  const settled = await settleChunks(host, chunks, p, o.log, tSubmit);
  return { chunks: chunks.length, planned, refused, tSubmit, tPlanned, ...settled };
}

/**
 * The outcome of a prefix read in parts (one per lock, in prefix order) as
 * one: blocks in order, counts summed, the first failure, the READ's time
 * from the first submit to the last batch's end. (Each part's `badBlocks`
 * stay its own: they go back with its lock's release.)
 */
export function mergeReads(parts: ReadOutcome[]): Omit<ReadOutcome, "badBlocks"> {
  if (parts.length === 1) return parts[0];
  const tSubmit = Math.min(...parts.map((p) => p.tSubmit));
  const out: Omit<ReadOutcome, "badBlocks"> = {
    chunks: 0,
    planned: 0,
    good: [],
    bad: 0,
    readBytes: 0,
    readEnd: 0,
    tSubmit,
    tPlanned: Math.max(...parts.map((p) => p.tPlanned)),
  };
  for (const p of parts) {
    out.chunks += p.chunks;
    out.planned += p.planned;
    out.good.push(...p.good);
    out.bad += p.bad;
    out.readBytes += p.readBytes;
    out.failed ??= p.failed;
    if (out.refused === undefined && p.refused !== undefined) {
      out.refused = p.refused;
      out.expired = p.expired;
    }
    if (p.chunks > 0) out.readEnd = Math.max(out.readEnd, p.tSubmit - tSubmit + p.readEnd);
  }
  return out;
}

/**
 * Pipelined: the prefix is read in chunks, each planned (pool space here,
 * whole blocks, prefix order) and submitted while the previous ones are on
 * the wire; each chunk is verified as soon as it landed, while the later ones
 * still read. Planning stops at the first block that cannot be placed.
 */
function submitChunks(
  host: TierHost,
  peer: XferPeer,
  p: LockedPrefix,
  o: ReadOptions,
): { chunks: Chunk[]; planned: number; refused?: string } {
  const per = Math.max(
    1,
    Math.floor((o.chunkBytes) / p.payloadBytes),
    Math.ceil(p.hashes.length / MAX_PIPELINE_CHUNKS),
  );
  const chunks: Chunk[] = [];
  let refused: string | undefined;
  let planned = 0;
  for (let from = 0; from < p.hashes.length; from += per) {
    const to = Math.min(from + per, p.hashes.length);
    let fill: RamFillBatch | null;
    try {
      fill = host.fillMany(
        p.namespace,
        p.hashes.slice(from, to),
        o.filler,
        "reclaimable",
      );
    } catch (e) {
      // Planning refused (a store bug): the chunks already on the wire still end below.
      refused = (e as Error).message;
      break;
    }
    if (!fill) break;
    const n = fill.count;
    planned += n;
    try {
      const batch = readBatch(p, fill, from, o.deadlineMs);
      chunks.push({ fill, from, done: peer.submit(batch), submittedAt: performance.now() });
    } catch (e) {
      // Refused before anything moved: this space was never written. A broken
      // peer is replaced; a full one (PF_EOVERFLOW: other fetches' batches) is kept.
      fill.settle(() => false);
      refused = (e as Error).message;
      if (peer.state().broken !== 0) o.dropPeer();
      break;
    }
    if (chunks.length === 1) {
      o.log.debug("peer read submitted", { owner: p.owner, blocks: p.hashes.length });
    }
    if (n < to - from) break;
  }
  return { chunks, planned, refused };
}

/**
 * The READ batch of one chunk: the owner's ranges of each block paired with
 * the pool space planned for it here. One checksum group per block: the
 * transport checksums each block's bytes as they land and hands the CRC32Cs
 * back with the completion.
 */
function readBatch(p: LockedPrefix, fill: RamFillBatch, from: number, deadlineMs: number) {
  const n = fill.count;
  const rs = p.remote.starts, ls = fill.ranges.starts;
  // Pairing two payload-order walks makes at most one segment per range of either side.
  const segs = rs[from + n] - rs[from] + ls[n] - ls[0];
  const batch = new XferBatch(segs, n).reset("read", deadlineMs);
  for (let k = 0; k < n; k++) {
    pairRanges(batch, p.remote, from + k, fill.ranges, k);
    batch.group(p.payloadBytes);
  }
  return batch;
}

/**
 * Waits for each chunk in order and settles its space: committed where the
 * block's CRC32C matches the owner's, freed otherwise. Each chunk's space is
 * freed only after its completion record: the transport posts it once
 * nothing can land in it any more (#403).
 */
async function settleChunks(
  host: TierHost,
  chunks: Chunk[],
  p: LockedPrefix,
  log: Logger,
  tSubmit: number,
): Promise<Settled> {
  const out: Settled = { good: [], bad: 0, badBlocks: [], readBytes: 0, readEnd: 0 };
  for (let ci = 0; ci < chunks.length; ci++) {
    try {
      await settleChunk(host, chunks[ci], p, log, tSubmit, out);
    } catch (e) {
      // A bug, not bad bytes (the chunk that threw settled its space first): free each later
      // chunk once it ended, so no planned space outlives the fetch.
      for (const later of chunks.slice(ci + 1)) {
        await later.done;
        later.fill.settle(() => false);
      }
      throw e;
    }
  }
  return out;
}

/** Waits for one chunk's completion and settles its space (see {@link settleChunks}). */
async function settleChunk(
  host: TierHost,
  c: Chunk,
  p: LockedPrefix,
  log: Logger,
  tSubmit: number,
  out: Settled,
): Promise<void> {
  const r = await c.done;
  if (r.status !== 0) {
    c.fill.settle(() => false);
    out.failed ??= r;
    return;
  }
  const n = c.fill.count;
  out.readEnd = Math.max(out.readEnd, c.submittedAt - tSubmit + r.ns / 1e6);
  out.readBytes += n * p.payloadBytes;
  const crcs = r.crcs;
  if (!crcs || crcs.length !== n) {
    c.fill.settle(() => false);
    throw new Error(`READ of ${n} blocks ended OK with ${crcs?.length ?? "no"} checksums`);
  }
  verifyChunk(host, c, crcs, p, log, out);
}

/**
 * Settles one landed chunk by checksum and tallies its good and bad blocks in
 * `out`. The committed blocks' checksums are recorded now, with the commit:
 * by the fetch's end a block may have been evicted and saved again with
 * other bytes, which the fetched value would then misdescribe.
 */
function verifyChunk(
  host: TierHost,
  c: Chunk,
  crcs: ArrayLike<number>,
  p: LockedPrefix,
  log: Logger,
  out: Settled,
): void {
  const verified = (k: number) => crcs[k] === p.checksums[c.from + k];
  c.fill.settle(verified);
  const good: Uint8Array[] = [], goodCrcs: number[] = [];
  for (let k = 0; k < c.fill.count; k++) {
    const i = c.from + k;
    if (verified(k)) {
      good.push(p.hashes[i]);
      goodCrcs.push(crcs[k]);
      out.good.push(p.hashes[i]);
    } else {
      out.bad++;
      out.badBlocks.push(i);
      log.warn("peer block failed its checksum: not served", {
        owner: p.owner,
        namespace: p.namespace,
        block_hash: hashHex(p.hashes[i]),
        expected: p.checksums[i],
        got: crcs[k],
      });
    }
  }
  if (good.length > 0) host.recordChecksums(p.namespace, good, goodCrcs);
}
