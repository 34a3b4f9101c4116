/**
 * The SSD tier's on-disk format: a superblock per cache file and a 4 KiB
 * header in front of every record. All integers little-endian.
 *
 * File:    [superblock page][segment 0][segment 1]...   (segments of `segmentBytes`)
 * Segment: [record][record]...  records packed from the segment's start
 * Record:  [header page (4096)][payload, padded to the next 4096]
 *
 * Header page (`RECORD_MAGIC`):
 * | off | type | field |
 * |-----|------|-------|
 * | 0   | u32  | magic `PFRC` |
 * | 4   | u16  | format version (FORMAT_VERSION) |
 * | 6   | u16  | key length in bytes (≤ MAX_KEY_BYTES; 0: a pad, below) |
 * | 8   | u64  | seq: global write sequence number (newer wins) |
 * | 16  | u64  | epoch: seq at which this segment was (re)opened for writing |
 * | 24  | u64  | payload length in bytes |
 * | 32  | u32  | CRC32C of the payload |
 * | 36  | u32  | CRC32C of the header bytes [0, 64 + key length) with this field as 0 |
 * | 40  | u64  | record length on disk (header + padded payload) |
 * | 48  | u64  | write time, ms since the epoch |
 * | 56  | u64  | generation of the file (from its superblock) |
 * | 64  | 16 B | layout fingerprint of the block's namespace (lib/storage/layout.ts) |
 * | 80  | u16  | namespace length in bytes |
 * | 82  | u16  | layout summary length in bytes |
 * | 84  | 12 B | reserved, zero |
 * | 96  | ...  | key, then namespace, then layout summary (UTF-8) |
 *
 * The header CRC covers [0, 96 + key + namespace + summary lengths).
 *
 * A header with key length 0 is a _pad_: written over the header page of a
 * record whose write failed, it says "recordBytes bytes here hold no block"
 * (payload length 0, CRC 0, the failed record's seq and epoch), so a scan
 * steps over the gap to the records placed after it in the same fill
 * instead of ending the segment's chain there. A pad is never indexed.
 *
 * The layout fingerprint makes the one-layout-per-namespace rule survive a
 * restart: the index rebuilt from these headers knows which layout wrote
 * each block, a block is served only to that layout, and a registration of
 * another layout under a namespace the disk holds is refused. Version 1
 * records carried no layout; a version 1 file is started empty, never read.
 *
 * The generation ties records to one life of the file: `--ssd-reset` (or a
 * changed geometry) writes a new superblock generation, so records left from
 * before can never reappear at a later start.
 *
 * The epoch lets a scan stop at the end of the current fill of a segment: a
 * reused segment still holds older records past the new write position, and
 * a header that is valid but from an older epoch is not part of this fill.
 *
 * @module
 */

/** `PFRC`: a record header. */
export const RECORD_MAGIC = 0x43524650;
/** `PFSB`: a cache file's superblock. */
export const SUPER_MAGIC = 0x42534650;
/** Bumped on any incompatible layout change; older versions are reset, not misread. */
export const FORMAT_VERSION = 2;
/** Header page and record alignment: 4 KiB covers every device's O_DIRECT alignment. */
export const PAGE_BYTES = 4096;
/** Fixed part of a header before the key. */
export const HEADER_FIXED_BYTES = 96;
/** Bytes of a stored layout fingerprint. */
export const LAYOUT_FINGERPRINT_BYTES = 16;
/** Longest layout summary kept in a header (longer ones are cut: it is for messages only). */
export const MAX_LAYOUT_SUMMARY_BYTES = 512;
/** Longest namespace a header carries. */
export const MAX_NAMESPACE_BYTES = 256;
/** Longest key a header can carry (next to the longest namespace and summary). */
export const MAX_KEY_BYTES = PAGE_BYTES - HEADER_FIXED_BYTES - MAX_NAMESPACE_BYTES -
  MAX_LAYOUT_SUMMARY_BYTES;

