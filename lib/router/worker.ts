/**
 * Entry point of one router worker thread (started by lib/router/cluster.ts). It serves the
 * shared port with its own event loop — the same handler as a single-threaded router — over pool
 * state shared with every other worker, and leaves health checks and the merging of metrics to
 * the main thread.
 *
 * @module
 */

/// <reference lib="deno.worker" />

import type { BackendPool } from "./backend_pool.ts";
import type { FromWorker, ToWorker } from "./cluster_protocol.ts";
import { Logger } from "../log.ts";
import { type RouterHandle, startRouter } from "./server.ts";

const post = (m: FromWorker) => self.postMessage(m);

let router: RouterHandle | undefined;
let nextScrape = 0;
const scrapes = new Map<number, { resolve: (r: Response) => void; reject: (e: Error) => void }>();

function poolOf(role: "prefill" | "decode"): BackendPool | undefined {
  return role === "prefill" ? router?.prefill : router?.decode;
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
      for (const pool of [router.prefill, router.decode]) {
        pool.onHealthChange((b, healthy, reason) => {
          post({
            type: "health",
            backend: { role: b.role, index: pool.backends.indexOf(b) },
            healthy,
            reason,
          });
        });
      }
      post({ type: "listening", url: router.url, port: router.port });
      return;
    }
    case "health": {
      const b = poolOf(m.backend.role)?.backends[m.backend.index];
      if (b !== undefined) b.lastError = m.error;
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
