/**
 * Prometheus metrics of the transfer layer, read from the endpoint's own
 * counters (`pf_xfer_info`) at scrape time so they never drift from it:
 * which transport is in use (a labelled 0/1 gauge, so a dashboard shows a
 * TCP fallback at a glance), batches by outcome, late bytes discarded after
 * deadlines, bytes served / landed for peers, connections (served, refused,
 * failed accepts) and peers.
 *
 * @module
 */
import { Counter, Gauge, type Registry } from "prom-client";
import type { XferEndpoint, XferInfo } from "../../ffi/xfer.ts";

/**
 * Registers the transfer metrics on `registry`; `source()` returns the
 * endpoint to read (undefined while none is open).
 *
 * long function: one declaration per metric, read as the table of what the
 * transfer layer exports.
 *
 * @example
 * ```ts
 * registerTransferMetrics(registry, () => transfer?.endpoint);
 * ```
 */
export function registerTransferMetrics(
  registry: Registry,
  source: () => XferEndpoint | undefined,
): void {
  // A closed endpoint's handle is gone (shutdown closes it before /metrics stops answering):
  // its counters keep their last values.
  const read = (): XferInfo | undefined => {
    const ep = source();
    return ep && !ep.closed ? ep.info() : undefined;
  };
  new Gauge({
    name: "pegaflow_transfer_transport",
    help: "1 for the cross-node transport in use (tcp or rdma), 0 for the other",
    labelNames: ["transport"],
    registers: [registry],
    collect() {
      const ep = source();
      this.set({ transport: "tcp" }, ep?.transport === "tcp" ? 1 : 0);
      this.set({ transport: "rdma" }, ep?.transport === "rdma" ? 1 : 0);
    },
  });
  // Counters mirror C's cumulative counts: each scrape adds what grew since
  // the previous one (a count that went down means a new endpoint: restart).
  const prev = new Map<string, number>();
  const grown = (key: string, now: number): number => {
    const before = prev.get(key);
    prev.set(key, now);
    return before === undefined || now < before ? now : now - before;
  };
  const results: [string, (i: XferInfo) => number][] = [
    ["ok", (i) => i.ok],
    ["failed", (i) => i.failed],
    ["timed_out", (i) => i.timedOut],
  ];
  new Counter({
    name: "pegaflow_transfer_batches_total",
    help: "transfer batches ended, by result (ok, failed, timed_out)",
    labelNames: ["result"],
    registers: [registry],
    collect() {
      const i = read();
      if (!i) return;
      for (const [result, pick] of results) this.inc({ result }, grown(result, pick(i)));
    },
  });
  const counter = (name: string, help: string, pick: (i: XferInfo) => number) =>
    new Counter({
      name,
      help,
      registers: [registry],
      collect() {
        const i = read();
        if (i) this.inc(grown(name, pick(i)));
      },
    });
  counter(
    "pegaflow_transfer_late_bytes_total",
    "bytes of timed-out or cancelled batches that arrived late and were discarded",
    (i) => i.lateBytes,
  );
  counter(
    "pegaflow_transfer_served_bytes_total",
    "bytes this node sent to peers' READs",
    (i) => i.bytesServed,
  );
  counter(
    "pegaflow_transfer_landed_bytes_total",
    "bytes peers' WRITEs landed in this node's pool",
    (i) => i.bytesLanded,
  );
  counter(
    "pegaflow_transfer_refused_connections_total",
    "TCP connections from peers refused at once: over PEGAFLOW_TCP_MAX_CONNS, or out of " +
      "descriptors, memory or threads",
    (i) => i.connsRefused,
  );
  counter(
    "pegaflow_transfer_accept_errors_total",
    "TCP accepts that failed (out of descriptors or kernel memory)",
    (i) => i.acceptErrors,
  );
  new Gauge({
    name: "pegaflow_transfer_serving_connections",
    help: "TCP connections from peers being served",
    registers: [registry],
    collect() {
      this.set(read()?.servingConnections ?? 0);
    },
  });
  new Gauge({
    name: "pegaflow_transfer_peers",
    help: "peers this node has open",
    registers: [registry],
    collect() {
      this.set(read()?.peers ?? 0);
    },
  });
}
