"""The mini engine as `tp_size` shard processes (one per TP rank, a gloo group, rank 0 the
driver) against one host-backend server serving a device per rank: each rank registers its own
device and saves and loads only its own KV heads. A cold request saves; after a prefix-cache
reset and a scribble over every rank's cache, the warm request hits PegaFlow, every rank's
blocks come back byte-equal, and the tokens and logits equal the cold run's."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from leaks import kill_and_clean
from server_proc import ServerProc
from tiny_model import TINY

HERE = os.path.dirname(os.path.abspath(__file__))
#: Both ranks together: start-up (torch import, a gloo group) and two requests on a loaded machine.
RANKS_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def tp_server():
    s = ServerProc.start(extra=["--devices", "0,1"])
    yield s
    s.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(server: ServerProc, tp: int, uid: str, mode: str, out: str) -> dict:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "minivllm_tp_rank.py"), str(r), str(tp), str(port),
             server.addr, uid, mode, out],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for r in range(tp)
    ]
    logs = []
    for r, p in enumerate(procs):
        try:
            text, _ = p.communicate(timeout=RANKS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_and_clean(q)  # a killed rank leaves its KV region files
            raise
        logs.append(text.decode(errors="replace"))
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[-1][-4000:]}"
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "mode", ["layerwise", "async", "layerwise+staging", "layerwise+staging+query", "async+noengineid"]
)
def test_tp2_shard_processes_save_and_load_their_own_heads_and_warm_equals_cold(tp_server, uid, mode, tmp_path):
    r = run_ranks(tp_server, 2, uid, mode, str(tmp_path / "result.json"))
    assert r["cold_external"] == 0
    assert r["warm_external"] == r["expected_external"] > 0
    assert r["warm_tokens"] == r["cold_tokens"]
    assert r["logits_max_diff"] <= 1e-4
    assert r["differing_layers"] == []
    # Each rank's cache holds its half of the KV heads.
    assert all(s[3] == TINY.num_kv_heads // 2 for s in r["kv_shapes"]), r["kv_shapes"]
    assert r["loads_per_rank"] == 1
    assert r["query_loads"] == (1 if mode.endswith("+query") else 0), "one query started both ranks' loads"
    # Each rank registered its own device with the server.
    devices = {
        int(m.group(2))
        for m in re.finditer(r'"msg":"rank registered","instance":"([^"]+)".*?"device":(\d+)', tp_server.logs())
        if m.group(1) == f"{uid}-tp2"
    }
    assert devices == {0, 1}
    # Both ranks registered with the engine's one engine id: the one configured, or (none
    # configured) the uuid4 the driver's config made, handed to the other rank.
    engine_ids = [
        j.get("engine_id")
        for j in map(json.loads, (l for l in tp_server.logs().splitlines() if '"rank registered"' in l))
        if j["instance"] == f"{uid}-tp2"
    ]
    assert len(engine_ids) == 2 and len(set(engine_ids)) == 1, engine_ids
    if "+noengineid" in mode:
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", engine_ids[0]), engine_ids
    else:
        assert engine_ids[0] == f"{uid}-tp2"
