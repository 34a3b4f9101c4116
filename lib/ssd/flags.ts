/**
 * The SSD tier's command-line flags (each also a `PEGAFLOW_*` environment
 * variable), added to the server's commander program by lib/server/config.ts.
 *
 * @module
 */

import { InvalidArgumentError, type Option } from "commander";
import { boolArg, envOption, formatSize, intArg, sizeArg } from "../cli/flags.ts";
import {
  DEFAULT_HDR_PAGES,
  DEFAULT_SEGMENT_BYTES,
  DEFAULT_SSD_CAPACITY,
  SSD_QUEUE_DEFAULTS,
} from "./tier.ts";
import { PAGE_BYTES } from "./format.ts";
import { MIN_SEGMENT_BYTES } from "./space.ts";

/** The SSD part of the server's configuration. */
export interface SsdConfig {
  /** Cache files or directories; empty = no SSD tier. */
  paths: string[];
  capacityBytes: number;
  reset: boolean;
  writeQueueDepth: number;
  writeInflight: number;
  prefetchQueueDepth: number;
  prefetchInflight: number;
  maxPrefetchBlocks: number;
  segmentBytes: number;
}

/** A size flag in whole pages (the SSD's unit of placement). */
function pagesArg(flag: string, min: number) {
  const size = sizeArg(flag, min);
  return (value: string): number => {
    const n = size(value);
    if (n % PAGE_BYTES !== 0) {
      throw new InvalidArgumentError(`${flag} must be a multiple of ${PAGE_BYTES} bytes, got ${n}`);
    }
    return n;
  };
}

/** Repeatable path flag; the environment variable takes a comma-separated list. */
function paths(value: string, previous: string[] | undefined): string[] {
  const more = value.split(",").map((s) => s.trim()).filter((s) => s.length > 0);
  if (more.length === 0) {
    throw new InvalidArgumentError(`--ssd-cache-path "${value}" names no path`);
  }
  return [...(previous ?? []), ...more];
}

/**
 * The SSD flags as commander Options.
 *
 * @example
 * ```ts
 * for (const o of ssdOptions()) command.addOption(o);
 * ```
 */
export function ssdOptions(): Option[] {
  return [
    envOption(
      "--ssd-cache-path <path>",
      "SSD cache file or directory (repeatable; env: comma-separated)",
      "SSD_CACHE_PATH",
    )
      .argParser(paths),
    envOption(
      "--ssd-cache-capacity <size>",
      "SSD cache size over all paths; capped to free space",
      "SSD_CACHE_CAPACITY",
    )
      .default(DEFAULT_SSD_CAPACITY, formatSize(DEFAULT_SSD_CAPACITY)).argParser(
        // The smallest file (a header page and one segment of the smallest size); whether it
        // holds a segment of the chosen --ssd-segment-size is checked in ssdConfigFrom.
        sizeArg("--ssd-cache-capacity", PAGE_BYTES + MIN_SEGMENT_BYTES),
      ),
    envOption(
      "--ssd-reset [bool]",
      "start the SSD cache empty (ignore what is on disk)",
      "SSD_RESET",
    )
      .default(false).preset(true).argParser(boolArg),
    envOption(
      "--ssd-write-queue-depth <n>",
      "write-behind batches waiting (full: newest dropped)",
      "SSD_WRITE_QUEUE_DEPTH",
    )
      .default(SSD_QUEUE_DEFAULTS.writeQueueDepth).argParser(
        intArg("--ssd-write-queue-depth", 1, Number.MAX_SAFE_INTEGER),
      ),
    envOption("--ssd-write-inflight <n>", "write-behind batches in flight", "SSD_WRITE_INFLIGHT")
      .default(SSD_QUEUE_DEFAULTS.writeInflight).argParser(
        intArg("--ssd-write-inflight", 1, Number.MAX_SAFE_INTEGER),
      ),
    envOption(
      "--ssd-prefetch-queue-depth <n>",
      "prefetches waiting (full: answered as a miss)",
      "SSD_PREFETCH_QUEUE_DEPTH",
    )
      .default(SSD_QUEUE_DEFAULTS.prefetchQueueDepth)
      .argParser(intArg("--ssd-prefetch-queue-depth", 1, Number.MAX_SAFE_INTEGER)),
    envOption("--ssd-prefetch-inflight <n>", "prefetch reads in flight", "SSD_PREFETCH_INFLIGHT")
      .default(SSD_QUEUE_DEFAULTS.prefetchInflight)
      .argParser(intArg("--ssd-prefetch-inflight", 1, Number.MAX_SAFE_INTEGER)),
    envOption(
      "--max-prefetch-blocks <n>",
      "blocks being read from SSD by prefetches at once",
      "MAX_PREFETCH_BLOCKS",
    )
      .default(SSD_QUEUE_DEFAULTS.maxPrefetchBlocks)
      .argParser(intArg("--max-prefetch-blocks", 1, Number.MAX_SAFE_INTEGER)),
    envOption(
      "--ssd-segment-size <size>",
      "SSD segment (reuse unit; ≥ the largest block)",
      "SSD_SEGMENT_SIZE",
    )
      .default(DEFAULT_SEGMENT_BYTES, formatSize(DEFAULT_SEGMENT_BYTES)).argParser(
        pagesArg("--ssd-segment-size", MIN_SEGMENT_BYTES),
      ),
  ];
}

/**
 * Reads the parsed SSD options out of commander's `opts()`, refusing (with an
 * `InvalidArgumentError` naming the flags) combinations the tier cannot open
 * with: more batches in flight than it has header pages, or a capacity whose
 * share per cache file holds no segment besides the file's header page.
 */
export function ssdConfigFrom(o: Record<string, unknown>): SsdConfig {
  const c = ssdConfig(o);
  if (c.writeInflight + c.prefetchInflight > DEFAULT_HDR_PAGES) {
    throw new InvalidArgumentError(
      `--ssd-write-inflight ${c.writeInflight} + --ssd-prefetch-inflight ${c.prefetchInflight} ` +
        `is more than the ${DEFAULT_HDR_PAGES} batches the SSD tier keeps in flight`,
    );
  }
  const files = new Set(c.paths).size;
  const share = files > 0 ? Math.floor(c.capacityBytes / files) : 0;
  if (files > 0 && share < PAGE_BYTES + c.segmentBytes) {
    throw new InvalidArgumentError(
      `--ssd-cache-capacity ${c.capacityBytes} over ${files} --ssd-cache-path gives each ` +
        `${share} bytes, less than one --ssd-segment-size ${c.segmentBytes} segment ` +
        `and its ${PAGE_BYTES}-byte header page`,
    );
  }
  return c;
}

function ssdConfig(o: Record<string, unknown>): SsdConfig {
  return {
    paths: (o.ssdCachePath as string[] | undefined) ?? [],
    capacityBytes: o.ssdCacheCapacity as number,
    reset: o.ssdReset as boolean,
    writeQueueDepth: o.ssdWriteQueueDepth as number,
    writeInflight: o.ssdWriteInflight as number,
    prefetchQueueDepth: o.ssdPrefetchQueueDepth as number,
    prefetchInflight: o.ssdPrefetchInflight as number,
    maxPrefetchBlocks: o.maxPrefetchBlocks as number,
    segmentBytes: o.ssdSegmentSize as number,
  };
}
