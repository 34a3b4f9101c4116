/**
 * The server's command line: every flag, its `PEGAFLOW_*` environment
 * variable, its default, and the parser that refuses a bad value before
 * anything starts. `main.ts` only calls {@link parseServeArgs} and
 * {@link startServer}.
 *
 * @module
 */
import { type Command, InvalidArgumentError } from "commander";
import { newCommand, parseCommandLine, type ParsedArgs, usageExit } from "../cli/command_line.ts";
import { boolArg, envOption, intArg, parseSize, sizeArg } from "../cli/flags.ts";
import { MAX_TIMER_MS } from "../timer_limit.ts";
import { LOG_LEVELS, type LogLevel } from "../log.ts";
import { type SsdConfig, ssdConfigFrom, ssdOptions } from "../ssd/flags.ts";
import { type IndexConfig, indexConfigFrom, indexOptions } from "../index/flags.ts";
import { type PeerConfig, peerConfigFrom, peerOptions } from "../peer/flags.ts";
import { TRANSFER_PATH_FLAGS, type TransferPathFlag } from "../copy_path.ts";
import { defaultCalibrationFile } from "../copy_calibration.ts";
import { MAX_UDS_PATH_BYTES } from "./uds.ts";
import { splitHostPort } from "../host_port.ts";
import { DEFAULT_SESSION_GRACE_MS } from "./sessions.ts";

/** The size parser behind --pool-size and friends (it lives in lib/cli/flags.ts). */
export { parseSize };

/** Everything the server needs to start, after parsing and validation. */
export interface ServeConfig {
  /** gRPC listen address `host:port` (port 0 = pick a free one). */
  addr: string;
  /**
   * Unix-domain socket path for gRPC, served beside `addr` (undefined = none):
   * the engines on this host skip the TCP stack.
   */
  uds: string | undefined;
  /** HTTP listen address for /health, /metrics, ... (undefined = no HTTP). */
  httpAddr: string | undefined;
  /**
   * Device ids to serve, one engine each over one pool (undefined: every
   * visible GPU on cuda, device 0 on the host backend; resolved at start-up
   * by lib/server/devices.ts, which also checks them against the GPU count).
   */
  devices: number[] | undefined;
  /** `--disable-numa-affinity`: one pool part, no node binding, even on a multi-node host. */
  disableNumaAffinity: boolean;
  /**
   * Test hook (env `PEGAFLOW_TEST_NUMA_NODES`, "device:node,..."; host
   * backend): the device → NUMA node map to plan the pool split with, instead
   * of sysfs; parts on nodes this host does not have are left unbound.
   */
  testNumaNodes?: Map<number, number>;
  /**
   * Test hook (env `PEGAFLOW_TEST_FAIL_DEVICES`, host backend): served
   * devices whose copies fail from start-up, as a lost GPU's would.
   */
  testFailDevices?: number[];
  backend: "auto" | "cuda" | "host";
  /** Requested pinned pool size in bytes (before the memory cap). */
  poolSize: number;
  /** True when --pool-size was not given (the default may be capped silently). */
  poolSizeDefaulted: boolean;
  /** Typical block value size; sizes the allocator's unit (0 = default). */
  hintValueSize: number;
  useHugepages: boolean;
  /** Period of the pool-creation progress log lines, ms. */
  poolProgressMs: number;
  enableLfuAdmission: boolean;
  /** `auto` = per batch from the calibration (lib/copy_path.ts); else forced. */
  transferPath: TransferPathFlag;
  /** Calibration cache (lib/copy_calibration.ts); undefined = measure every start. */
  calibrationFile: string | undefined;
  /** Measure at start-up even when the cache has this device. */
  recalibrate: boolean;
  logLevel: LogLevel;
  /** Lease lifetime in ms (a query's pins expire after this). */
  leaseTtlMs: number;
  /**
   * How long a registered rank may go without a Session before it is cleaned up
   * as if its session ended, ms (default {@link DEFAULT_SESSION_GRACE_MS}).
   */
  sessionGraceMs?: number;
  /** Largest gRPC message accepted or sent, in bytes. */
  maxMessageBytes: number;
  /**
   * Relay the gRPC port through the GOAWAY guard (lib/server/goaway_guard.ts),
   * which keeps a client's graceful close from crashing the server
   * (denoland/deno#36788). On by default.
   */
  goawayGuard: boolean;
  /** SSD tier (lib/ssd/flags.ts); no paths = no SSD tier. */
  ssd: SsdConfig;
  /** Cross-node block index (lib/index/flags.ts); no Redis URL = no index. */
  index: IndexConfig;
  /** Peer tier and transfer layer (lib/peer/flags.ts); active with the index. */
  peer: PeerConfig;
}

