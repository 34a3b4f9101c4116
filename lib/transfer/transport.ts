/**
 * Which cross-node transport this node uses, decided once at start-up:
 * RDMA verbs where a device is usable, else TCP — and the fallback is
 * logged loudly, once, with the reason (a silent fallback is what users of
 * other KV transfer engines complain about). The transport in use is
 * exposed for metrics (`lib/transfer/metrics.ts`).
 *
 * Rules:
 *  - `tcp`: TCP, no RDMA probe.
 *  - `rdma`: RDMA or an error (an explicit choice never falls back).
 *  - `auto` (default): RDMA; if it is unavailable (`PF_ENODEV`: no
 *    libibverbs.so.1, no device, a port down) TCP, with one warning per
 *    process naming why. A configuration error (`PF_EINVAL`: a NIC name that
 *    does not exist, zero QPs) is thrown, never papered over by TCP.
 *
 * @module
 */
import { NativeError, type Pool } from "../../ffi/native.ts";
import type { CompletionRing } from "../../ffi/ring.ts";
import { type TransportName, XferEndpoint } from "../../ffi/xfer.ts";
import type { Logger } from "../log.ts";

/** What the operator asked for (`--transport`). */
export type TransportChoice = "auto" | "tcp" | "rdma";

/** Options of {@link openTransport} (CLI flags map onto these). */
export interface TransportOptions {
  transport?: TransportChoice;
  /** RDMA devices (`--nics mlx5_0,mlx5_1:1`); empty = every device. */
  nics?: string[];
  /** RDMA QPs per NIC per peer. Default 2. */
  qpsPerNic?: number;
  /** TCP sockets per peer. Default 4. */
  tcpStreams?: number;
  /** TCP listen address and port (port 0 = any free port). */
  bindAddr?: string;
  port?: number;
  /** TCP socket buffers (0 = kernel autotuning). */
  sockBuf?: number;
  /** Striping unit over streams/QPs (bytes, default 1 MiB). */
  stripeBytes?: number;
  /** Tag of incoming-immediate records on the ring. */
  immTag?: number;
}

/** An opened transport. */
export interface OpenedTransport {
  endpoint: XferEndpoint;
  /** The transport in use. */
  name: TransportName;
  /** Why RDMA was not used, when `auto` fell back to TCP. */
  fallbackReason?: string;
}

/** Default TCP sockets per peer: enough to fill a 100 Gb/s NIC with one core each. */
export const DEFAULT_TCP_STREAMS = 4;
/** Default RDMA QPs per NIC per peer. */
export const DEFAULT_QPS_PER_NIC = 2;

let warnedFallback = false;
let inUse: TransportName | undefined;

/** The transport the last {@link openTransport} of this process chose (undefined before). */
export function transportInUse(): TransportName | undefined {
  return inUse;
}

function positive(name: string, v: number | undefined, dflt: number): number {
  const x = v ?? dflt;
  if (!Number.isInteger(x) || x < 1 || x > 64) {
    throw new RangeError(`transfer: ${name} ${v}; expected an integer in 1..64`);
  }
  return x;
}

/**
 * Opens this node's transfer endpoint over `pool`, posting to `ring`.
 *
 * @example
 * ```ts
 * const { endpoint, name } = openTransport(pool, ring, { transport: "auto" }, log);
 * log.info("transfer endpoint open", { transport: name, port: endpoint.info().port });
 * ```
 */
export function openTransport(
  pool: Pool,
  ring: CompletionRing,
  opts: TransportOptions,
  log: Logger,
): OpenedTransport {
  const choice = opts.transport ?? "auto";
  if (!["auto", "tcp", "rdma"].includes(choice)) {
    throw new TypeError(`transfer: transport "${choice}"; expected auto, tcp or rdma`);
  }
  const qps = positive("qpsPerNic", opts.qpsPerNic, DEFAULT_QPS_PER_NIC);
  const tcpStreams = positive("tcpStreams", opts.tcpStreams, DEFAULT_TCP_STREAMS);
  const common = { pool, ring, stripeBytes: opts.stripeBytes, immTag: opts.immTag };
  let fallbackReason: string | undefined;
  if (choice !== "tcp") {
    try {
      const endpoint = XferEndpoint.open({
        ...common,
        transport: "rdma",
        streams: qps,
        nics: opts.nics,
      });
      inUse = "rdma";
      return { endpoint, name: "rdma" };
    } catch (e) {
      if (choice === "rdma" || !(e instanceof NativeError) || e.codeName !== "PF_ENODEV") throw e;
      fallbackReason = e.message;
    }
  }
  const endpoint = XferEndpoint.open({
    ...common,
    transport: "tcp",
    streams: tcpStreams,
    bindAddr: opts.bindAddr,
    port: opts.port,
    sockBuf: opts.sockBuf,
  });
  inUse = "tcp";
  if (fallbackReason !== undefined) {
    const fields = { transport: "tcp", reason: fallbackReason, port: endpoint.info().port };
    if (!warnedFallback) {
      warnedFallback = true;
      log.warn(
        "RDMA UNAVAILABLE: cross-node transfers use TCP (slower, more CPU); " +
          "pass --transport tcp to make this explicit",
        fields,
      );
    } else {
      log.debug("RDMA unavailable, TCP transport", fields);
    }
  }
  return { endpoint, name: "tcp", fallbackReason };
}