// ---- CRC32C (Castagnoli), table-driven; same values as csrc/pf_crc32c.c ----
const CRC_TABLE = (() => {
  const t = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    let c = i;
    for (let k = 0; k < 8; k++) c = (c >>> 1) ^ (0x82f63b78 & -(c & 1));
    t[i] = c >>> 0;
  }
  return t;
})();

/**
 * CRC32C of `bytes` (used for headers, which are small; payload checksums
 * are computed in C).
 *
 * @example
 * ```ts
 * crc32c(new TextEncoder().encode("123456789")); // 0xe3069283
 * ```
 */
export function crc32c(bytes: Uint8Array, crc = 0): number {
  let c = ~crc >>> 0;
  for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return ~c >>> 0;
}

/** Rounds `n` up to a multiple of `PAGE_BYTES`. */
export function pageAlign(n: number): number {
  return Math.ceil(n / PAGE_BYTES) * PAGE_BYTES;
}

/** Bytes a record with `payloadBytes` of payload takes on disk. */
export function recordBytes(payloadBytes: number): number {
  return PAGE_BYTES + pageAlign(payloadBytes);
}

/** A decoded record header. */
export interface RecordHeader {
  key: string;
  seq: number;
  epoch: number;
  payloadBytes: number;
  payloadCrc: number;
  recordBytes: number;
  writtenAtMs: number;
  generation: number;
  /** Namespace of the block. */
  namespace: string;
  /** Layout fingerprint of the namespace when the block was written (32 hex chars). */
  layout: string;
  /** Human description of that layout (for refusal messages). */
  layoutSummary: string;
}

const enc = new TextEncoder();
const dec = new TextDecoder("utf-8", { fatal: true });

/** UTF-8 bytes of a key, or an error naming it if it cannot fit a header. */
export function keyBytes(key: string): Uint8Array {
  const b = enc.encode(key);
  if (b.length === 0 || b.length > MAX_KEY_BYTES) {
    throw new RangeError(
      `block key "${
        key.slice(0, 64)
      }" is ${b.length} bytes; 1..${MAX_KEY_BYTES} fit a record header`,
    );
  }
  return b;
}

/** UTF-8 of `s` cut to at most `max` bytes on a character boundary. */
function utf8Cut(s: string, max: number): Uint8Array {
  const b = enc.encode(s);
  if (b.length <= max) return b;
  let n = max;
  while (n > 0 && (b[n] & 0xc0) === 0x80) n--; // not inside a multi-byte character
  return b.subarray(0, n);
}

/** The 16 bytes of a 32-hex-char layout fingerprint, or an error naming it. */
function fingerprintBytes(hex: string): Uint8Array {
  if (!/^[0-9a-f]{32}$/.test(hex)) {
    throw new RangeError(`layout fingerprint "${hex}" is not 32 lowercase hex characters`);
  }
  const out = new Uint8Array(LAYOUT_FINGERPRINT_BYTES);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}

function fingerprintHex(b: Uint8Array): string {
  let s = "";
  for (const x of b) s += x.toString(16).padStart(2, "0");
  return s;
}

/** True when `h` is a pad (a failed record's space; see the module head): nothing to index. */
export function isPad(h: RecordHeader): boolean {
  return h.key === "";
}

/** What a pad header carries: the failed record's place in its fill and its size on disk. */
export type PadHeader = Pick<
  RecordHeader,
  "seq" | "epoch" | "recordBytes" | "writtenAtMs" | "generation"
>;

/**
 * A pad's namespace and layout: fixed, not the failed block's (whose own
 * namespace or fingerprint may be what made its header fail to encode).
 */
const PAD_NAMESPACE = "(pad)";
const PAD_LAYOUT = "0".repeat(2 * LAYOUT_FINGERPRINT_BYTES);

/**
 * Writes a pad header into `page`: the failed record's `recordBytes` hold no
 * block, and a scan goes on after them.
 *
 * @example
 * ```ts
 * encodePadHeader(batch.headerPage(i), { seq, epoch, recordBytes: recordBytes(bytes),
 *   writtenAtMs: Date.now(), generation });
 * ```
 */
