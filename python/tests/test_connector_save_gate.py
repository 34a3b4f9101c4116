"""The worker's save gate (worker_core.SAVE_GATE_S, pegaflow.save_gate_ms): a step's Save leaves
the save thread once a later step's forward has been launched (its get_finished), not between
steps; a preemption or close() lets it through at once, and an engine that stops stepping has it
sent after the gate's longest wait. Against a real host-backend server."""

from __future__ import annotations

import time

import pytest

from pegaflow.connector.plan import SaveIntent, StepPlan
from pegaflow.connector.vllm import ConnectorSettings
from pegaflow.connector.vllm_api import KVTransferConfig, VllmConfig

from vllm_driver import sealed, wait_saved
from waits import wait_for

HASHES = [bytes([0xA0 + i]) * 16 for i in range(4)]


def recorded(w):
    """Each Save the worker sends: (monotonic time, block ids)."""
    real = w.client.save
    sent = []

    def save(**kw):
        sent.append((time.monotonic(), list(kw["block_ids"])))
        return real(**kw)

    w.client.save = save
    return sent


def step(w, saves=(), finished=True):
    """One step in vLLM's order: bind, (forward), wait_for_save, get_finished, unbind."""
    w.bind(StepPlan(saves=list(saves)))
    w.wait_for_save()
    if finished:
        w.get_finished(set())
    w.unbind()


def test_a_steps_save_is_sent_once_the_next_step_has_launched_its_forward(engine_factory, uid):
    eng = engine_factory("layerwise", **{"pegaflow.save_gate_ms": 30000})
    w = eng.worker._w()
    sent = recorded(w)
    step(w, [SaveIntent("r", [1, 2], HASHES[:2])])
    time.sleep(0.3)
    assert sent == []  # its own step ended: still held
    w.bind(StepPlan())  # the next step: bound, forward launched, wait_for_save
    w.wait_for_save()
    time.sleep(0.2)
    assert sent == []  # not before that step's get_finished
    t = time.monotonic()
    w.get_finished(set())
    w.unbind()
    wait_for(lambda: sent, "the save once the next step's forward was launched", timeout_s=5)
    assert sent[0][1] == [1, 2] and sent[0][0] >= t
    wait_saved(eng, timeout_s=5)  # its answer
    assert sealed(eng, HASHES[:2]) == 2


def test_an_engine_that_stops_stepping_has_its_save_sent_after_the_gates_longest_wait(engine_factory, uid):
    eng = engine_factory("layerwise", **{"pegaflow.save_gate_ms": 250})
    w = eng.worker._w()
    sent = recorded(w)
    t = time.monotonic()
    step(w, [SaveIntent("r", [3], HASHES[2:3])])
    wait_for(lambda: sent, "the save after the gate's longest wait", timeout_s=5)
    assert sent[0][0] - t >= 0.24
    wait_saved(eng, timeout_s=5)  # its answer
    assert sealed(eng, HASHES[2:3]) == 1


def test_a_gate_of_0_sends_the_save_as_soon_as_the_steps_kv_is_written(engine_factory, uid):
    eng = engine_factory("layerwise", **{"pegaflow.save_gate_ms": 0})
    w = eng.worker._w()
    assert w.save_gate_s == 0
    sent = recorded(w)
    step(w, [SaveIntent("r", [4], HASHES[3:4])], finished=False)
    wait_for(lambda: sent, "the save without another step", timeout_s=5)


def test_a_preemption_lets_the_requests_held_save_through_at_once(engine_factory, uid):
    eng = engine_factory("layerwise", **{"pegaflow.save_gate_ms": 30000})
    w = eng.worker._w()
    sent = recorded(w)
    step(w, [SaveIntent("p", [1], HASHES[:1])])
    t = time.monotonic()
    w.handle_preemptions(["p"])  # returns once the save landed: its blocks are reused next
    assert time.monotonic() - t < 5
    assert [ids for _, ids in sent] == [[1]] and not w._pending.get("p")
    assert sealed(eng, HASHES[:1]) == 1


def test_close_sends_the_held_saves_without_waiting_for_the_gate(engine_factory, uid):
    eng = engine_factory("layerwise", **{"pegaflow.save_gate_ms": 30000})
    w = eng.worker._w()
    sent = recorded(w)
    step(w, [SaveIntent("c", [2], HASHES[1:2])])
    t = time.monotonic()
    eng.worker.shutdown()
    assert time.monotonic() - t < 5
    assert [ids for _, ids in sent] == [[2]]
    assert w.stats_snapshot()["blocks_saved"] == 1  # answered before close() unregistered


def test_the_save_gate_setting_reaches_the_worker_and_a_bad_one_is_refused(uid):
    def cfg(v):
        return VllmConfig(
            kv_transfer_config=KVTransferConfig(engine_id=uid, kv_connector_extra_config={"pegaflow.save_gate_ms": v})
        )

    assert ConnectorSettings.from_vllm(VllmConfig(kv_transfer_config=KVTransferConfig(engine_id=uid)), env={}).save_gate_ms is None
    assert ConnectorSettings.from_vllm(cfg(0), env={}).save_gate_ms == 0
    assert ConnectorSettings.from_vllm(cfg("250"), env={}).save_gate_ms == 250
    env = {"PEGAFLOW_SAVE_GATE_MS": "40"}
    assert ConnectorSettings.from_vllm(VllmConfig(kv_transfer_config=KVTransferConfig(engine_id=uid)), env=env).save_gate_ms == 40
    for bad in ("5ms", -1, 2.5):
        with pytest.raises(ValueError, match="pegaflow.save_gate_ms .* is not a non-negative integer"):
            ConnectorSettings.from_vllm(cfg(bad), env={})


def test_under_a_deferred_finalize_the_save_waits_one_step_more_and_still_goes(engine_factory, uid):
    """vLLM's deferred finalize (speculative decoding) calls wait_for_save after the step's
    get_transfer_results → get_finished: the step's Save is then held until the second step after
    it has launched its forward, and sent then."""
    eng = engine_factory("layerwise", **{"pegaflow.save_gate_ms": 30000})
    w = eng.worker._w()
    sent = recorded(w)

    def deferred_step(saves=()):
        w.bind(StepPlan(saves=list(saves)))
        w.get_finished(set())
        w.wait_for_save()
        w.unbind()

    deferred_step([SaveIntent("r", [1], HASHES[:1])])
    deferred_step()
    time.sleep(0.2)
    assert sent == []  # one step later it is still held: its own step's get_finished came first
    deferred_step()
    wait_for(lambda: sent, "the save two steps later", timeout_s=5)
    assert sent[0][1] == [1]
    wait_saved(eng, timeout_s=5)  # its answer
    assert sealed(eng, HASHES[:1]) == 1
