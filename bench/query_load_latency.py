"""Where a warm request's control plane goes, before its copy starts: one QueryPrefetch
with `load_into` (the query-issued load of bench/ttft.py) from the Python client to a real
server over its local RPC socket, split at the clocks both sides keep.

A host-backend server (the control plane is the same code as on cuda; its copies are
memcpys) is started with --uds and a debug log; one rank of 32 layers registers, a 10K-token
prefix (639 blocks, the warm request's hit) is saved once, then each run asks for it with
`load_into` (639 contiguous targets, like the connector's staging blocks), waits for the
load and gives nothing back (the load spent the lease). Per run, wall-clock ms:

  build      client entry -> the frame leaves (request message built and serialized)
  to server  frame sent -> the server has it decoded (socket, event-loop wake, decode)
  to submit  decoded -> the copy submitted (lookup, lease, the load's checks, batch, submit)
  answer     submitted -> the answer is back in the client

Segments are 4 KB (one head; the JS work scales with blocks x layers, not bytes). With
`--stored-prompts N` the server first holds N other prompts of 639 blocks: the lookup's cost
grows with the store (a TTFT run's server holds ~13,000 blocks). Prints a table, writes
bench/results/query-load-latency[-TAG].json. Never asserts.

    /usr/bin/python3 bench/query_load_latency.py --runs 200 [--tag host2]
    /usr/bin/python3 bench/query_load_latency.py --stored-prompts 20 --pool-size 4gb
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import pegaflow.local_rpc as local_rpc  # noqa: E402
from pegaflow.client import PegaflowClient  # noqa: E402
from pegaflow.devserver import DevServer  # noqa: E402
from pegaflow.load_state import LoadState  # noqa: E402

from host_kv import register_host_kv  # noqa: E402

LAYERS, BLOCK_TOKENS, HEADS, HEAD_DIM = 32, 16, 1, 128  # 4 KB segments: the pool unit, so runs merge as at 32 KB
HIT_BLOCKS = 639  # a 10,240-token prompt: the last block holds the recomputed token


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Prints a table and writes --out (default bench/results/query-load-latency[-TAG].json).",
    )
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=20.0, help="idle time between runs")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    ap.add_argument("--out", default=None, help="the JSON to write (default bench/results/query-load-latency[-TAG].json)")
    ap.add_argument(
        "--stored-prompts", type=int, default=0,
        help="other 639-block prompts saved first (a server that holds more blocks: ~13,000 at 20)",
    )
    ap.add_argument("--pool-size", default="256mb", help="the server's --pool-size (4gb for 20 stored prompts)")
    a = ap.parse_args()

    sock_dir = tempfile.mkdtemp(prefix="pf-qll-")
    sock = os.path.join(sock_dir, "pf.sock")
    try:
        server = DevServer.launch(
            ["--backend", "host", "--addr", "127.0.0.1:0", "--pool-size", a.pool_size, "--uds", sock,
             "--log-level", "debug"],
            start_timeout_s=120.0,
        )
    except BaseException:
        shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    client = PegaflowClient("unix:" + sock)
    uid = f"qll-{os.getpid()}"
    region = reg = None
    sent: list[float] = []
    orig_call = local_rpc.LocalRpc.call

    def timed_call(self, *args, **kw):
        sent.append(time.time() * 1e3)
        return orig_call(self, *args, **kw)

    rows = []
    # Everything from here on, on success or failure, ends in the `finally`: no server left
    # running, no shm region, no socket directory, no log file.
    try:
        region, reg = register_host_kv(
            client, uid, layers=LAYERS, blocks=2 * HIT_BLOCKS + 2, block_tokens=BLOCK_TOKENS, kv_heads=HEADS,
            head_dim=HEAD_DIM,
        )
        src = list(range(1, HIT_BLOCKS + 1))
        hashes = [os.urandom(16) for _ in range(HIT_BLOCKS)]
        client.save(instance_id=uid, tp_rank=0, block_ids=src, block_hashes=hashes)
        targets = list(range(HIT_BLOCKS + 1, 2 * HIT_BLOCKS + 1))
        for _ in range(a.stored_prompts):  # the same blocks saved again under other hashes
            client.save(instance_id=uid, tp_rank=0, block_ids=src, block_hashes=[os.urandom(16) for _ in src])

        local_rpc.LocalRpc.call = timed_call  # type: ignore[method-assign]
        with LoadState.create() as st:
            for i in range(a.warmup + a.runs):
                time.sleep(a.gap_ms / 1e3)
                st.rearm()
                rid = f"qll-{i}"
                sent.clear()
                t0 = time.time() * 1e3
                q = client.query_prefetch(
                    instance_id=uid, block_hashes=hashes, request_id=rid,
                    load_into=targets, load_states={(0, 0): st.name},
                )
                t_back = time.time() * 1e3
                if q.hits != HIT_BLOCKS or q.load_errors:  # before waiting: a miss queues no load
                    raise RuntimeError(
                        f"run {i}: {q.hits} of {HIT_BLOCKS} hits, load errors {q.load_errors} "
                        f"(is --pool-size {a.pool_size} big enough for {a.stored_prompts} stored prompts?)"
                    )
                st.wait_all(timeout_s=30)
                if i >= a.warmup:
                    rows.append((rid, t0, sent[0], t_back))
    finally:
        local_rpc.LocalRpc.call = orig_call
        if reg is not None:
            reg.close()
        client.close()
        server.stop()
        if region is not None:
            region.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
        log_lines = server.logs().splitlines()
        server.remove_log()
    # The server's side: "local rpc" lines (decoded / answered) in call order, "load done" by request.
    rpc, done = [], {}
    for line in log_lines:
        if '"local rpc"' in line and '"queryPrefetch"' in line:
            rpc.append(json.loads(line))
        elif '"load done"' in line:
            r = json.loads(line)
            done[r["request"]] = r
    rpc = rpc[-a.runs:]
    parts: dict[str, list[float]] = {
        k: [] for k in ("build", "to server", "to submit", " query", " load checks", " lease", " batch", " submit",
                        "answer", "total")
    }
    for (rid, t0, t_sent, t_back), r in zip(rows, rpc):
        sub = done[rid]["submitted_epoch_ms"]
        parts["build"].append(t_sent - t0)
        parts["to server"].append(r["in_epoch_ms"] - t_sent)
        parts["to submit"].append(sub - r["in_epoch_ms"])
        d = done[rid]  # the load's own phases (lib/engine/load.ts); the query is the rest
        parts[" query"].append(sub - r["in_epoch_ms"] - d["admit_ms"] - d["prepare_ms"] - d["submit_ms"])
        parts[" load checks"].append(d["admit_ms"])
        parts[" lease"].append(d["lease_ms"])
        parts[" batch"].append(d["batch_ms"])
        parts[" submit"].append(d["submit_ms"])
        parts["answer"].append(t_back - sub)
        parts["total"].append(t_back - t0)
    table = {k: {"p50_ms": round(pct(v, 50), 3), "p90_ms": round(pct(v, 90), 3)} for k, v in parts.items()}
    print(f"QueryPrefetch + load_into of {HIT_BLOCKS} blocks x {LAYERS} layers, {a.runs} runs, host backend")
    print(f"{'part':<10} {'p50 ms':>8} {'p90 ms':>8}")
    for k, v in table.items():
        print(f"{k:<10} {v['p50_ms']:>8.3f} {v['p90_ms']:>8.3f}")
    out = a.out or os.path.join(HERE, "results", f"query-load-latency{'-' + a.tag if a.tag else ''}.json")
    with open(out, "w") as f:
        json.dump({
            "command": "python3 bench/query_load_latency.py " + " ".join(sys.argv[1:]),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "blocks": HIT_BLOCKS, "layers": LAYERS, "runs": a.runs, "gap_ms": a.gap_ms,
            "stored_prompts": a.stored_prompts,
            "parts": table,
        }, f, indent=1)
    print("json:", out)


if __name__ == "__main__":
    main()