export function encodePadHeader(page: Uint8Array, p: PadHeader): void {
  if (p.recordBytes < PAGE_BYTES || p.recordBytes % PAGE_BYTES !== 0) {
    throw new RangeError(`a pad of ${p.recordBytes} bytes is not a whole number of pages`);
  }
  encodeHeader(
    page,
    {
      ...p,
      key: "",
      payloadBytes: 0,
      payloadCrc: 0,
      namespace: PAD_NAMESPACE,
      layout: PAD_LAYOUT,
      layoutSummary: "",
    },
    new Uint8Array(0),
  );
}

/** Writes a header into `page` (PAGE_BYTES, zeroed past the variable part). */
export function encodeHeader(
  page: Uint8Array,
  h: RecordHeader,
  key: Uint8Array = keyBytes(h.key),
): void {
  const ns = enc.encode(h.namespace);
  if (ns.length === 0 || ns.length > MAX_NAMESPACE_BYTES) {
    throw new RangeError(
      `namespace "${h.namespace.slice(0, 64)}" of block ${h.key.slice(0, 64)} is ${ns.length} ` +
        `bytes; 1..${MAX_NAMESPACE_BYTES} fit a record header`,
    );
  }
  const summary = utf8Cut(h.layoutSummary, MAX_LAYOUT_SUMMARY_BYTES);
  const end = HEADER_FIXED_BYTES + key.length + ns.length + summary.length;
  page.fill(0, 0, end);
  const v = new DataView(page.buffer, page.byteOffset, PAGE_BYTES);
  v.setUint32(0, RECORD_MAGIC, true);
  v.setUint16(4, FORMAT_VERSION, true);
  v.setUint16(6, key.length, true);
  v.setBigUint64(8, BigInt(h.seq), true);
  v.setBigUint64(16, BigInt(h.epoch), true);
  v.setBigUint64(24, BigInt(h.payloadBytes), true);
  v.setUint32(32, h.payloadCrc >>> 0, true);
  v.setUint32(36, 0, true);
  v.setBigUint64(40, BigInt(h.recordBytes), true);
  v.setBigUint64(48, BigInt(Math.floor(h.writtenAtMs)), true);
  v.setBigUint64(56, BigInt(h.generation), true);
  page.set(fingerprintBytes(h.layout), 64);
  v.setUint16(80, ns.length, true);
  v.setUint16(82, summary.length, true);
  page.set(key, HEADER_FIXED_BYTES);
  page.set(ns, HEADER_FIXED_BYTES + key.length);
  page.set(summary, HEADER_FIXED_BYTES + key.length + ns.length);
  v.setUint32(36, crc32c(page.subarray(0, end)), true);
}

/** Why a header did not decode (for logs and the recovery report). */
export type HeaderProblem =
  | "magic"
  | "version"
  | "key-length"
  | "checksum"
  | "lengths" // also: a u64 field (seq, epoch, lengths, time, generation) past 2^53
  | "key-utf8";