/** Default gRPC address (the original system's port). */
export const DEFAULT_ADDR = "127.0.0.1:50055";
/** Default pinned pool size request; capped to what the machine can hold. */
export const DEFAULT_POOL_SIZE = "30gb";
/** 64 MiB: a Save of 10K tokens × 32 layers of hashes and ids fits with room to spare. */
export const DEFAULT_MAX_MESSAGE = "64mb";
/** A start-up that pre-touches tens of GiB says it is alive once a second. */
export const DEFAULT_POOL_PROGRESS_MS = 1000;
/** Leases expire after 10 minutes unless consumed or released. */
export const DEFAULT_LEASE_TTL_MS = 600_000;
/** Largest `--lease-ttl-ms`: a QueryPrefetch answer carries it as `lease_ttl_ms`, a uint32. */
export const MAX_LEASE_TTL_MS = 2 ** 32 - 1;
/** Largest device id: `RegisterContextRequest.device_id` and the native library's are int32. */
export const MAX_DEVICE_ID = 2 ** 31 - 1;

function addrArg(value: string): string {
  const a = splitHostPort(value);
  if (!a || a.port > 65535) {
    throw new InvalidArgumentError(`"${value}" is not host:port (e.g. 127.0.0.1:50055)`);
  }
  return value;
}

function udsArg(value: string): string {
  const path = value.startsWith("unix:") ? value.slice("unix:".length) : value;
  if (path === "") {
    throw new InvalidArgumentError("expected a socket path, e.g. /run/pegaflow.sock");
  }
  const bytes = new TextEncoder().encode(path).length;
  if (bytes > MAX_UDS_PATH_BYTES) {
    throw new InvalidArgumentError(
      `"${path}" is ${bytes} bytes; a Unix socket path holds at most ${MAX_UDS_PATH_BYTES}`,
    );
  }
  return path;
}

function choiceArg<T extends string>(choices: readonly T[]) {
  return (value: string): T => {
    if (!(choices as readonly string[]).includes(value)) {
      throw new InvalidArgumentError(`"${value}" is not one of ${choices.join(", ")}`);
    }
    return value as T;
  };
}

/** `PEGAFLOW_TEST_FAIL_DEVICES` (tests only; see {@link ServeConfig.testFailDevices}). */
function testFailDevices(): number[] | undefined {
  const v = Deno.env.get("PEGAFLOW_TEST_FAIL_DEVICES");
  if (!v) return undefined;
  try {
    return devicesArg(v);
  } catch (e) {
    throw new Error(`PEGAFLOW_TEST_FAIL_DEVICES: ${(e as Error).message}`);
  }
}

/** `PEGAFLOW_TEST_NUMA_NODES` (tests only; see {@link ServeConfig.testNumaNodes}). */
function testNumaNodes(): Map<number, number> | undefined {
  const v = Deno.env.get("PEGAFLOW_TEST_NUMA_NODES");
  if (!v) return undefined;
  const out = new Map<number, number>();
  for (const pair of v.split(",")) {
    const m = /^\s*(\d+):(\d+)\s*$/.exec(pair);
    if (!m || out.has(Number(m[1]))) {
      throw new Error(
        `PEGAFLOW_TEST_NUMA_NODES: "${v}" is not a list of distinct device:node pairs (e.g. 0:0,1:1)`,
      );
    }
    out.set(Number(m[1]), Number(m[2]));
  }
  return out;
}

/** Parses `--devices`: distinct non-negative ids, comma-separated. */
export function devicesArg(value: string): number[] {
  const ids = value.split(",").map((s) => s.trim());
  const out: number[] = [];
  for (const id of ids) {
    if (!/^\d+$/.test(id)) {
      throw new InvalidArgumentError(`"${value}" is not a comma-separated list of device ids`);
    }
    if (Number(id) > MAX_DEVICE_ID) {
      throw new InvalidArgumentError(`"${value}": device ${id} is above ${MAX_DEVICE_ID} (int32)`);
    }
    if (out.includes(Number(id))) {
      throw new InvalidArgumentError(`"${value}" lists device ${id} twice`);
    }
    out.push(Number(id));
  }
  return out;
}

/**
 * The commander program for `deno task serve` (exported for --help tests).
 */
