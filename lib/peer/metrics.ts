/**
 * Prometheus metrics of the peer tier (`pegaflow_peer_*`), read from the
 * tier's and the lock table's running totals at scrape time, plus the fetch
 * duration histogram the tier feeds. Hit attribution (ram / ssd / peer /
 * miss) is `pegaflow_query_source_total` (lib/server/tier_metrics.ts); the
 * transport in use is `pegaflow_transfer_transport` (lib/transfer/metrics.ts);
 * index errors are `pegaflow_index_errors_total` (lib/index/metrics.ts).
 *
 * @module
 */

import { Counter, Gauge, Histogram, type Registry } from "prom-client";
import type { PeerLockStats } from "./locks.ts";
import type { PeerTierStats } from "./fetch_stats.ts";
import type { PeerLinkStats } from "./link.ts";

/**
 * Registers the peer metrics; returns the fetch-duration observer for the
 * tier.
 *
 * long function: one declaration per metric, read as the table of what the
 * peer tier exports.
 */
export function registerPeerMetrics(
  registry: Registry,
  tier: () => PeerTierStats | undefined,
  locks: () => PeerLockStats | undefined,
  links?: () => PeerLinkStats,
): (seconds: number) => void {
  const last = new Map<string, number>();
  const advance = (c: Counter<string>, key: string, labels: Record<string, string>, v: number) => {
    const prev = last.get(key) ?? 0;
    if (v > prev) c.inc(labels, v - prev);
    last.set(key, v);
  };
  const counter = (
    name: string,
    help: string,
    read: () => [Record<string, string>, number][] | undefined,
    labelNames: string[] = [],
  ) =>
    new Counter({
      name,
      help,
      labelNames,
      registers: [registry],
      collect() {
        for (const [labels, v] of read() ?? []) {
          advance(this, name + JSON.stringify(labels), labels, v);
        }
      },
    });
  counter(
    "pegaflow_peer_fetches_total",
    "peer fetches started (lookup → lock → read → verify), and those that committed a block",
    () => {
      const s = tier();
      return s && [[{ result: "started" }, s.fetches], [{ result: "ok" }, s.fetchesOk]];
    },
    ["result"],
  );
  counter(
    "pegaflow_peer_fetch_failures_total",
    "peer fetches that brought nothing, by reason (checksum: blocks that failed verification)",
    () => {
      const s = tier();
      return s && Object.entries(s.failures).map(([reason, n]) => [{ reason }, n]);
    },
    ["reason"],
  );
  counter(
    "pegaflow_peer_fetch_owners_skipped_total",
    "owners a peer fetch passed over for the next one the index names, by the reason each failed (connect, lock-rpc, owner-miss); not fetch failures",
    () => {
      const s = tier();
      return s && Object.entries(s.ownersSkipped).map(([reason, n]) => [{ reason }, n]);
    },
    ["reason"],
  );
  counter(
    "pegaflow_peer_owners_suspected_total",
    "owners marked suspect after failing by their own doing (connect, lock-rpc): asked after the healthy owners until the mark expires or they answer a lock",
    () => {
      const s = tier();
      return s && Object.entries(s.ownersSuspected).map(([reason, n]) => [{ reason }, n]);
    },
    ["reason"],
  );
  counter("pegaflow_peer_fetch_blocks_total", "blocks fetched from peers and committed", () => {
    const s = tier();
    return s && [[{}, s.blocks]];
  });
  counter("pegaflow_peer_fetch_bytes_total", "bytes fetched from peers and committed", () => {
    const s = tier();
    return s && [[{}, s.bytes]];
  });
  counter("pegaflow_peer_read_bytes_total", "bytes of peer READ batches that ended OK", () => {
    const s = tier();
    return s && [[{}, s.readBytes]];
  });
  counter(
    "pegaflow_peer_read_seconds_total",
    "time of peer READ batches that ended OK, submit to completion (the wire part of a fetch)",
    () => {
      const s = tier();
      return s && [[{}, s.readSeconds]];
    },
  );
  counter(
    "pegaflow_peer_lock_calls_total",
    "lock and release calls this node made on owners, by the way: rpc (the owner's peer RPC socket) or grpc (an owner without one)",
    () => {
      const c = links?.().calls;
      return c && [[{ via: "rpc" }, c.rpc], [{ via: "grpc" }, c.grpc]];
    },
    ["via"],
  );
  counter(
    "pegaflow_peer_checksums_total",
    "block checksums computed, by when: after the seal, or at lock time (not recorded yet)",
    () => {
      const s = tier(), l = locks();
      const out: [Record<string, string>, number][] = [];
      if (s) out.push([{ when: "seal" }, s.checksumsAtSeal]);
      if (l) out.push([{ when: "lock" }, l.checksumsAtLock]);
      return out;
    },
    ["when"],
  );
  new Gauge({
    name: "pegaflow_peer_fetches_inflight",
    help: "peer fetches running now",
    registers: [registry],
    collect() {
      this.set(tier()?.inflight ?? 0);
    },
  });
  new Gauge({
    name: "pegaflow_peer_locks_held",
    help: "transfer locks this node holds for peers now",
    registers: [registry],
    collect() {
      this.set(locks()?.held ?? 0);
    },
  });
  counter(
    "pegaflow_peer_locks_total",
    "transfer locks granted to peers, and how they ended (released, timed_out)",
    () => {
      const l = locks();
      return l && [
        [{ event: "granted" }, l.granted],
        [{ event: "released" }, l.released],
        [{ event: "timed_out" }, l.timedOut],
      ];
    },
    ["event"],
  );
  counter(
    "pegaflow_peer_lock_misses_total",
    "lock requests that locked nothing, by reason (abandoned: the requester gave up waiting first)",
    () => {
      const l = locks();
      return l && Object.entries(l.misses).map(([reason, n]) => [{ reason }, n]);
    },
    ["reason"],
  );
  counter(
    "pegaflow_peer_reported_bad_blocks_total",
    "blocks requesters read from this node with wrong checksums, by what the check here found: condemned (changed since their seal: dropped) or intact (damaged on the way or at the requester)",
    () => {
      const l = locks();
      return l && [
        [{ outcome: "condemned" }, l.reportedBad.condemned],
        [{ outcome: "intact" }, l.reportedBad.intact],
      ];
    },
    ["outcome"],
  );
  const duration = new Histogram({
    name: "pegaflow_peer_fetch_duration_seconds",
    help: "peer fetch duration, index lookup to the last block committed (or the failure)",
    buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
    registers: [registry],
  });
  return (s) => duration.observe(s);
}