/** Decodes and verifies a header page; returns the problem instead when it does not verify. */
export function decodeHeader(page: Uint8Array): RecordHeader | HeaderProblem {
  const v = new DataView(page.buffer, page.byteOffset, PAGE_BYTES);
  if (v.getUint32(0, true) !== RECORD_MAGIC) return "magic";
  if (v.getUint16(4, true) !== FORMAT_VERSION) return "version";
  const keyLen = v.getUint16(6, true);
  if (keyLen > MAX_KEY_BYTES) return "key-length"; // 0: a pad
  const nsLen = v.getUint16(80, true);
  const sumLen = v.getUint16(82, true);
  if (nsLen === 0 || nsLen > MAX_NAMESPACE_BYTES || sumLen > MAX_LAYOUT_SUMMARY_BYTES) {
    return "key-length";
  }
  const end = HEADER_FIXED_BYTES + keyLen + nsLen + sumLen;
  const stored = v.getUint32(36, true);
  const copy = page.slice(0, end);
  new DataView(copy.buffer).setUint32(36, 0, true);
  if (crc32c(copy) !== stored) return "checksum";
  // u64 fields past 2^53 lose precision as numbers: such a seq would make the next
  // write reuse it (and wrap to 0 on disk), so the header is refused with its lengths.
  for (const off of [8, 16, 24, 40, 48, 56]) {
    if (v.getBigUint64(off, true) > BigInt(Number.MAX_SAFE_INTEGER)) return "lengths";
  }
  const payloadBytes = Number(v.getBigUint64(24, true));
  const rec = Number(v.getBigUint64(40, true));
  if (keyLen === 0) {
    // A pad holds no payload, and spans whole pages of the record it stands for.
    if (payloadBytes !== 0 || rec < PAGE_BYTES || rec % PAGE_BYTES !== 0) return "lengths";
  } else if (rec !== recordBytes(payloadBytes)) return "lengths";
  let key: string, namespace: string, layoutSummary: string;
  const k0 = HEADER_FIXED_BYTES, n0 = k0 + keyLen, s0 = n0 + nsLen;
  try {
    key = dec.decode(page.subarray(k0, n0));
    namespace = dec.decode(page.subarray(n0, s0));
    layoutSummary = dec.decode(page.subarray(s0, end));
  } catch {
    return "key-utf8"; // text that is not UTF-8 cannot have been written by us
  }
  return {
    key,
    seq: Number(v.getBigUint64(8, true)),
    epoch: Number(v.getBigUint64(16, true)),
    payloadBytes,
    payloadCrc: v.getUint32(32, true),
    recordBytes: rec,
    writtenAtMs: Number(v.getBigUint64(48, true)),
    generation: Number(v.getBigUint64(56, true)),
    namespace,
    layout: fingerprintHex(page.subarray(64, 64 + LAYOUT_FINGERPRINT_BYTES)),
    layoutSummary,
  };
}

/** A cache file's superblock: the geometry the records were laid out with. */
export interface Superblock {
  /** Random per life of the file; records of another generation are ignored. */
  generation: number;
  segmentBytes: number;
  segmentCount: number;
  createdAtMs: number;
}

/** A fresh generation number: time-based with random low bits, below 2^53. */
export function newGeneration(): number {
  return Date.now() * 1024 + Math.floor(Math.random() * 1024);
}

/** Encodes a superblock into a PAGE_BYTES page. */
export function encodeSuperblock(page: Uint8Array, s: Superblock): void {
  page.fill(0, 0, PAGE_BYTES);
  const v = new DataView(page.buffer, page.byteOffset, PAGE_BYTES);
  v.setUint32(0, SUPER_MAGIC, true);
  v.setUint16(4, FORMAT_VERSION, true);
  v.setUint16(6, PAGE_BYTES / 1024, true);
  v.setBigUint64(8, BigInt(s.segmentBytes), true);
  v.setUint32(16, s.segmentCount, true);
  v.setBigUint64(24, BigInt(Math.floor(s.createdAtMs)), true);
  v.setBigUint64(32, BigInt(s.generation), true);
  v.setUint32(60, crc32c(page.subarray(0, 60)), true);
}

/** Decodes a superblock; a string says why it is not one we can use. */
export function decodeSuperblock(page: Uint8Array): Superblock | string {
  const v = new DataView(page.buffer, page.byteOffset, PAGE_BYTES);
  if (v.getUint32(0, true) !== SUPER_MAGIC) return "no superblock (new or foreign file)";
  if (v.getUint16(4, true) !== FORMAT_VERSION) {
    return `format version ${v.getUint16(4, true)}, this build reads ${FORMAT_VERSION}`;
  }
  if (crc32c(page.subarray(0, 60)) !== v.getUint32(60, true)) return "superblock checksum mismatch";
  return {
    segmentBytes: Number(v.getBigUint64(8, true)),
    segmentCount: v.getUint32(16, true),
    createdAtMs: Number(v.getBigUint64(24, true)),
    generation: Number(v.getBigUint64(32, true)),
  };
}
