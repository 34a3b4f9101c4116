"""What an engine's waiting costs while a lower tier fetches its prefix: the scheduler side of
the connector (`SchedulerCore`, a real client and server) asked every 0.1 ms, as an engine that
only waits steps, while the server reads an evicted prefix back from its SSD tier; the request
waits with a WaitPrefetch ("wait") or polls with pauses up to N ms (a number).

A host-backend server with an SSD tier, reached over its Unix socket (`--uds`, as an engine
beside it is); one rank of Llama-3.1-8B-shaped KV (32 layers, K/V,
32 KiB per block and layer) saves PREFIX blocks, waits until they are written behind to SSD,
and the server's RAM is emptied (POST /cache/memory/cleanup). Then the scheduler core asks for
the prefix until it is answered with hits, once per `--settings` entry, each on a freshly
evicted prefix. Per run: QueryPrefetch calls sent, WaitPrefetch calls sent, calls answered
without a query, the time until the hit, and the server process's CPU time meanwhile (/proc,
user + system, in 10 ms ticks).

Prints a table, writes bench/results/loading-poll.json. Never asserts.

    /usr/bin/python3 bench/loading_poll.py [--blocks 256] [--runs 3] [--settings wait,2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from pegaflow.client import PegaflowClient  # noqa: E402
from pegaflow.connector.scheduler_core import SchedulerCore  # noqa: E402
from pegaflow.devserver import DevServer  # noqa: E402

from host_kv import register_host_kv  # noqa: E402

LAYERS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 32, 16, 8, 128  # 32 KiB per block, layer and K/V
STEP_S = 0.0001  # an engine that only waits steps about this often


class Req:
    def __init__(self, rid: str, hashes: list[bytes]):
        self.request_id = rid
        self.block_hashes = hashes
        # Whole blocks plus the token the engine always computes: every hash is of a full block.
        self.num_tokens = len(hashes) * BLOCK_TOKENS + 1


def evict(server: DevServer, written: float, deadline_s: float = 120.0) -> None:
    """Waits until `written` blocks are on SSD, then empties the server's RAM."""
    end = time.monotonic() + deadline_s
    while server.metric("pegaflow_ssd_write_blocks_total") < written:
        if time.monotonic() > end:
            raise RuntimeError(f"write-behind did not reach {written} blocks in {deadline_s} s")
        time.sleep(0.05)
    server.post("/cache/memory/cleanup")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Prints a table and writes --out (default bench/results/loading-poll.json).",
    )
    ap.add_argument("--blocks", type=int, default=256, help="prefix length in blocks (2 MiB each)")
    ap.add_argument("--runs", type=int, default=3, help="runs per setting, alternated")
    ap.add_argument(
        "--settings", default="wait,2",
        help='what to compare: "wait" (WaitPrefetch, the default connector) or N (poll, pauses up to N ms)',
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results", "loading-poll.json"), help="the JSON to write")
    a = ap.parse_args()
    settings = [x.strip() for x in a.settings.split(",")]
    for x in settings:
        if x != "wait" and not x.isdigit():
            ap.error(f'--settings: {x!r} is neither "wait" nor a whole number of ms')
    block_bytes = LAYERS * 2 * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2
    ssd_dir = tempfile.mkdtemp(prefix="pf-loading-poll-")
    pool = max(256 << 20, int(a.blocks * block_bytes * 1.3))
    try:
        server = DevServer.launch([
            "--backend", "host", "--addr", "127.0.0.1:0", "--pool-size", str(pool), "--http-addr", "127.0.0.1:0",
            "--ssd-cache-path", ssd_dir, "--ssd-cache-capacity", str(max(1 << 30, 8 * a.blocks * block_bytes)),
            "--log-level", "warn", "--uds", os.path.join(ssd_dir, "pf.sock"),
        ], start_timeout_s=180.0)
    except BaseException:
        shutil.rmtree(ssd_dir, ignore_errors=True)
        raise
    # As the README runs an engine beside its server: over the Unix socket, whose local RPC
    # socket carries QueryPrefetch and WaitPrefetch.
    client = PegaflowClient("unix:" + server.uds)
    uid = f"poll-{os.getpid()}"
    region = reg = None
    rows = []
    # On success or failure the `finally` stops the server and removes its files and the region.
    try:
        region, reg = register_host_kv(
            client, uid, layers=LAYERS, blocks=a.blocks, block_tokens=BLOCK_TOKENS, kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
        )
        written = 0
        for run in range(a.runs):
            for setting in settings:
                hashes = [os.urandom(16) for _ in range(a.blocks)]
                client.save(instance_id=uid, tp_rank=0, block_ids=list(range(a.blocks)), block_hashes=hashes)
                written += a.blocks
                evict(server, written)
                if setting == "wait":
                    core = SchedulerCore(client, instance_id=uid, block_size=BLOCK_TOKENS)
                else:
                    core = SchedulerCore(
                        client, instance_id=uid, block_size=BLOCK_TOKENS, loading_retry_s=int(setting) / 1000,
                        loading_wait_ms=0,
                    )
                req = Req(f"r{run}-{setting}", hashes)
                c0, t0, calls = server.cpu_seconds(), time.monotonic(), 0
                while True:
                    calls += 1
                    n, _ = core.get_num_new_matched_tokens(req, 0)
                    if n is not None:
                        break
                    if time.monotonic() - t0 > 120:
                        raise RuntimeError(f"{req.request_id}: still loading after 120 s")
                    time.sleep(STEP_S)
                wall, cpu = time.monotonic() - t0, server.cpu_seconds() - c0
                core.request_finished(req)
                if n // BLOCK_TOKENS != a.blocks:  # a miss measures nothing: stop, naming it
                    raise RuntimeError(f"{req.request_id}: {n // BLOCK_TOKENS} of {a.blocks} blocks hit")
                rows.append({
                    "setting": setting, "run": run, "hit_blocks": n // BLOCK_TOKENS, "calls": calls,
                    "queries": core.stats["queries"], "waits": core.stats["waits"],
                    "deferred": core.stats["query_loading_deferred"],
                    "ready_ms": round(wall * 1e3, 2), "server_cpu_ms": round(cpu * 1e3, 1),
                })
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if reg is not None:
            reg.close()
        client.close()
        server.stop()
        server.remove_log()
        if region is not None:
            region.close()
        shutil.rmtree(ssd_dir, ignore_errors=True)

    def med(setting: str, key: str) -> float:
        xs = sorted(r[key] for r in rows if r["setting"] == setting)
        return xs[len(xs) // 2]

    print(f"\n{a.blocks} blocks x 2 MiB read back from SSD, engine stepping every {STEP_S * 1e3:g} ms "
          f"({os.cpu_count()} cores); medians of {a.runs} runs")
    print(f"{'setting':>16} {'queries':>8} {'waits':>6} {'ready ms':>9} {'server CPU ms':>14}")
    summary = {}
    for st in settings:
        summary[st] = {k: med(st, k) for k in ("queries", "waits", "ready_ms", "server_cpu_ms")}
        label = "wait" if st == "wait" else f"poll <= {st} ms"
        print(f"{label:>16} {summary[st]['queries']:>8} {summary[st]['waits']:>6} {summary[st]['ready_ms']:>9.1f} "
              f"{summary[st]['server_cpu_ms']:>14.1f}")
    out = a.out
    with open(out, "w") as f:
        json.dump({
            "command": "python3 bench/loading_poll.py " + " ".join(sys.argv[1:]),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cores": os.cpu_count(), "blocks": a.blocks, "block_bytes": block_bytes,
            "step_ms": STEP_S * 1e3, "runs": rows, "medians": summary,
        }, f, indent=1)
    print("json:", out)


if __name__ == "__main__":
    main()