// long function: the table of every flag (name, help, environment variable,
// default, parser), one short entry each; validation lives in the parsers.
export function serveCommand(): Command {
  const cmd = newCommand(
    "pegaflow-serve",
    "PegaFlow KV server: stores inference engines' KV blocks in pinned host memory",
  )
    .addOption(
      envOption("--addr <host:port>", "gRPC listen address (port 0: any free port)", "ADDR")
        .default(DEFAULT_ADDR).argParser(addrArg),
    )
    .addOption(
      envOption(
        "--uds <path>",
        "also serve gRPC on this Unix-domain socket (engines on this host: clients use unix:<path>)",
        "UDS",
      ).argParser(udsArg),
    )
    .addOption(
      envOption(
        "--http-addr <host:port>",
        "HTTP address for /health, /metrics, /instances",
        "HTTP_ADDR",
      )
        .argParser(addrArg),
    )
    .addOption(
      envOption(
        "--devices <ids>",
        "comma-separated device ids to serve, one copy engine each over one pool " +
          "(default: every visible GPU on cuda, 0 on host)",
        "DEVICES",
      )
        .argParser(devicesArg),
    )
    .addOption(
      envOption(
        "--disable-numa-affinity [bool]",
        "one pool for all devices even on a multi-NUMA-node host (default: split per node)",
        "DISABLE_NUMA_AFFINITY",
      )
        .default(false).preset(true).argParser(boolArg),
    )
    .addOption(
      envOption("--backend <kind>", "copy backend: auto, cuda or host", "BACKEND")
        .default("auto").argParser(choiceArg(["auto", "cuda", "host"] as const)),
    )
    .addOption(
      envOption(
        "--pool-size <size>",
        "pinned pool size (kb/mb/gb/tb); capped to half of MemAvailable",
        "POOL_SIZE",
      )
        .default(parseSize(DEFAULT_POOL_SIZE), DEFAULT_POOL_SIZE).argParser(
          sizeArg("--pool-size", 1024 * 1024),
        ),
    )
    .addOption(
      envOption(
        "--hint-value-size <size>",
        "typical block slot size; sets the allocation unit",
        "HINT_VALUE_SIZE",
      )
        .default(0, "auto").argParser(sizeArg("--hint-value-size", 512)),
    )
    .addOption(
      envOption("--use-hugepages [bool]", "back the pool with huge pages", "USE_HUGEPAGES")
        .default(false).preset(true).argParser(boolArg),
    )
    .addOption(
      envOption(
        "--pool-progress-ms <ms>",
        "log pool pre-touch progress this often while the pool is created",
        "POOL_PROGRESS_MS",
      )
        .default(DEFAULT_POOL_PROGRESS_MS).argParser(intArg("--pool-progress-ms", 1, MAX_TIMER_MS)),
    )
    .addOption(
      envOption(
        "--enable-lfu-admission [bool]",
        "TinyLFU admission in front of the LRU",
        "ENABLE_LFU_ADMISSION",
      )
        .default(false).preset(true).argParser(boolArg),
    )
    .addOption(
      envOption(
        "--transfer-path <path>",
        "cuda copy path: auto = chosen per batch from its mean segment size and the " +
          "device's calibration (measured at start-up or read from --calibration-file); " +
          "kernel or dma (batch DMA where the driver has it) force one path. " +
          "The host backend always copies with memcpy",
        "TRANSFER_PATH",
      )
        .default("auto").argParser(choiceArg(TRANSFER_PATH_FLAGS)),
    )
    .addOption(
      envOption(
        "--calibration-file <path>",
        "cache of the copy-path calibration, keyed by GPU name + driver + ABI " +
          "(none: measure at every start)",
        "CALIBRATION_FILE",
      )
        .default(defaultCalibrationFile((n) => Deno.env.get(n)) ?? "none")
        .argParser((v: string) => v.trim() === "" ? "none" : v),
    )
    .addOption(
      envOption(
        "--recalibrate [bool]",
        "measure the copy paths at start-up even when the cache has this GPU",
        "RECALIBRATE",
      )
        .default(false).preset(true).argParser(boolArg),
    )
    .addOption(
      envOption("--log-level <level>", "debug, info, warn or error", "LOG_LEVEL")
        .default("info").argParser(choiceArg(LOG_LEVELS)),
    )
    .addOption(
      envOption("--lease-ttl-ms <ms>", "lease lifetime in milliseconds", "LEASE_TTL_MS")
        .default(DEFAULT_LEASE_TTL_MS).argParser(intArg("--lease-ttl-ms", 1, MAX_LEASE_TTL_MS)),
    )
    .addOption(
      envOption(
        "--session-grace-ms <ms>",
        "a registered rank whose Session has not opened within this many milliseconds " +
          "is cleaned up as if its session ended (an engine that died before opening it)",
        "SESSION_GRACE_MS",
      )
        .default(DEFAULT_SESSION_GRACE_MS)
        .argParser(intArg("--session-grace-ms", 1, MAX_TIMER_MS)),
    )
    .addOption(
      envOption(
        "--max-message-size <size>",
        "largest gRPC message accepted or sent; also the largest local or peer RPC request",
        "MAX_MESSAGE_SIZE",
      )
        .default(parseSize(DEFAULT_MAX_MESSAGE), DEFAULT_MAX_MESSAGE)
        .argParser(sizeArg("--max-message-size", 4096)),
    )
    .addOption(
      envOption(
        "--goaway-guard [bool]",
        "relay gRPC through a guard that drops client GOAWAY frames (denoland/deno#36788)",
        "GOAWAY_GUARD",
      )
        .default(true).preset(true).argParser(boolArg),
    );
  for (const o of ssdOptions()) cmd.addOption(o);
  for (const o of indexOptions()) cmd.addOption(o);
  for (const o of peerOptions()) cmd.addOption(o);
  return cmd;
}

