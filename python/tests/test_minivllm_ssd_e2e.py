"""The SSD tier under the mini engine, end to end on the CPU: a prefix saved by a cold request
is written behind to SSD, evicted from the server's RAM, and the warm request's query answers
"loading" while the server reads it back; the connector answers the engine "not yet" and asks
again once the server answered its WaitPrefetch (the read ended: connector/scheduler_core.py,
tests/test_core_scheduler.py) — or, with waiting off, after pauses — then loads the prefix
byte-equal and the warm request gives the cold tokens."""

from __future__ import annotations

import random
import time

import pytest
from minivllm_runs import cold_then_warm, pega_engine, regions  # noqa: F401 (regions: a fixture)
from server_proc import ServerProc
from tiny_model import TINY, model  # noqa: F401 (model: a fixture)


@pytest.mark.parametrize("wait_ms", [None, 0], ids=["wait", "poll"])
def test_a_prefix_evicted_to_ssd_comes_back_through_loading_answers(model, regions, uid, tmp_path, wait_ms):
    s = ServerProc.start(extra=[
        "--http-addr", "127.0.0.1:0", "--ssd-cache-path", str(tmp_path), "--ssd-cache-capacity", "128mb",
        "--ssd-segment-size", "4mb",
    ])
    extra = {} if wait_ms is None else {"loading_wait_ms": wait_ms}
    eng = pega_engine(model, s, regions, uid, "layerwise", "worker", **extra)
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
        if wait_ms is None:
            # Each "loading" is followed by one wait and one query once it is answered (the read
            # ended, or the hold passed and it is asked again): the cold miss, the loadings, the hit.
            assert st["waits"] == st["query_loading"] and st.get("wait_errors", 0) == 0, st
            assert st["queries"] == st["query_loading"] + 2, st
        else:
            assert st.get("waits", 0) == 0, st
        assert s.metric("pegaflow_ssd_read_blocks_total") >= nfull
        assert s.metric("pegaflow_ssd_checksum_failures_total") == 0
        eng.drain(timeout_s=60)
    finally:
        eng.shutdown()
        s.stop()
