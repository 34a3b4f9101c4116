/**
 * Entry point of one router worker thread (started by lib/router/cluster.ts). It serves the
 * shared port with its own event loop — the same handler as a single-threaded router — over pool
 * state shared with every other worker, and leaves health checks and the merging of metrics to
 * the main thread.
 *
 * @module
 */

/// <reference lib="deno.worker" />

import type { Backend, BackendPool } from "./backend_pool.ts";
import type { BackendRef, FromWorker, ToWorker } from "./cluster_protocol.ts";
import { Logger } from "../log.ts";
import { type RouterHandle, startRouter } from "./server.ts";

const post = (m: FromWorker) => self.postMessage(m);

let router: RouterHandle | undefined;
/** Reasons the main thread sent while this worker's router was starting: applied once it runs. */
const early: Extract<ToWorker, { type: "health" }>[] = [];
let nextScrape = 0;
const scrapes = new Map<number, { resolve: (r: Response) => void; reject: (e: Error) => void }>();

function poolOf(role: "prefill" | "decode"): BackendPool | undefined {
  return role === "prefill" ? router?.prefill : router?.decode;
}

/** A backend's reason as the main thread last told it (its flag is in shared memory). */
function setLastError(backend: BackendRef, error: string | null): void {
  const b = poolOf(backend.role)?.backends[backend.index];
  if (b !== undefined) b.lastError = error;
}

/** GET /metrics on this worker: the main thread gathers every worker's metrics and merges them. */
function scrape(): Promise<Response> {
  const id = nextScrape++;
  return new Promise<Response>((resolve, reject) => {
    scrapes.set(id, { resolve, reject });
    post({ type: "scrape", id });
  });
}

self.onmessage = async (ev: MessageEvent<ToWorker>) => {
  const m = ev.data;
  switch (m.type) {
    case "start": {
      const log = new Logger(m.config.logLevel, { worker: m.worker });
      try {
        router = await startRouter(m.config, log, {
          prefillState: m.prefillState,
          decodeState: m.decodeState,
          scrape,
        });
      } catch (e) {
        const err = e instanceof Error ? e : new Error(String(e));
        post({ type: "start-failed", name: err.name, message: err.message });
        return;
      }
      // Backends out before this worker started, then what changed while it was starting.
      for (const pool of [router.prefill, router.decode]) {
        pool.backends.forEach((b, i) => (b.lastError = m.lastErrors[pool.role][i] ?? null));
      }
      for (const h of early.splice(0)) setLastError(h.backend, h.error);
      for (const pool of [router.prefill, router.decode]) {
        const ref = (b: Backend) => ({ role: b.role, index: pool.backends.indexOf(b) });
        pool.onHealthChange((b, healthy, reason) => {
          post({ type: "health", backend: ref(b), healthy, reason });
        });
        pool.onReasonChange((b, reason) => {
          post({ type: "health", backend: ref(b), healthy: false, reason });
        });
      }
      post({ type: "listening", url: router.url, port: router.port });
      return;
    }
    case "health": {
      if (router === undefined) early.push(m);
      else setLastError(m.backend, m.error);
      return;
    }
    case "collect": {
      const json = router === undefined ? [] : await router.metrics.registry.getMetricsAsJSON();
      post({ type: "metrics", id: m.id, json });
      return;
    }
    case "scraped": {
      const s = scrapes.get(m.id);
      scrapes.delete(m.id);
      s?.resolve(new Response(m.text, { headers: { "content-type": m.contentType } }));
      return;
    }
    case "scrape-failed": {
      const s = scrapes.get(m.id);
      scrapes.delete(m.id);
      s?.reject(new Error(`metrics could not be merged: ${m.error}`));
      return;
    }
    case "shutdown": {
      await router?.shutdown(m.graceMs);
      post({ type: "stopped" });
      return;
    }
  }
};
