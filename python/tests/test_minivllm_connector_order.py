"""The mini engine calls a KV connector in vLLM's order and handles its answers as vLLM's
scheduler does: sync loads, async loads (WAITING_FOR_REMOTE_KVS → finished_recving), "ask me
later" (None), load errors (recompute), delayed frees (finished_sending) and preemptions.

The connector here is `minivllm_recorder.RecordingConnector`, a double of vLLM's connector
contract that records calls and serves hits from an in-process store."""

from __future__ import annotations

import pickle

import pytest
import torch

from pegaflow.connector.vllm_api import KVTransferConfig, RequestStatus
from pegaflow.minivllm import EngineConfig, LLMEngine, LlamaModel

from tiny_model import TINY, model, prompt  # noqa: F401 (model: a fixture)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(TINY.num_layers)]
POST_FORWARD = [
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
]
LAYER_HOOKS = [m for name in LAYERS for m in (("wait_for_layer_load", name), ("save_kv_layer", name))]


def rec_engine(model: LlamaModel, log: list, store: dict, num_gpu_blocks: int = 64, **opts) -> LLMEngine:
    ktc = KVTransferConfig(
        kv_connector="RecordingConnector",
        kv_connector_module_path="minivllm_recorder",
        kv_role="kv_both",
        kv_connector_extra_config={"log": log, "store": store, **opts},
    )
    return LLMEngine(
        EngineConfig(model="tiny", num_gpu_blocks=num_gpu_blocks, kv_transfer_config=ktc), model=model
    )


def methods(log: list, role: str | None = None) -> list[str]:
    return [m for r, m, _ in log if role is None or r == role]


def steps(log: list) -> list[list[tuple]]:
    """The log cut into engine steps: a step ends with the scheduler's update_connector_output."""
    out: list[list[tuple]] = [[]]
    for e in log:
        out[-1].append(e)
        if e[1] == "update_connector_output":
            out.append([])
    return out[:-1] if not out[-1] else out


def run(eng: LLMEngine, p: list[int], max_tokens: int = 1):
    req = eng.add_request(p, max_tokens=max_tokens)
    for _ in range(100):
        eng.step()
        if req.is_finished():
            break
    assert req.is_finished(), req
    return req, eng.last_runner_output.logits[req.request_id]


def cold_then_reset(model: LlamaModel, log: list, store: dict, p: list[int], **opts):
    eng = rec_engine(model, log, store, **opts)
    cold, cold_logits = run(eng, p)
    assert eng.reset_prefix_cache()
    log.clear()
    return eng, cold, cold_logits


def test_register_kv_caches_gets_every_layer_in_execution_order(model):
    log: list = []
    rec_engine(model, log, {})
    assert log[0] == ("W", "register_kv_caches", LAYERS)


def test_a_sync_load_runs_in_vllm_order_and_gives_the_cold_token_and_logits(model):
    log: list = []
    store: dict = {}
    p = prompt(1, 150)
    eng, cold, cold_logits = cold_then_reset(model, log, store, p, mode="sync")
    assert len(store) == 9  # the cold request saved its 9 full blocks
    warm, warm_logits = run(eng, p)
    first = steps(log)[0]
    rid = warm.request_id
    assert log[:3] == [
        ("S", "on_new_request", rid),
        ("S", "get_num_new_matched_tokens", (rid, 0, 144)),
        ("S", "update_state_after_alloc", (rid, 144)),
    ]
    assert first[3][1] == "build_connector_meta"  # the end of schedule()
    assert [(m, d) for _, m, d in first[4:7]] == [
        ("handle_preemptions", []),
        ("bind_connector_metadata", first[3][2][0]),
        ("start_load_kv", [rid]),  # has_sync_kv_loads: before the forward
    ]
    assert [(m, d) for _, m, d in first[7 : 7 + len(LAYER_HOOKS)]] == LAYER_HOOKS
    rest = first[7 + len(LAYER_HOOKS) :]
    assert [m for _, m, _ in rest] == POST_FORWARD + ["request_finished", "update_connector_output"]
    assert warm.num_cached_tokens == 144 and warm.num_external_computed_tokens == 144
    assert warm.output_token_ids == cold.output_token_ids
    torch.testing.assert_close(warm_logits, cold_logits, rtol=1e-4, atol=1e-4)