/** The result of parsing: a config to start, or text to print and an exit code. */
export type ParseResult = ParsedArgs<ServeConfig>;

/**
 * Parses argv (without the program name) and the `PEGAFLOW_*` environment.
 * Never starts anything; a bad value yields `{kind: "exit", code: 2}` with a
 * message naming the flag.
 *
 * @example
 * ```ts
 * const r = parseServeArgs(["--pool-size", "2gb", "--backend", "host"]);
 * if (r.kind === "config") console.log(r.config.poolSize); // 2147483648
 * ```
 */
export function parseServeArgs(argv: string[]): ParseResult {
  const cmd = serveCommand();
  const parsed = parseCommandLine(cmd, argv);
  if (parsed.kind === "exit") return parsed;
  const o = cmd.opts();
  // Flags that are valid alone but not together are refused here, as a parser refuses one.
  let ssd: SsdConfig, index: IndexConfig, peer: PeerConfig;
  try {
    [ssd, index, peer] = [ssdConfigFrom(o), indexConfigFrom(o), peerConfigFrom(o)];
  } catch (e) {
    if (e instanceof InvalidArgumentError) return usageExit(e.message);
    throw e;
  }
  return {
    kind: "config",
    config: {
      addr: o.addr,
      uds: o.uds,
      httpAddr: o.httpAddr,
      devices: o.devices,
      disableNumaAffinity: o.disableNumaAffinity,
      testFailDevices: testFailDevices(),
      testNumaNodes: testNumaNodes(),
      backend: o.backend,
      poolSize: o.poolSize,
      poolSizeDefaulted: cmd.getOptionValueSource("poolSize") === "default",
      hintValueSize: o.hintValueSize,
      useHugepages: o.useHugepages,
      poolProgressMs: o.poolProgressMs,
      enableLfuAdmission: o.enableLfuAdmission,
      transferPath: o.transferPath,
      calibrationFile: o.calibrationFile === "none" ? undefined : o.calibrationFile,
      recalibrate: o.recalibrate,
      logLevel: o.logLevel,
      leaseTtlMs: o.leaseTtlMs,
      sessionGraceMs: o.sessionGraceMs,
      maxMessageBytes: o.maxMessageSize,
      goawayGuard: o.goawayGuard,
      ssd,
      index,
      peer,
    },
  };
}

/** Fraction of MemAvailable the pool may take: leave room for the engines and the OS. */
export const POOL_MEM_FRACTION = 0.5;

/**
 * Caps a requested pool size to {@link POOL_MEM_FRACTION} of the machine's
 * available memory (read from /proc/meminfo; uncapped where unreadable).
 */
export function capPoolSize(
  requested: number,
): { bytes: number; capped: boolean; availBytes: number | null } {
  let avail: number | null = null;
  try {
    const m = /MemAvailable:\s+(\d+)\s+kB/.exec(Deno.readTextFileSync("/proc/meminfo"));
    if (m) avail = Number(m[1]) * 1024;
  } catch (_e) {
    // Non-Linux: no cap; the allocation itself fails clearly if too large.
    avail = null;
  }
  if (avail === null) return { bytes: requested, capped: false, availBytes: null };
  const limit = Math.floor(avail * POOL_MEM_FRACTION / (1 << 20)) * (1 << 20);
  return requested > limit
    ? { bytes: limit, capped: true, availBytes: avail }
    : { bytes: requested, capped: false, availBytes: avail };
}
