"""End to end on the CPU: the mini engine with `PegaflowConnector` against a real host-backend
server (the KV cache lives in shared-memory files the server maps). A cold request saves its
blocks; after `reset_prefix_cache()` the same prompt must hit PegaFlow, load blocks byte-equal
to the saved ones, and give the cold request's tokens and logits — in both connector modes and
with either load issuer (the scheduler sends the Load, or the worker does)."""

from __future__ import annotations

import random

import pytest

from pegaflow.connector.vllm_api import RequestStatus
from pegaflow.minivllm import EngineConfig, LLMEngine

from minivllm_runs import cold_then_warm, pega_engine, regions  # noqa: F401 (regions: a fixture)
from tiny_model import TINY, model  # noqa: F401 (model: a fixture)


@pytest.mark.parametrize(
    "mode,issuer,staging",
    [
        ("layerwise", "scheduler", 0),
        ("layerwise", "worker", 0),
        ("async", "scheduler", 0),
        ("async", "worker", 0),
        ("layerwise", "scheduler", 32),  # through staging blocks (connector/staging.py)
        ("layerwise", "query", 32),  # the load rides on the probe (connector/query_issuer.py)
    ],
)
def test_a_warm_request_after_reset_hits_pegaflow_and_matches_the_cold_one(
    model, server, regions, uid, mode, issuer, staging
):
    rng = random.Random(uid)
    prompt = [rng.randrange(TINY.vocab_size) for _ in range(150)]
    eng = pega_engine(model, server, regions, uid, mode, issuer, staging)
    try:
        assert eng.scheduler_connector.settings.load_issuer == issuer
        _, warm, seen = cold_then_warm(eng, prompt, tol=1e-4)
        if mode == "async":
            assert RequestStatus.WAITING_FOR_REMOTE_KVS in seen
        sent_by_scheduler = eng.scheduler_connector.pegaflow_stats().get("loads_issued", 0)
        assert sent_by_scheduler == (1 if issuer == "scheduler" else 0)
        started_by_query = eng.scheduler_connector.pegaflow_stats().get("query_loads", 0)
        assert started_by_query == (1 if issuer == "query" else 0)
        assert eng.worker_connector.pegaflow_stats()["loads"] == 1
        eng.drain(timeout_s=60)
    finally:
        eng.shutdown()


def test_the_mini_engine_schedules_synchronously_so_the_scheduler_issues_loads_by_default(model, server, regions, uid):
    eng = pega_engine(model, server, regions, uid, "layerwise")
    try:
        assert eng.vllm_config.scheduler_config.async_scheduling is False
        assert eng.scheduler_connector.settings.load_issuer == "scheduler"
    finally:
        eng.shutdown()


def test_an_engine_with_pegaflow_gives_the_tokens_of_a_plain_engine(model, server, regions, uid):
    rng = random.Random(uid)
    prompts = [[rng.randrange(TINY.vocab_size) for _ in range(40 + 17 * i)] for i in range(3)]
    plain = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64), model=model)
    want = [o.output_token_ids for o in plain.generate(prompts, max_tokens=6)]
    eng = pega_engine(model, server, regions, uid, "layerwise")
    try:
        got = [o.output_token_ids for o in eng.generate(prompts, max_tokens=6, timeout_s=60)]
        eng.drain(timeout_s=60)
    finally:
        eng.shutdown()
    assert got == want


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_the_layer_hooks_run_only_in_a_layer_wise_step_with_a_load(model, server, regions, uid, mode):
    """vLLM calls `wait_for_layer_load` and `save_kv_layer` around every attention op only while
    `has_connector_metadata()` is True (kv_transfer_utils.maybe_transfer_kv_layer). Saves go in
    one Save after the step, so the hooks matter only for a layer-wise step's loads: a decode
    step must not pay two calls per layer, and the warm step must still wait for every layer."""
    rng = random.Random(uid)
    prompt = [rng.randrange(TINY.vocab_size) for _ in range(150)]
    eng = pega_engine(model, server, regions, uid, mode)
    conn = eng.worker_connector
    per_step: list[list[bool]] = []
    hooks: list[int] = []
    bind, waited, saved = conn.bind_connector_metadata, conn.wait_for_layer_load, conn.save_kv_layer

    def bind_and_note(meta):  # noqa: ANN001, ANN202
        bind(meta)
        per_step.append([conn.has_connector_metadata(), bool(meta.plan.loads)])
        hooks.append(0)

    def count(fn):  # noqa: ANN001, ANN202
        def hook(*a, **k):  # noqa: ANN002, ANN003, ANN202
            hooks[-1] += 1
            return fn(*a, **k)
        return hook

    conn.bind_connector_metadata = bind_and_note
    conn.wait_for_layer_load, conn.save_kv_layer = count(waited), count(saved)
    try:
        cold_then_warm(eng, prompt, tol=1e-4, max_tokens=5)
        eng.drain(timeout_s=60)
    finally:
        eng.shutdown()
    steps = list(zip(per_step, hooks))
    loaded = [s for s in steps if s[0][1]]
    assert len(loaded) == 1, steps  # the warm request's load, in one step
    gated = mode == "layerwise"
    assert loaded[0] == ([gated, True], 2 * TINY.num_layers if gated else 0)
    others = [s for s in steps if not s[0][1]]
    assert len(others) >= 8, steps  # cold prefill and decode, warm decode
    assert all(s == ([False, False], 0) for s in others), steps
    assert not conn.has_connector_metadata()  # cleared after the last step