def test_loaded_blocks_are_byte_equal_to_the_saved_ones(model):
    log: list = []
    store: dict = {}
    p = prompt(2, 100)
    eng, _, _ = cold_then_reset(model, log, store, p, mode="sync")
    eng.add_request(p)
    eng.step()
    (meta,) = [m for m in eng.worker_connector.bound_metas if m.loads]
    (load,) = meta.loads
    assert len(load.block_ids) == 6
    for bid, h in zip(load.block_ids, load.hashes):
        for name, t in eng.runner.kv_caches.items():
            assert torch.equal(t[0, bid], store[h][name][0])
            assert torch.equal(t[1, bid], store[h][name][1])


def test_an_async_load_waits_for_remote_kvs_then_runs_with_the_loaded_prefix(model):
    log: list = []
    store: dict = {}
    p = prompt(3, 150)
    eng, cold, cold_logits = cold_then_reset(model, log, store, p, mode="async")
    req = eng.add_request(p)
    eng.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.num_computed_tokens == 144
    s1 = steps(log)[0]
    # Nothing scheduled: vLLM's no_forward still runs the connector, start_load_kv after "forward",
    # and no wait_for_save (post_forward(..., wait_for_save=False): nothing was computed to save).
    assert [m for _, m, _ in s1] == [
        "on_new_request",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "handle_preemptions",
        "bind_connector_metadata",
        "start_load_kv",
        *[m for m in POST_FORWARD if m != "wait_for_save"],
        "update_connector_output",
    ]
    assert s1[-1][2] == ([], [req.request_id], [])  # finished_recving names it
    for _ in range(10):
        eng.step()
        if req.is_finished():
            break
    s2 = steps(log)[1]
    assert "get_num_new_matched_tokens" not in methods(s2)
    hooks = [(m, d) for _, m, d in s2 if m in ("wait_for_layer_load", "save_kv_layer")]
    assert hooks == LAYER_HOOKS
    ms = methods(s2)
    # No sync load this step: start_load_kv comes after the forward, before wait_for_save.
    assert ms.index("start_load_kv") > ms.index("save_kv_layer") and ms.index("start_load_kv") < ms.index(
        "wait_for_save"
    )
    assert req.num_cached_tokens == 144
    assert req.output_token_ids == cold.output_token_ids
    torch.testing.assert_close(eng.last_runner_output.logits[req.request_id], cold_logits, rtol=1e-4, atol=1e-4)


def test_a_none_answer_skips_the_request_for_that_step_and_asks_again(model):
    log: list = []
    eng = rec_engine(model, log, {}, none_first=2)
    req = eng.add_request(prompt(4, 40))
    eng.step()
    eng.step()
    assert req.status == RequestStatus.WAITING and req.num_computed_tokens == 0
    asks = [d for _, m, d in log if m == "get_num_new_matched_tokens"]
    assert asks == [(req.request_id, 0, None), (req.request_id, 0, None)]
    assert "update_state_after_alloc" not in methods(log)
    eng.step()
    assert req.is_finished()
    assert methods(log).count("update_state_after_alloc") == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_load_is_recomputed_and_gives_the_cold_output(model, mode):
    log: list = []
    store: dict = {}
    p = prompt(5, 150)
    eng, cold, cold_logits = cold_then_reset(model, log, store, p, mode=mode)
    eng.worker_connector.fail_loads = True
    req = eng.add_request(p, max_tokens=3)
    eng.step()
    invalid = [d[2] for _, m, d in log if m == "update_connector_output" and d[2]]
    assert len(invalid) == 1 and len(invalid[0]) == 9  # all 9 loaded blocks failed
    eng.worker_connector.fail_loads = False
    for _ in range(20):
        eng.step()
        if req.is_finished():
            break
    assert req.output_token_ids == run(rec_engine(model, [], {}), p, max_tokens=3)[0].output_token_ids
    if mode == "sync":
        # The failed step's token was discarded; the request recomputed from token 0.
        assert req.num_computed_tokens >= 150
        assert [d for _, m, d in log if m == "get_num_new_matched_tokens"] == [(req.request_id, 0, 144)]
    else:
        # Async: nothing was usable, so the request asked the connector again and loaded.
        asks = [d for _, m, d in log if m == "get_num_new_matched_tokens"]
        assert asks == [(req.request_id, 0, 144), (req.request_id, 0, 144)]
    assert req.output_token_ids[0] == cold.output_token_ids[0]


