"""The host side of a decode step with PegaFlow on vs off, without a GPU: what the connector's
calls add to a launch-bound step.

On the H100 a decode step of the 8B shape is launch-bound (the GPU waits for the host), so every
microsecond the connector spends on the engine's thread is a microsecond of the step. This runs
the vLLM-shaped engine on the CPU with its model replaced by a stub of the same shape on the
host: per layer a small torch op, the connector's `wait_for_layer_load`, another op,
`save_kv_layer`, a third op (the dense halves and the attention of a real layer), and tiny
logits. What remains of a step is the engine's own host work (schedule, the scheduler → worker
pickle, prepare) and, with PegaFlow on, the connector's. A real host-backend server runs beside
it and every new block is saved, as in bench/ttft.py's decode; "off" is the same engine with its
connector detached. Rounds alternate on/off; per-step host times, medians.

    /usr/bin/python3 bench/decode_host.py [--layers 32] [--requests 32] [--rounds 16]

Prints a table and writes bench/results/decode-host.json. Never asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import ttft  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Prints a table and writes the JSON to --out."
    )
    ap.add_argument("--layers", type=int, default=32, help="layers of the stub model (the 8B shape has 32)")
    ap.add_argument("--requests", type=int, default=32, help="requests decoding together")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per run")
    ap.add_argument("--rounds", type=int, default=16, help="on and off runs each, alternated")
    out = os.path.join(HERE, "results", "decode-host.json")
    ap.add_argument("--out", default=out, help=f"the JSON file (default {out})")
    a = ap.parse_args()
    torch.set_num_threads(1)
    args = ttft.parse_args([
        "--backend", "host", "--pool-size", "512mb", "--skip-transformers", "--decode-repeats", str(a.rounds),
        "--decode-tokens", str(a.tokens), "--decode-prompt", "32",
    ])  # fmt: skip
    args.decode_requests = a.requests  # ttft caps a CPU run's decode at 8 requests; this one has no model
    b = ttft.Bench(args)
    b.cfg = dataclasses.replace(b.cfg, num_layers=a.layers)
    uds_dir = tempfile.mkdtemp(prefix="pf-decode-host-")
    try:
        b.server, b.server_addr = ttft.start_server("host", args.pool_size, None, uds_dir)
    except BaseException:
        shutil.rmtree(uds_dir, ignore_errors=True)
        raise
    try:
        model = ttft.LlamaModel(b.cfg, b.dev, seed=0)
        scratch = torch.zeros(64)

        def forward(batch, kv_caches, hooks=None, planes=None):  # noqa: ANN001, ANN202
            for i in range(len(kv_caches)):
                scratch.add_(1.0)  # the layer's "pre" graph
                if hooks is not None:
                    hooks.pre_attention(i)
                scratch.mul_(0.5)  # its attention
                if hooks is not None:
                    hooks.post_attention(i, kv_caches[i])
                scratch.add_(1.0)  # its "post" graph
            return torch.zeros(len(batch.logits_indices), 1)

        model.forward = forward  # type: ignore[method-assign]
        model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], 16)  # type: ignore[method-assign]
        eng = b.engine("layerwise", model=model)
        try:
            runs = {"on": lambda: b.decode_run(eng), "off": lambda: b.decode_detached(eng)}
            for run in runs.values():
                run()  # warm-up
            steps: dict[str, list[float]] = {k: [] for k in runs}
            phases: dict[str, dict[str, list[float]]] = {k: {n: [] for n, _, _ in ttft.STEP_PHASES} for k in runs}
            per_round: list[float] = []
            server_cpu = {k: 0.0 for k in runs}  # seconds of the server's CPU during each variant's runs
            for i in range(a.rounds):
                got = {}
                for k in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    cpu0 = b.server.cpu_seconds()
                    run = runs[k]()
                    server_cpu[k] += b.server.cpu_seconds() - cpu0
                    got[k] = run[2]
                    steps[k].extend(got[k])
                    for n, v in run[3].items():
                        phases[k][n].extend(v)
                per_round.append((statistics.median(got["on"]) - statistics.median(got["off"])) * 1e3)
            stats = eng.worker_connector.pegaflow_stats()
        finally:
            eng.shutdown()
    finally:
        b.server.stop()
        b.server.remove_log()
        shutil.rmtree(uds_dir, ignore_errors=True)
        for r in b.regions:  # the engine's KV cache files in /dev/shm
            r.close()
    res = {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "layers": a.layers,
        "requests": a.requests,
        "steps_per_run": a.tokens - 1,
        "rounds": a.rounds,
        "step_us": {
            k: {"p50": statistics.median(v) * 1e3, "mean": statistics.fmean(v) * 1e3} for k, v in steps.items()
        },
        "server_cpu_us_per_step": {k: v * 1e6 / max(1, len(steps[k])) for k, v in server_cpu.items()},
        "phase_us_p50": {k: {n: statistics.median(v) * 1e3 for n, v in ph.items() if v} for k, ph in phases.items()},
        "on_minus_off_us_per_round": per_round,
        "on_minus_off_us": statistics.median(per_round),
        "saves": stats.get("saves", 0),
        "blocks_saved": stats.get("blocks_saved", 0),
    }
    print(f"decode step, host side only ({a.layers} layers, {a.requests} requests, {a.rounds} rounds each)")
    print(f"{'':8} {'p50 us':>9} {'mean us':>9}")
    for k, v in res["step_us"].items():
        print(f"{k:8} {v['p50']:9.1f} {v['mean']:9.1f}")
    ph = res["phase_us_p50"]
    print("step phases, us p50 (on / off / on - off): " + ", ".join(
        f"{n} {ph['on'][n]:.1f} / {ph['off'][n]:.1f} / {ph['on'][n] - ph['off'][n]:+.1f}" for n in ph["on"]))
    sc = res["server_cpu_us_per_step"]
    print(f"server CPU per step (ticks of 10 ms, summed over the runs): on {sc['on']:.1f} us, off {sc['off']:.1f} us")
    print(f"PegaFlow's calls add {res['on_minus_off_us']:.1f} us a step (median of the rounds' p50 differences; "
          f"rounds {min(per_round):.0f}..{max(per_round):.0f}); {res['saves']} saves, {res['blocks_saved']} blocks")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"json: {a.out}")


if __name__ == "__main__":
    main()
