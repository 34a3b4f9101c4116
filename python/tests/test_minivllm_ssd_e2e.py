"""The SSD tier under the mini engine, end to end on the CPU: a prefix saved by a cold request
is written behind to SSD, evicted from the server's RAM, and the warm request's query answers
"loading" while the server reads it back; the connector answers the engine "not yet" and asks
again (after a pause: connector/scheduler_core.py, tests/test_core_scheduler.py), then loads the
prefix byte-equal and the warm request gives the cold tokens."""

from __future__ import annotations

import random
import time

from minivllm_runs import cold_then_warm, pega_engine, regions  # noqa: F401 (regions: a fixture)
from server_proc import ServerProc
from tiny_model import TINY, model  # noqa: F401 (model: a fixture)


def test_a_prefix_evicted_to_ssd_comes_back_through_loading_answers(model, regions, uid, tmp_path):
    s = ServerProc.start(extra=[
        "--http-addr", "127.0.0.1:0", "--ssd-cache-path", str(tmp_path), "--ssd-cache-capacity", "128mb",
        "--ssd-segment-size", "4mb",
    ])
    eng = pega_engine(model, s, regions, uid, "layerwise", "worker")
    rng = random.Random(uid)
    prompt = [rng.randrange(TINY.vocab_size) for _ in range(150)]
    nfull = (len(prompt) - 1) // TINY.block_size

    def evict_to_ssd() -> None:
        deadline = time.monotonic() + 30
        while s.metric("pegaflow_ssd_write_blocks_total") < nfull:
            assert time.monotonic() < deadline, "the prefix was not written behind to SSD in 30 s"
            time.sleep(0.02)
        assert s.post("/cache/memory/cleanup") == 200

    try:
        cold_then_warm(eng, prompt, tol=1e-4, before_warm=evict_to_ssd)
        st = eng.scheduler_connector.pegaflow_stats()
        assert st["query_loading"] >= 1, st
        assert s.metric("pegaflow_ssd_read_blocks_total") >= nfull
        assert s.metric("pegaflow_ssd_checksum_failures_total") == 0
        eng.drain(timeout_s=60)
    finally:
        eng.shutdown()
        s.stop()