def test_a_delayed_free_keeps_blocks_until_finished_sending(model):
    log: list = []
    eng = rec_engine(model, log, {}, delay_free=True)
    req, _ = run(eng, prompt(6, 70))
    rid = req.request_id
    assert ("S", "request_finished", (rid, True)) in log
    assert rid in eng.kv_cache_manager.req_to_blocks  # held by the connector
    assert eng.reset_prefix_cache()  # drains: steps until finished_sending frees them
    assert rid not in eng.kv_cache_manager.req_to_blocks and rid not in eng.scheduler.requests
    sent = [d for _, m, d in log if m == "update_connector_output" and d[0]]
    assert sent == [([rid], [], [])]
    # The worker was told the request finished before it reported the save done.
    finished_calls = [d for _, m, d in log if m == "get_finished"]
    assert [rid] in finished_calls


def test_preempted_requests_reach_handle_preemptions_and_finish_with_their_solo_tokens(model):
    prompts = [prompt(20 + i, 40) for i in range(3)]
    solo = [run(rec_engine(model, [], {}), p, max_tokens=12)[0].output_token_ids for p in prompts]
    log: list = []
    eng = rec_engine(model, log, {}, num_gpu_blocks=10)
    reqs = [eng.add_request(p, max_tokens=12) for p in prompts]
    for _ in range(200):
        eng.step()
        if all(r.is_finished() for r in reqs):
            break
    assert [r.output_token_ids for r in reqs] == solo
    preempted = [(i, d) for i, (_, m, d) in enumerate(log) if m == "handle_preemptions" and d]
    assert preempted, "no preemption happened"
    for i, ids in preempted:
        assert log[i + 1][1] == "bind_connector_metadata"
        assert set(ids) <= {r.request_id for r in reqs}


def test_connector_metadata_reaches_the_worker_through_pickle(model):
    log: list = []
    eng = rec_engine(model, log, {})
    run(eng, prompt(7, 40))
    built = eng.scheduler_connector.built_metas
    bound = eng.worker_connector.bound_metas
    assert len(built) == len(bound) > 0
    for b, w in zip(built, bound):
        assert b is not w and b == w


def test_a_connector_whose_metadata_cannot_pickle_fails_the_step(model):
    eng = rec_engine(model, [], {})
    conn = eng.scheduler_connector
    build = conn.build_connector_meta

    def unpicklable(so):
        meta = build(so)
        meta.saves.append(lambda: None)
        return meta

    conn.build_connector_meta = unpicklable
    eng.add_request(prompt(8, 20))
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        eng.step()


def test_an_engine_without_a_connector_runs_the_same_tokens(model):
    p = prompt(9, 60)
    plain = LLMEngine(EngineConfig(model="tiny", num_gpu_blocks=64), model=model)
    with_conn = rec_engine(model, [], {})
    assert plain.generate([p], max_tokens=4)[0].output_token_ids == run(with_conn, p, 4)[0].output_token_ids


def test_load_then_compute_waits_for_every_layer_before_the_forward(model):
    log: list = []
    p = prompt(11, 80)
    eng, cold, _ = cold_then_reset(model, log, {}, p, mode="sync")
    eng.runner.load_then_compute = True
    warm, _ = run(eng, p)
    first = steps(log)[0]
    ms = [(m, d) for _, m, d in first]
    i = ms.index(("start_load_kv", [warm.request_id]))
    assert ms[i + 1 : i + 1 + len(LAYERS)] == [("wait_for_layer_load", n) for n in LAYERS]
    assert ms[i + 1 + len(LAYERS)] == ("wait_for_layer_load", LAYERS[0])  # then the usual hooks
    assert warm.output_token_ids == cold.output_token_ids
