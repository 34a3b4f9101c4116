"""Async mode: the worker read an async load's state word twice (poll(), then whether it was
unsettled). A copy ending between the two reads read as pending, then settled, and the load was
failed "load state ... ended with state 1": its request recomputed a prefix that had landed (seen
once in 20 warm async requests of a TTFT run on an H200, 331 ms against 44). The word is now read
once. The race is forced here by a poll() that always answers pending, as a read just before the
copy ended would."""

from __future__ import annotations

from pegaflow.hashes import synthetic_tokens
from pegaflow.load_state import LoadState

from vllm_driver import BLOCK, Request, saved_prompt


def test_an_async_load_that_ends_between_two_reads_of_its_state_is_not_failed(engine_factory, uid, monkeypatch):
    eng = engine_factory("async")
    prompt, used = saved_prompt(eng, 211, uid)  # 5 full blocks on the server
    monkeypatch.setattr(LoadState, "poll", lambda self: None)  # "pending" whatever the word says
    r = Request("r", prompt + synthetic_tokens(212, BLOCK + 1), salt=uid)
    assert eng.run_prefill(r, avoid=used) == 5 * BLOCK
    assert eng.invalid_blocks == set(), "a load that landed was failed and recomputed"
    assert eng.worker._w().stats.get("load_failures", 0) == 0
