"""The vLLM connector driven through vLLM's call sequence (tests/vllm_driver.py)
against a real host-backend server, in both modes: a cold request saves, a
later request with the same prefix loads it byte-exact into other block ids;
failed loads, preemption and delayed frees."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from pegaflow.connector.plan import LoadIntent, SaveIntent, StepPlan
from pegaflow.connector.vllm import PegaflowConnector, PegaflowConnectorMetadata
from pegaflow.connector.vllm_api import KVConnectorRole
from pegaflow.hashes import synthetic_tokens

from server_proc import leases_become
from vllm_driver import BLOCK, Request, lose_leases_after_alloc, out_of_range_targets, saved_prompt, vllm_config

MODES = ["layerwise", "async"]


@pytest.mark.parametrize("mode", MODES)
def test_a_cold_request_saves_and_a_shared_prefix_loads_byte_exact_into_other_blocks(engine_factory, uid, mode):
    eng = engine_factory(mode)
    prompt = synthetic_tokens(11, 6 * BLOCK + 2)
    cold = Request("cold", prompt, salt=uid)
    assert eng.run_prefill(cold) == 0
    assert eng.finish(cold) is True  # saves were issued: blocks held until finished_sending
    eng.drain("cold")
    assert eng.sched._s().delayed == set()
    assert eng.worker.pegaflow_stats()["blocks_saved"] == 6

    warm_prompt = prompt[: 5 * BLOCK] + synthetic_tokens(12, 3 * BLOCK)
    warm = Request("warm", warm_prompt, salt=uid)
    n = eng.run_prefill(warm, avoid=set(cold.block_ids))
    assert n == 5 * BLOCK  # the 5 shared blocks; the 6th differs in content
    assert not set(warm.block_ids) & set(cold.block_ids)
    assert eng.holds_all(warm, warm.num_tokens)
    assert eng.layer_violations == [] and eng.invalid_blocks == set()
    if mode == "async":
        assert warm.load_async is True
    else:
        assert warm.load_async is False


@pytest.mark.parametrize("mode", MODES)
def test_hits_leave_the_last_token_to_compute(engine_factory, uid, mode):
    eng = engine_factory(mode)
    prompt = synthetic_tokens(21, 4 * BLOCK)  # exactly 4 full blocks
    a = Request("a", prompt, salt=uid)
    eng.run_prefill(a)
    eng.finish(a)
    eng.drain("a")
    b = Request("b", list(prompt), salt=uid)
    n = eng.run_prefill(b, avoid=set(a.block_ids))
    assert n == 3 * BLOCK  # the 4th block holds the last token, which the engine computes
    assert eng.holds_all(b, b.num_tokens) and eng.layer_violations == []


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_load_reports_its_blocks_and_they_are_recomputed(engine_factory, uid, mode):
    eng = engine_factory(mode)
    prompt = synthetic_tokens(31, 5 * BLOCK)
    a = Request("a", prompt, salt=uid)
    eng.run_prefill(a)
    eng.finish(a)
    eng.drain("a")
    # The lease is given back between the scheduler's decision and the worker's
    # Load (as when it expired): the Load is refused, the blocks must be recomputed.
    lose_leases_after_alloc(eng)
    b = Request("b", list(prompt) + [1, 2], salt=uid)
    eng.run_prefill(b, avoid=set(a.block_ids))
    loaded = set(b.block_ids[:5])
    assert eng.invalid_blocks == loaded
    assert eng.holds_all(b, b.num_tokens)  # recomputed after the failure
    assert eng.worker.pegaflow_stats()["load_failures"] == 1


def test_preemption_waits_for_the_preempted_requests_pending_save(engine_factory, uid):
    eng = engine_factory("layerwise")
    client = eng.worker.client
    real_save = client.save
    gate = threading.Event()

    def slow_save(**kw):
        gate.wait(10)  # the save is still in flight when the preemption arrives
        return real_save(**kw)

    client.save = slow_save
    prompt = synthetic_tokens(41, 3 * BLOCK + 1)
    r = Request("p", prompt, salt=uid)
    eng.admit(r)
    out = eng._output([r], sched_tokens={"p": r.num_tokens})
    eng._step(out, {"p": r})  # wait_for_save only enqueued
    assert eng.worker._w()._pending.get("p") == 1
    threading.Timer(0.2, gate.set).start()
    preempt = eng._output([], preempted={"p"})
    assert preempt.kv_connector_metadata.plan.preempted == ["p"]
    eng.worker.handle_preemptions(preempt.kv_connector_metadata)  # blocks until the save landed
    assert not eng.worker._w()._pending.get("p")
    q = eng.sched.client.query_prefetch(
        instance_id=eng.sched.settings.instance_id, block_hashes=r.block_hashes, request_id="check"
    )
    assert q.hits == 3
    eng.sched.client.release(q.lease_id)


def test_a_request_without_full_blocks_is_freed_at_once_and_never_reported(engine_factory, uid):
    eng = engine_factory("layerwise")
    r = Request("short", synthetic_tokens(51, BLOCK - 1), salt=uid)
    eng.run_prefill(r)
    assert eng.finish(r) is False
    res = eng.idle_step()
    assert res.finished_sending is None


def test_the_step_plan_survives_pickle():
    plan = StepPlan([LoadIntent("r", b"\x01" * 16, [3, 4])], [SaveIntent("s", [1], [b"h"])], ["p"])
    meta = pickle.loads(pickle.dumps(PegaflowConnectorMetadata(plan)))
    assert meta.plan == plan


def test_an_unreachable_server_is_a_miss_not_an_error_for_the_scheduler(uid):
    cfg = vllm_config("127.0.0.1:1", uid, "tiny-" + uid, "async")
    sched = PegaflowConnector(cfg, KVConnectorRole.SCHEDULER, None)
    r = Request("x", synthetic_tokens(1, 3 * BLOCK), salt=uid)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.pegaflow_stats()["query_errors"] == 1
    sched.shutdown()


def test_namespace_changes_with_every_layout_factor(server, uid):
    base = vllm_config(server.addr, uid, "m/tiny", "layerwise")
    ns = PegaflowConnector(base, KVConnectorRole.SCHEDULER, None).settings.namespace
    other_block = vllm_config(server.addr, uid, "m/tiny", "layerwise")
    other_block.cache_config.block_size = 8
    other_dtype = vllm_config(server.addr, uid, "m/tiny", "layerwise")
    other_dtype.model_config.dtype = torch.bfloat16
    other_tp = vllm_config(server.addr, uid, "m/tiny", "layerwise")
    other_tp.parallel_config.tensor_parallel_size = 2
    names = {ns}
    for cfg in (other_block, other_dtype, other_tp):
        names.add(PegaflowConnector(cfg, KVConnectorRole.SCHEDULER, None).settings.namespace)
    assert len(names) == 4 and ns.startswith("tiny-")


def test_wait_for_layer_load_returns_when_that_layer_landed_not_when_the_load_did(engine_factory, uid):
    from test_load_state import publish

    eng = engine_factory("layerwise")
    w = eng.worker._w()
    eng.worker.client.load = lambda **kw: None  # the test plays the server's copy engine
    w.bind(StepPlan(loads=[LoadIntent("r", b"\x01" * 16, [4, 5])]))
    w.start_load()
    st = w.step_loads[0].state
    publish(st, num_layers=3, layers_ready=1)
    eng.worker.wait_for_layer_load("model.layers.0.self_attn.attn")
    done = threading.Event()
    t = threading.Thread(target=lambda: (eng.worker.wait_for_layer_load("model.layers.2.self_attn.attn"), done.set()))
    t.start()
    publish(st, layers_ready=2)
    assert not done.wait(0.2)  # layer 2 is registered third: it waits for layers_ready > 2
    publish(st, layers_ready=3, state=1)
    t.join(10)
    assert done.is_set()
    w.wait_for_save()
    assert w.take_load_errors() == set()
    w.unbind()


def test_a_load_trimmed_by_the_scheduler_loads_that_prefix_and_gives_the_rest_back(engine_factory, uid):
    from pegaflow.connector.vllm_api import KVCacheBlock, KVCacheBlocks

    eng = engine_factory("layerwise")
    prompt = synthetic_tokens(81, 5 * BLOCK + 1)
    a = Request("a", prompt, salt=uid)
    eng.run_prefill(a)
    eng.finish(a)
    eng.drain("a")
    b = Request("b", list(prompt), salt=uid)
    n, _ = eng.sched.get_num_new_matched_tokens(b, 0)
    assert n == 5 * BLOCK
    picks = [x for x in eng.free if x not in a.block_ids][:6]
    for x in picks:
        eng.free.remove(x)
    b.block_ids = picks
    # The token budget lets only 2 of the 5 hit blocks in (vLLM may trim external tokens).
    eng.sched.update_state_after_alloc(b, KVCacheBlocks(([KVCacheBlock(x) for x in picks],)), 2 * BLOCK)
    b.num_computed_tokens = 2 * BLOCK
    out = eng._output([b], sched_tokens={"b": b.num_tokens - 2 * BLOCK})
    assert out.kv_connector_metadata.plan.loads[0].block_ids == picks[:2]
    eng._step(out, {"b": b})
    assert eng.invalid_blocks == set() and eng.layer_violations == []
    assert eng.holds_all(b, b.num_tokens)


def test_a_layer_sharing_another_layers_kv_is_registered_once_and_waits_on_it(server, uid):
    from pegaflow.client import PegaflowClient
    from pegaflow.connector.worker_core import WorkerCore
    from pegaflow.regions import ShmRegion

    client = PegaflowClient(server.addr)
    region = ShmRegion(2 * 4096)
    a = region.torch(torch.float16, (2, 8, 4, 2, 8), offset=0)
    b = region.torch(torch.float16, (2, 8, 4, 2, 8), offset=4096)
    w = WorkerCore(client, instance_id=uid, namespace="ns-" + uid)
    try:
        w.register_kv_caches({"l0": a, "l1": b, "l2_shares_l0": a})
        assert w.registration.layer_names == ["l0", "l1"]
        client.load = lambda **kw: None  # the test plays the server's copy engine
        w.bind(StepPlan(loads=[LoadIntent("r", b"\x01" * 16, [4])]))
        w.start_load()
        from test_load_state import publish

        publish(w.step_loads[0].state, num_layers=2, layers_ready=1)
        w.wait_for_layer_load("l2_shares_l0")  # returns: its tensor is l0's, which landed
        publish(w.step_loads[0].state, layers_ready=2, state=1)
        w.wait_for_layer_load("not-a-layer")  # unknown: waits for every layer, does not raise
        w.wait_for_save()
        w.unbind()
    finally:
        w.close()
        client.close()
        region.close()


def test_a_host_backend_worker_registers_the_configured_device_and_a_bad_one_is_refused(uid):
    from pegaflow.connector.vllm import ConnectorSettings
    from pegaflow.connector.vllm_api import KVTransferConfig, VllmConfig

    def settings(device):
        ktc = KVTransferConfig(engine_id=uid, kv_connector_extra_config={"pegaflow.device_id": device})
        return ConnectorSettings.from_vllm(VllmConfig(kv_transfer_config=ktc), env={})

    assert settings(3).device_id == 3
    assert settings("1").device_id == 1
    with pytest.raises(ValueError, match="pegaflow.device_id 'gpu1'"):
        settings("gpu1")
    assert ConnectorSettings.from_vllm(VllmConfig(kv_transfer_config=KVTransferConfig(engine_id=uid)), env={
        "PEGAFLOW_DEVICE_ID": "2"}).device_id == 2


def test_the_loading_retry_setting_reaches_the_scheduler_and_a_bad_one_is_refused(uid):
    from pegaflow.connector.scheduler_core import LOADING_RETRY_MAX_S
    from pegaflow.connector.vllm import ConnectorSettings, PegaflowConnector
    from pegaflow.connector.vllm_api import KVConnectorRole, KVTransferConfig, VllmConfig

    def cfg(v=None, env=None):
        extra = {} if v is None else {"pegaflow.loading_retry_ms": v}
        return VllmConfig(kv_transfer_config=KVTransferConfig(engine_id=uid, kv_connector_extra_config=extra))

    assert ConnectorSettings.from_vllm(cfg(), env={}).loading_retry_ms is None
    assert ConnectorSettings.from_vllm(cfg(0), env={}).loading_retry_ms == 0
    assert ConnectorSettings.from_vllm(cfg(), env={"PEGAFLOW_LOADING_RETRY_MS": "7"}).loading_retry_ms == 7
    with pytest.raises(ValueError, match="pegaflow.loading_retry_ms '-1'"):
        ConnectorSettings.from_vllm(cfg(-1), env={})
    conn = PegaflowConnector(cfg(5), KVConnectorRole.SCHEDULER)
    default = PegaflowConnector(cfg(), KVConnectorRole.SCHEDULER)
    try:
        assert conn._s().loading_retry_s == 0.005
        assert default._s().loading_retry_s == LOADING_RETRY_MAX_S
    finally:
        conn.shutdown()
        default.shutdown()


def test_the_loading_wait_setting_reaches_the_scheduler_and_a_bad_one_is_refused(uid):
    from pegaflow.connector.scheduler_core import LOADING_WAIT_MS
    from pegaflow.connector.vllm import ConnectorSettings, PegaflowConnector
    from pegaflow.connector.vllm_api import KVConnectorRole, KVTransferConfig, VllmConfig

    def cfg(v=None):
        extra = {} if v is None else {"pegaflow.loading_wait_ms": v}
        return VllmConfig(kv_transfer_config=KVTransferConfig(engine_id=uid, kv_connector_extra_config=extra))

    assert ConnectorSettings.from_vllm(cfg(), env={}).loading_wait_ms is None
    assert ConnectorSettings.from_vllm(cfg(0), env={}).loading_wait_ms == 0
    assert ConnectorSettings.from_vllm(cfg(), env={"PEGAFLOW_LOADING_WAIT_MS": "250"}).loading_wait_ms == 250
    with pytest.raises(ValueError, match="pegaflow.loading_wait_ms '-1'"):
        ConnectorSettings.from_vllm(cfg(-1), env={})
    with pytest.raises(ValueError, match="pegaflow.loading_wait_ms 60001 is above 60000"):
        ConnectorSettings.from_vllm(cfg(60001), env={})
    conn = PegaflowConnector(cfg(0), KVConnectorRole.SCHEDULER)
    default = PegaflowConnector(cfg(), KVConnectorRole.SCHEDULER)
    try:
        assert conn._s().loading_wait_ms == 0
        assert default._s().loading_wait_ms == LOADING_WAIT_MS
    finally:
        conn.shutdown()
        default.shutdown()


def test_a_worker_registers_its_rank_on_the_device_it_is_given(server, uid):
    from pegaflow.client import PegaflowClient
    from pegaflow.connector.worker_core import WorkerCore
    from pegaflow.errors import PegaflowError
    from pegaflow.regions import ShmRegion

    # The session's server serves device 0 only: a rank given device 5 is refused by name.
    client = PegaflowClient(server.addr)
    region = ShmRegion(4096)
    w = WorkerCore(client, instance_id=uid, namespace="ns-" + uid, device_id=5)
    try:
        kv = {"l0": region.torch(torch.float16, (2, 8, 4, 2, 8))}
        with pytest.raises(PegaflowError, match="device_id 5 is not served by this server"):
            w.register_kv_caches(kv)
        del kv  # no view of the region outlives it (a failure report would read it)
    finally:
        w.close()
        client.close()
        region.close()



@pytest.fixture
def http_server():
    """A server of this test's own with /metrics (the session's has no HTTP listener)."""
    from server_proc import ServerProc

    s = ServerProc.start(extra=["--http-addr", "127.0.0.1:0"])
    yield s
    s.stop()


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_worker_load_gives_its_lease_back_at_once(http_server, uid, mode):
    """A Load the server refuses leaves its lease as it was: the worker gives it back instead of
    leaving its blocks pinned until the lease's TTL (10 minutes)."""
    from vllm_driver import Engine

    eng = Engine(vllm_config(http_server.addr, uid, "tiny-" + uid, mode))
    try:
        prompt, used = saved_prompt(eng, 37, uid)
        leases_become(http_server, 0)
        wc = eng.worker._w()
        wc.client.load = out_of_range_targets(wc.client.load)
        b = Request("b", list(prompt) + [1, 2], salt=uid)
        eng.run_prefill(b, avoid=used)
        assert eng.invalid_blocks == set(b.block_ids[:5])
        assert eng.holds_all(b, b.num_tokens)  # recomputed
        leases_become(http_server, 0)
        assert wc.stats_snapshot()["leases_given_back"] == 1
    finally:
        eng.close()


