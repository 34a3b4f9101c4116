"""Decode at 0 % hits with the connector's save path varied: which part of PegaFlow's cost a decode
step pays, and where.

bench/ttft.py compares PegaFlow on against off; this runs, on one engine and in a rotating order:
  off     the engine with its connector detached (as ttft.py's "off")
  on      PegaFlow on, as configured (the save gate: worker_core.SAVE_GATE_S)
  nogate  PegaFlow on with pegaflow.save_gate_ms 0 (a step's Save sent as soon as its KV is written)
  late    a probe: no gate, and the save thread sleeps --late-ms after the step's event before it
          sends (its Python moved into the next step's launch, where the GPU has queued work)
Per variant: the decode phase's tokens/s, the mean step, the engine thread's time between steps
(schedule, the scheduler → worker pickle, prepare, bind, the output's pickle and update: the GPU
idles through it), the step time's excess over off by position in a block (a block completes
every block_size steps: the save steps), and where the save thread's Saves were sent and answered:
the share that fell between steps (from a step's sampled token to the next step's forward launch).
Llama-3.1-8B shape on CUDA, or the tiny model on the host.

    python3 bench/decode_variants.py [--rounds 16] [--variants off,on,nogate,late] [--backend host]

Prints a table and writes bench/results/decode-variants.json. Never asserts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ttft  # noqa: E402

#: The phases of a step the engine thread runs while the GPU idles (ttft.STEP_PHASES names).
BETWEEN = ("sched", "to_runner", "prepare", "pre_fwd", "update")
VARIANTS = ("off", "on", "nogate", "late")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Prints a table and writes the JSON to --out."
    )
    ap.add_argument("--rounds", type=int, default=16, help="rounds of every variant, in a rotating order")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"a comma-separated subset of {VARIANTS}")
    ap.add_argument("--late-ms", type=float, default=4.0, help="the late probe's sleep after the step's event")
    ap.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decode-variants.json"))
    a = ap.parse_args()
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad or "off" not in names:
        raise SystemExit(f"--variants: {bad or 'off is needed'}; choose from {VARIANTS}, off among them")
    args = ttft.parse_args(["--backend", a.backend, "--runs", "1", "--skip-transformers"])
    b = ttft.Bench(args)
    uds = tempfile.mkdtemp(prefix="pf-decode-variants-")
    try:
        b.server, b.server_addr = ttft.start_server(args.backend, args.pool_size, args.transfer_path, uds)
    except BaseException:
        shutil.rmtree(uds, ignore_errors=True)
        raise
    try:
        model = ttft.LlamaModel(b.cfg, b.dev, seed=0)
        eng = b.engine("layerwise", model=model)
        try:
            runs = measure(b, eng, names, a.rounds, a.late_ms / 1e3)
        finally:
            eng.shutdown()
    finally:
        b.server.stop(grace_s=15)
        b.server.remove_log()
        shutil.rmtree(uds, ignore_errors=True)
        for r in b.regions:
            r.close()
    res = summarize(runs, b.cfg.block_size)
    res.update(device=b.result["device"], config=args.config, rounds=a.rounds, late_ms=a.late_ms,
               decode_requests=args.decode_requests, decode_tokens=args.decode_tokens,
               command="python3 bench/decode_variants.py " + " ".join(sys.argv[1:]))  # fmt: skip
    print_table(res)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"json: {a.out}")


def measure(b: ttft.Bench, eng, names: list[str], rounds: int, late_s: float) -> dict[str, list]:
    """Each variant's decode runs (ttft.DecodeRun), one warm-up each, then `rounds` rounds."""
    core = eng.worker_connector._w()
    gate, real_save = core.save_gate_s, core._save
    client_save = core.client.save
    saves: list[tuple[float, float]] = []  # (sent, answered), perf_counter

    def timed_save(**kw):
        t = time.perf_counter()
        try:
            return client_save(**kw)
        finally:
            saves.append((t, time.perf_counter()))

    core.client.save = timed_save
    windows: list[tuple[float, float]] = []  # the engine thread between steps, perf_counter
    real_step = eng.step

    def step():
        out = real_step()
        ph = eng.last_runner_output.phases
        if ph:
            windows.append((ph["sampled"], ph["updated"]))  # this step's tail ...
            windows.append((ph["schedule_start"], ph["pre_forward_done"]))  # ... and its head
        return out

    eng.step = step

    def late_save(job):  # the probe: the step's event, then a sleep, then the Save as usual
        if job.event is not None:
            job.event.synchronize()
            time.sleep(late_s)
            job = replace(job, event=None)
        real_save(job)

    def on(gate_s: float, save=None):
        def run():
            core.save_gate_s = gate_s
            if save is not None:
                core._save = save
            saves.clear()
            windows.clear()
            try:
                r = b.decode_run(eng)
                eng.drain()
                return r + (between_share(saves, windows),)
            finally:
                core.save_gate_s, core._save = gate, real_save

        return run

    variants = {
        "off": lambda: b.decode_detached(eng),
        "on": on(gate),
        "nogate": on(0.0),
        "late": on(0.0, late_save),
    }
    variants = {k: variants[k] for k in names}
    for run in variants.values():
        run()  # warm-up
    out: dict[str, list] = {k: [] for k in variants}
    orders = list(itertools.permutations(variants))
    for i in range(rounds):
        for k in orders[(7 * i) % len(orders)]:
            out[k].append(variants[k]())
    return out


