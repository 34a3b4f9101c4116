"""Does the PCIe link idle? A plain pinned H2D copy with torch (no PegaFlow) of a 10K-token
Llama-3.1-8B prefix's KV (639 blocks, 1.34 GB) in 32 layer pieces, after idle gaps of 0-1000 ms;
then with matmuls on another stream, with a 4 KB copy every 10 ms during the gap, and with another
stream blocked on a load state's word the whole time (the engine's GPU-side layer waits: the GPU
polls that host page across the same link). Prints one
line per case and writes the per-gap times as JSON (default bench/results/h2d-idle-gap.json).
Needs a GPU:

    python3 bench/h2d_idle_gap.py [OUT.json]
"""

import argparse
import json
import os
import subprocess
import time

LAYERS = 32
PER_LAYER = 639 * 2 * 16 * 8 * 128 * 2  # blocks x K/V x tokens x kv heads x head dim x bf16
GAPS_S = [0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
REPS = 8


DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h2d-idle-gap.json")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=f"Writes OUT.json (default {DEFAULT_OUT}).",
    )
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT, metavar="OUT.json", help="where to write the JSON")
    a = ap.parse_args()
    import torch  # after the arguments: --help needs no GPU stack

    dev = torch.device("cuda")
    host = torch.empty(LAYERS * PER_LAYER, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    gpu = torch.empty(LAYERS * PER_LAYER, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream()

    def copy_once() -> tuple[float, float]:
        """(whole copy, first layer) in ms by CUDA events."""
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(LAYERS + 1)]
        with torch.cuda.stream(stream):
            evs[0].record(stream)
            for i in range(LAYERS):
                part = slice(i * PER_LAYER, (i + 1) * PER_LAYER)
                gpu[part].copy_(host[part], non_blocking=True)
                evs[i + 1].record(stream)
        evs[-1].synchronize()
        return evs[0].elapsed_time(evs[-1]), evs[0].elapsed_time(evs[1])

    def link() -> str:
        q = "pcie.link.gen.current,pcie.link.width.current,clocks.sm,pstate"
        try:
            r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10)
            return r.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"nvidia-smi: {e}"

    def summary(label: str, ts: list[float]) -> None:
        s = sorted(ts)
        print(f"{label}: copy p50 {s[len(s) // 2]:.2f} min {s[0]:.2f} max {s[-1]:.2f} ms", flush=True)

    for _ in range(3):
        copy_once()
    out = {}
    for gap in GAPS_S:
        runs = []
        for _ in range(REPS):
            time.sleep(gap)
            runs.append(copy_once())
        tot, first = sorted(t[0] for t in runs), sorted(t[1] for t in runs)
        out[str(gap)] = {"total_ms": [round(x, 2) for x in tot], "first_layer_ms": [round(x, 3) for x in first]}
        summary(f"gap {gap * 1e3:6.0f} ms", tot)
    time.sleep(1)
    link_state = link()
    print("link after 1 s idle:", link_state)

    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    other = torch.cuda.Stream()
    busy = []
    for _ in range(REPS):
        time.sleep(0.2)
        with torch.cuda.stream(other):
            for _ in range(40):
                x @ x
        busy.append(copy_once()[0])
    summary("gap 200 ms + matmuls on another stream", busy)

    tiny = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    tiny_gpu = torch.empty(4096, dtype=torch.uint8, device=dev)
    kept = []
    for _ in range(REPS):
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            tiny_gpu.copy_(tiny, non_blocking=True)
            torch.cuda.synchronize()
            time.sleep(0.01)
        kept.append(copy_once()[0])
    summary("gap 200 ms with a 4 KB copy every 10 ms", kept)

    waited = gpu_waits_case(torch, dev, copy_once)
    if waited:
        summary("gap 200 ms, another stream waiting on a load state's word", waited)

    with open(a.out, "w") as f:
        json.dump({
            "command": "python3 bench/h2d_idle_gap.py",
            "device": torch.cuda.get_device_name(),
            "link_after_1s_idle": link_state,
            "gaps_s": out,
            "busy_ms": busy,
            "kept_warm_ms": kept,
            "gpu_wait_ms": waited,
        }, f, indent=1)


def gpu_waits_case(torch, dev, copy_once) -> list[float]:
    """Whole-copy times while another stream waits on a load state's `layers_ready` word, one
    `cuStreamWaitValue32` per layer as the connector enqueues them (pegaflow.gpu_wait), released
    only after the copy: does the GPU's polling of that host page slow the copy it waits for?
    [] where the driver has no stream memory operations."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from pegaflow.gpu_wait import GpuWaits
    from pegaflow.load_state import LoadState

    gw = GpuWaits.open()
    if gw is None:
        return []
    other, times = torch.cuda.Stream(), []
    try:
        for _ in range(REPS):
            time.sleep(0.2)
            st = LoadState.create()
            if not gw.arm(st):
                st.close()
                return []
            with torch.cuda.stream(other):
                for layer in range(LAYERS):
                    gw.wait(st, layer)
            times.append(copy_once()[0])
            st.release_waiters()
            with torch.cuda.stream(other):
                gw.retire(st, then=gw.close_later)
            gw.reap(block=True)
            torch.cuda.synchronize(dev)
            gw.close_idle(force=True)
    finally:
        gw.close()
    return times


if __name__ == "__main__":
    main()
