/**
 * Which devices a server serves and on which NUMA node each sits, resolved
 * at start-up: `--devices` defaults to every visible GPU on cuda (device 0 on
 * the host backend, which has no physical devices), and a listed id the
 * machine does not have is refused with the count it has.
 *
 * @module
 */
import { deviceCount, deviceNumaNode, NativeError } from "../../ffi/mod.ts";
import type { Logger } from "../log.ts";
import { onlineNodes, planPlacement, type PoolPlacement } from "../numa.ts";

/** The backend a server will run on and the devices it serves. */
export interface ServedDevices {
  /** `auto` resolved: cuda where a GPU is usable, else host. */
  backend: "cuda" | "host";
  devices: number[];
}

/**
 * Resolves `--backend` and `--devices` against the machine. `auto` without a
 * usable GPU resolves to host, and `log` gets one info line saying why.
 *
 * @throws Error naming `--backend cuda`, the reason and what to use instead
 * when no GPU is usable; naming the id and the device count when `devices`
 * lists a GPU this machine does not have.
 */
export function resolveDevices(
  backend: "auto" | "cuda" | "host",
  devices: readonly number[] | undefined,
  log: Logger,
): ServedDevices {
  if (backend === "host") return { backend, devices: [...(devices ?? [0])] };
  const gpus = cudaDevices(backend);
  if (typeof gpus === "string") {
    if (backend === "cuda") {
      throw new Error(
        `--backend cuda: no usable GPU: ${gpus}; use --backend host or --backend auto ` +
          "(auto serves on host where no GPU is usable)",
      );
    }
    log.info("--backend auto: no usable GPU, serving on the host backend", {
      backend: "host",
      reason: gpus,
    });
    return { backend: "host", devices: [...(devices ?? [0])] };
  }
  const count = gpus;
  if (devices === undefined) {
    return {
      backend: "cuda",
      devices: Array.from({ length: count }, (_, i) => i),
    };
  }
  for (const d of devices) {
    if (d >= count) {
      throw new Error(
        `--devices ${devices.join(",")}: device ${d} does not exist; this machine has ${count} ` +
          `CUDA device${count === 1 ? "" : "s"} (${count === 1 ? "0" : `0..${count - 1}`})`,
      );
    }
  }
  return { backend: "cuda", devices: [...devices] };
}

/**
 * How many GPUs the cuda backend sees, or why it sees none (no driver: the
 * library's PF_ENODEV message; a driver with no device). Other failures
 * (a driver that fails to initialise) are thrown naming `--backend`.
 */
function cudaDevices(backend: "auto" | "cuda"): number | string {
  let count: number;
  try {
    count = deviceCount("cuda");
  } catch (e) {
    if (e instanceof NativeError && e.codeName === "PF_ENODEV") return e.message;
    throw new Error(`--backend ${backend}: cannot count the CUDA devices: ${(e as Error).message}`);
  }
  return count > 0 ? count : "the CUDA driver reports no devices";
}

/**
 * Each served device's NUMA node: sysfs through the library on cuda; on the
 * host backend the test map (`PEGAFLOW_TEST_NUMA_NODES`) or none.
 */
export function deviceNodes(
  served: ServedDevices,
  testMap: ReadonlyMap<number, number> | undefined,
): Map<number, number> {
  if (served.backend === "host") return new Map(testMap ?? []);
  return new Map(served.devices.map((d) => [d, deviceNumaNode("cuda", d)]));
}

/** What {@link numaPlacement} reads of the server's configuration. */
export interface NumaConfig {
  disableNumaAffinity: boolean;
  testNumaNodes?: ReadonlyMap<number, number>;
}

/**
 * The pool's split across NUMA nodes for the served devices (lib/numa.ts),
 * or undefined for one part: `--disable-numa-affinity`, or the devices sit
 * on fewer than two known nodes (one-node hosts, VMs that hide the topology).
 * Logs the decision either way.
 */
export function numaPlacement(
  cfg: NumaConfig,
  served: ServedDevices,
  poolBytes: number,
  log: Logger,
): PoolPlacement | undefined {
  if (cfg.disableNumaAffinity) {
    log.info("numa placement", { parts: 1, reason: "--disable-numa-affinity" });
    return undefined;
  }
  const nodeOf = deviceNodes(served, cfg.testNumaNodes);
  const online = onlineNodes();
  const placement = planPlacement(poolBytes, served.devices, nodeOf, online);
  log.info("numa placement", {
    nodes_online: online.join(","),
    device_nodes: served.devices.map((d) => `${d}:${nodeOf.get(d) ?? -1}`).join(","),
    parts: placement?.parts.length ?? 1,
    ...(placement
      ? {
        part_nodes: placement.partNodes.join(","),
        bound_nodes: placement.parts.map((p) => p.node).join(","),
        part_bytes: placement.parts.map((p) => p.bytes).join(","),
      }
      : { reason: "the served devices sit on fewer than two known NUMA nodes" }),
  });
  return placement;
}