def test_a_preemption_that_stops_waiting_drops_the_requests_queued_saves(engine_factory, uid):
    """handle_preemptions gives up after the save deadline and vLLM then reuses the blocks: a
    save of the request still queued behind the slow one must not be sent (it would store
    another request's KV under this one's hashes); a later save of it, after it resumed, is."""
    eng = engine_factory("layerwise", **{"pegaflow.save_timeout_ms": 300})
    w = eng.worker._w()
    real_save = w.client.save
    gate = threading.Event()
    sent = []

    def gated_save(**kw):
        gate.wait(10)
        sent.append(list(kw["block_ids"]))
        return real_save(**kw)

    w.client.save = gated_save
    h = [bytes([i]) * 16 for i in range(1, 5)]
    for ids, hs in (([1], h[:1]), ([2], h[1:2])):  # the first is in flight, the second queued
        w.bind(StepPlan(saves=[SaveIntent("p", ids, hs)]))
        w.wait_for_save()
        w.unbind()
    t0 = time.monotonic()
    w.handle_preemptions(["p"])
    assert 0.25 < time.monotonic() - t0 < 5
    assert w.stats_snapshot()["preemption_wait_timeouts"] == 1
    w.bind(StepPlan(saves=[SaveIntent("p", [3], h[2:3])]))  # resumed: its new save goes out
    w.wait_for_save()
    w.unbind()
    gate.set()
    deadline = time.monotonic() + 10
    while w._pending.get("p"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sent == [[1], [3]], sent
    assert w.stats_snapshot()["saves_dropped"] == 1


def test_a_timeout_setting_that_is_not_whole_milliseconds_is_refused_naming_its_key(uid):
    from pegaflow.connector.vllm import ConnectorSettings
    from pegaflow.connector.vllm_api import KVTransferConfig, VllmConfig

    def cfg(v):
        return VllmConfig(
            kv_transfer_config=KVTransferConfig(engine_id=uid, kv_connector_extra_config={"pegaflow.rpc_timeout_ms": v})
        )

    for ok, want in ((250, 0.25), ("250", 0.25), (250.0, 0.25)):
        assert ConnectorSettings.from_vllm(cfg(ok), env={}).client.rpc_timeout_s == want
    for bad in ("5s", 2.5, 0, -1, True, ""):
        with pytest.raises(ValueError, match="pegaflow.rpc_timeout_ms .* is not a whole number of milliseconds"):
            ConnectorSettings.from_vllm(cfg(bad), env={})


def test_a_save_that_raises_a_bug_drops_that_steps_saves_and_the_save_thread_lives_on(engine_factory, uid):
    eng = engine_factory("layerwise")
    w = eng.worker._w()
    real_save = w.client.save
    calls = []

    def buggy_then_fine(**kw):
        calls.append(list(kw["block_ids"]))
        if len(calls) == 1:
            raise RuntimeError("a bug in the save path")
        return real_save(**kw)

    w.client.save = buggy_then_fine
    h = [bytes([i]) * 16 for i in range(1, 3)]
    for ids, hs in (([1], h[:1]), ([2], h[1:2])):
        w.bind(StepPlan(saves=[SaveIntent("s", ids, hs)]))
        w.wait_for_save()
        w.unbind()
    deadline = time.monotonic() + 10
    while w._pending.get("s"):
        assert time.monotonic() < deadline, "the save thread died: the second save never ran"
        time.sleep(0.01)
    assert calls == [[1], [2]]
    st = w.stats_snapshot()
    assert st["save_errors"] == 1 and st["saves_dropped"] == 1 and st["saves"] == 1