def between_share(saves: list[tuple[float, float]], windows: list[tuple[float, float]]) -> tuple[int, int, int]:
    """(Saves, how many were sent between steps, how many were answered between steps)."""
    ws = sorted(windows)

    def between(t: float) -> bool:
        return any(a <= t < b for a, b in ws)

    return len(saves), sum(between(s) for s, _ in saves), sum(between(e) for _, e in saves)


def summarize(runs: dict[str, list], block_size: int) -> dict:
    res: dict = {"variants": {}}
    by_index = {k: [statistics.fmean(c) for c in zip(*(r[2] for r in rs))] for k, rs in runs.items()}
    for k, rs in runs.items():
        between = [sum(x) for r in rs for x in zip(*(r[3][n] for n in BETWEEN))]
        v = {
            "decode_tokens_per_s": [r[0] for r in rs],
            "step_ms_mean": statistics.fmean(x for r in rs for x in r[2]),
            "between_steps_ms_mean": statistics.fmean(between) if between else float("nan"),
            "phase_ms_mean": {n: statistics.fmean(x for r in rs for x in r[3][n]) for n, _, _ in ttft.STEP_PHASES
                              if any(r[3][n] for r in rs)},  # fmt: skip
            "step_ms_by_index": [round(x, 4) for x in by_index[k]],
        }
        if k != "off":
            n, sent, answered = (sum(r[4][i] for r in rs) for i in range(3))
            v["saves"] = n
            v["saves_sent_between_steps"] = sent / max(1, n)
            v["saves_answered_between_steps"] = answered / max(1, n)
        if k != "off":
            slower = [1 - x[0] / y[0] for x, y in zip(rs, runs["off"])]
            lo, hi = ttft.mean_ci95(slower)
            gap = [x - y for x, y in zip(by_index[k], by_index["off"])]
            v["slower_than_off"] = statistics.fmean(slower)
            v["slower_than_off_ci95"] = [lo, hi]
            # The excess step time by position in a block: a block completes every block_size steps.
            v["excess_ms_by_block_position"] = [
                round(statistics.fmean(gap[m::block_size]), 4) for m in range(min(block_size, len(gap)))
            ]
        res["variants"][k] = v
    return res


def print_table(res: dict) -> None:
    vs = res["variants"]
    off = vs["off"]
    print(f"decode, {res['decode_requests']} requests x {res['decode_tokens']} tokens, {res['rounds']} rounds ({res['device']})")
    print(f"{'variant':8} {'slower than off':>22} {'step ms':>8} {'between steps ms':>17} {'excess ms, block positions':>30}"
          f" {'Saves sent / answered between steps':>38}")
    for k, v in vs.items():
        if k == "off":
            print(f"{k:8} {'':>22} {v['step_ms_mean']:8.3f} {v['between_steps_ms_mean']:17.3f}")
            continue
        lo, hi = v["slower_than_off_ci95"]
        cell = f"{100 * v['slower_than_off']:+.2f} % ({100 * lo:+.1f}..{100 * hi:+.1f})"
        ex = v["excess_ms_by_block_position"]
        print(
            f"{k:8} {cell:>22} {v['step_ms_mean']:8.3f} {v['between_steps_ms_mean']:17.3f}"
            f"  mean {statistics.fmean(ex):+.3f}, max {max(ex):+.3f} at {ex.index(max(ex))}"
            f"   {100 * v['saves_sent_between_steps']:5.1f} % / {100 * v['saves_answered_between_steps']:5.1f} % of {v['saves']}"
        )
    print("(between steps, over off: " + ", ".join(
        f"{k} {v['between_steps_ms_mean'] - off['between_steps_ms_mean']:+.3f} ms" for k, v in vs.items() if k != "off") + ")")


if __name__ == "__main__":
    main()
