/**
 * Messages between the router's main thread and its workers (lib/router/cluster.ts,
 * lib/router/worker.ts). Only structured-cloneable data; the pools' SharedArrayBuffers travel in
 * the start message and are then shared, not copied.
 *
 * @module
 */

import type { RouterConfig } from "./config.ts";
import type { Role } from "./backend_pool.ts";

/** One backend, by pool and position in its `--prefill`/`--decode` list. */
export interface BackendRef {
  role: Role;
  index: number;
}

/** Main thread → worker. */
export type ToWorker =
  | {
    type: "start";
    /** Worker number, 0-based, for logs. */
    worker: number;
    config: RouterConfig;
    prefillState: SharedArrayBuffer;
    decodeState: SharedArrayBuffer;
    /**
     * Each backend's last error (by pool, in list order) when the worker was started: the
     * reasons of backends already out then (the flags are in shared memory; these are not).
     */
    lastErrors: Record<Role, (string | null)[]>;
  }
  /** A backend's health changed (the flag itself is in shared memory; this carries the reason). */
  | { type: "health"; backend: BackendRef; healthy: boolean; error: string | null }
  /** Send this worker's metrics (`registry.getMetricsAsJSON()`) for scrape `id`. */
  | { type: "collect"; id: number }
  /** The merged metrics text this worker asked for with `scrape` `id`. */
  | { type: "scraped"; id: number; text: string; contentType: string }
  | { type: "scrape-failed"; id: number; error: string }
  /** Stop accepting, let open requests finish for up to `graceMs`, then report `stopped`. */
  | { type: "shutdown"; graceMs?: number };

/** Worker → main thread. */
export type FromWorker =
  | { type: "listening"; url: string; port: number }
  | { type: "start-failed"; name: string; message: string }
  /** The request path took a backend out (a refused connection), or it is out for a new reason. */
  | { type: "health"; backend: BackendRef; healthy: boolean; reason: string }
  /** A client asked this worker for /metrics: merge everyone's and answer with `scraped`. */
  | { type: "scrape"; id: number }
  | { type: "metrics"; id: number; json: unknown[] }
  | { type: "stopped" };
