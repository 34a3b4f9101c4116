"""Chart of peer-fetch benchmark runs (bench/peer_fetch.ts writes the JSON).

    python3 bench/peer_chart.py OUT.png RUN.json [RUN.json ...]

Left: per benchmark run, the raw TCP rate of the path beside the peer fetch
and its READ alone (medians of the run's fetches), the fetch's share of raw
written above it, and the 90 % target as a line over each raw bar. Right: each
fetch of every run as a bar of its phases (lookup, lock, READ, the rest) with
the raw stream's time for the same bytes as a tick: what separates the two.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List

TARGET = 0.90
PHASES = [("lookup_ms", "index lookup", "tab:purple"), ("lock_ms", "lock on the owner", "tab:red"),
          ("read_ms", "READ (wire)", "tab:blue")]  # fmt: skip


def load(paths: List[str]) -> List[Dict[str, Any]]:
    runs = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        for k in ("bytes", "rawGBps", "fetchGBps", "readGBps", "runs"):
            if k not in d:
                raise SystemExit(f"{p}: not a bench/peer_fetch.ts result (no '{k}')")
        d["name"] = os.path.splitext(os.path.basename(p))[0]
        runs.append(d)
    return runs


def draw(runs: List[Dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [1, 1.4]})
    w = 0.27
    for i, r in enumerate(runs):
        ax1.bar(i - w, r["rawGBps"], w, color="tab:gray", label="raw TCP, same path" if i == 0 else None)
        ax1.bar(i, r["fetchGBps"], w, color="tab:green", label="peer fetch" if i == 0 else None)
        ax1.bar(i + w, r["readGBps"], w, color="tab:blue", label="its READ alone" if i == 0 else None)
        ax1.hlines(TARGET * r["rawGBps"], i - 1.5 * w, i + 1.5 * w, colors="black", linestyles="dashed",
                   label="90 % of raw" if i == 0 else None)  # fmt: skip
        ax1.text(i, r["fetchGBps"], f"{100 * r['fetchGBps'] / r['rawGBps']:.0f} %", ha="center", va="bottom")
    ax1.set_xticks(range(len(runs)))
    ax1.set_xticklabels([r["name"] for r in runs], rotation=20, ha="right", fontsize=8)
    ax1.set_ylabel("GB/s (median of the run's fetches)")
    first = runs[0]
    ax1.set_title(f"{first['blocks']} blocks, {first['bytes'] / 2**20:.0f} MiB, {first['streams']} streams, "
                  f"{first['cores']} cores")  # fmt: skip
    ax1.legend(fontsize=8, loc="lower left")

    y = 0
    labels = []
    for r in runs:
        for k, f in enumerate(r["runs"]):
            left = 0.0
            for key, name, color in PHASES:
                v = f["phases"][key]
                ax2.barh(y, v, left=left, color=color, label=name if y == 0 else None)
                left += v
            rest = f["phases"]["total_ms"] - left
            ax2.barh(y, max(rest, 0), left=left, color="tab:orange", label="plan start, checks, commit" if y == 0 else None)
            ax2.plot([f["rawNs"] / 1e6] * 2, [y - 0.4, y + 0.4], color="black", lw=2,
                     label="raw TCP, same bytes" if y == 0 else None)  # fmt: skip
            labels.append(f"{r['name']}#{k + 1}")
            y += 1
    ax2.set_yticks(range(len(labels)))
    ax2.set_yticklabels(labels, fontsize=6)
    ax2.invert_yaxis()
    ax2.set_xlabel("ms (the fetch's phases on the requester; tick: the raw stream)")
    ax2.set_title("each fetch", pad=28)
    ax2.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=5, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"chart: {out}")


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Writes OUT.png (nothing where matplotlib is missing).",
    )
    ap.add_argument("out", metavar="OUT.png", help="the chart to write")
    ap.add_argument("runs", metavar="RUN.json", nargs="+", help="bench/peer_fetch.ts results, one bar group each")
    a = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed: chart skipped")
        return
    draw(load(a.runs), a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
