"""Scheduler-issued loads (pegaflow.load_issuer=scheduler), driven in vLLM's
call order (tests/vllm_driver.py) against a real host-backend server: the
scheduler sends every rank's Load in update_state_after_alloc, before the
worker's step starts; the worker attaches to its rank's load state; failures
still end in recomputed blocks; the state files do not outlive their step;
a load that may still land keeps its request's blocks held."""

from __future__ import annotations

import threading
import time
from typing import List

import pytest

from pegaflow.client import PegaflowClient
from pegaflow.connector.plan import ScheduledRequest
from pegaflow.connector.scheduler_core import SchedulerCore
from pegaflow.connector.vllm import ConnectorSettings
from pegaflow.hashes import synthetic_tokens

from kv_helpers import my_states
from tp_ranks import Req, TwoRanks
from pegaflow.connector.vllm_api import ForwardContext
from vllm_driver import (
    BLOCK, LAYER_NAMES, Engine, Request, lose_load_answers, out_of_range_targets, saved_prompt, vllm_config,
)

MODES = ["layerwise", "async"]
SCHED = {"pegaflow.load_issuer": "scheduler"}


@pytest.fixture
def engines(server, uid):
    before = my_states()
    made = []

    def make(mode: str, **extra) -> Engine:
        e = Engine(vllm_config(server.addr, f"{uid}-{len(made)}", "tiny-" + uid, mode, **{**SCHED, **extra}))
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
    assert my_states() == before, "load-state files left in /dev/shm"


def cold_then_drained(eng: Engine, seed: int, nblocks: int, uid: str) -> Request:
    cold = Request("cold", synthetic_tokens(seed, nblocks * BLOCK + 1), salt=uid)
    assert eng.run_prefill(cold) == 0
    assert eng.finish(cold) is True
    eng.drain("cold")
    return cold


class Recorder:
    """Wraps the scheduler's Load sends, the worker's own Loads and the
    worker's start_load_kv; keeps the order in which they happened."""

    def __init__(self, eng: Engine):
        self.events: List[tuple] = []
        real_send = eng.sched.client.load_nowait
        real_load = eng.worker.client.load
        real_start = eng.worker.start_load_kv

        self.whole: List[bool] = []

        def send(**kw):
            self.events.append(("scheduler sends Load", kw["tp_rank"], kw["pp_rank"], kw["load_state_shm"]))
            self.whole.append(kw.get("whole", False))
            return real_send(**kw)

        def load(**kw):
            self.events.append(("worker sends Load", kw["tp_rank"], kw["pp_rank"]))
            self.whole.append(kw.get("whole", False))
            return real_load(**kw)

        def start(ctx, **kw):
            self.events.append(("worker start_load_kv",))
            return real_start(ctx, **kw)

        eng.sched.client.load_nowait = send
        eng.worker.client.load = load
        eng.worker.start_load_kv = start

    def kinds(self) -> List[str]:
        return [e[0] for e in self.events]


@pytest.mark.parametrize("mode", MODES)
def test_the_scheduler_sends_the_load_before_the_workers_step_and_it_lands_byte_exact(engines, uid, mode):
    eng = engines(mode)
    assert eng.sched.settings.load_issuer == "scheduler"
    cold = cold_then_drained(eng, 11, 6, uid)
    rec = Recorder(eng)
    warm = Request("warm", cold.prompt_token_ids[: 5 * BLOCK] + synthetic_tokens(12, 3 * BLOCK), salt=uid)
    n = eng.run_prefill(warm, avoid=set(cold.block_ids))
    assert n == 5 * BLOCK
    kinds = rec.kinds()
    # Sent inside update_state_after_alloc, before any worker step started; the
    # worker only attached (no Load of its own).
    assert kinds[0] == "scheduler sends Load" and rec.events[0][1:3] == (0, 0)
    assert kinds.index("scheduler sends Load") < kinds.index("worker start_load_kv")
    assert "worker sends Load" not in kinds and kinds.count("scheduler sends Load") == 1
    # An async load is read only once whole: the server may spread it over copy lanes.
    assert rec.whole == [mode == "async"]
    assert not set(warm.block_ids) & set(cold.block_ids)
    assert eng.holds_all(warm, warm.num_tokens)
    assert eng.layer_violations == [] and eng.invalid_blocks == set()
    stats = eng.worker.pegaflow_stats()
    assert stats["loads"] >= 1 and stats.get("load_failures", 0) == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_scheduler_issued_load_reports_its_blocks_and_they_are_recomputed(engines, uid, mode):
    eng = engines(mode)
    prompt = synthetic_tokens(31, 5 * BLOCK)
    a = Request("a", prompt, salt=uid)
    eng.run_prefill(a)
    eng.finish(a)
    eng.drain("a")
    core = eng.sched._s()
    real = core.update_state_after_alloc

    def lease_gone_then_alloc(req, block_ids, n):
        # The lease is given back between the probe and the Load (as when it expired).
        p = core._probes.get(req.request_id)
        if p is not None and p.result.lease_id:
            eng.sched.client.release(p.result.lease_id)
        real(req, block_ids, n)

    core.update_state_after_alloc = lease_gone_then_alloc
    b = Request("b", list(prompt) + [1, 2], salt=uid)
    eng.run_prefill(b, avoid=set(a.block_ids))
    assert eng.invalid_blocks == set(b.block_ids[:5])
    assert eng.holds_all(b, b.num_tokens)  # recomputed after the failure
    assert eng.worker.pegaflow_stats()["load_failures"] == 1
    # The refusal is counted when its answer is read (a reader thread); the server marked the
    # state failed before answering, so the worker may have seen the failure first.
    end = time.monotonic() + 10
    while eng.sched.pegaflow_stats().get("load_issue_errors", 0) < 1:
        assert time.monotonic() < end, "the refused Load's answer was never counted"
        time.sleep(0.01)
    assert eng.sched.pegaflow_stats()["load_issue_errors"] == 1


def test_load_state_files_are_gone_once_their_step_ran_and_the_load_was_answered(engines, uid):
    eng = engines("layerwise")
    cold = cold_then_drained(eng, 21, 4, uid)
    fresh = eng.sched._s()._fresh  # states made ahead between steps: not yet any load's

    def in_use() -> List[str]:
        spare = {n.lstrip("/") for n in fresh.names}
        return [f for f in my_states() if f not in spare]

    before = in_use()
    warm = Request("warm", list(cold.prompt_token_ids), salt=uid)
    eng.run_prefill(warm, avoid=set(cold.block_ids))
    assert eng.invalid_blocks == set() and eng.holds_all(warm, warm.num_tokens)
    end = time.monotonic() + 10
    while in_use() != before:  # the next step and the Load's answer, whichever is last
        assert time.monotonic() < end, f"left: {sorted(set(in_use()) - set(before))}"
        eng.idle_step()
        time.sleep(0.01)
    # A plan whose step never ran: close() unlinks its state (and the spares).
    again = Request("again", list(cold.prompt_token_ids), salt=uid)
    assert eng.admit(again, avoid=set(cold.block_ids) | set(warm.block_ids)) == 4 * BLOCK
    assert len(in_use()) == len(before) + 1
    eng.sched.shutdown()
    assert my_states() == []


def test_a_request_that_loaded_is_held_until_its_load_settled_and_preemption_waits_for_a_late_copy(
    engines, uid
):
    eng = engines("layerwise", **{"pegaflow.load_timeout_ms": 300})
    cold = cold_then_drained(eng, 41, 4, uid)
    # The Load reaches the server only when the gate opens: the worker times out
    # first (its blocks are recomputed) while the copy may still land.
    gate = threading.Event()
    opened: List[str] = []
    real_send = eng.sched.client.load_nowait

    def late_send(**kw):
        def go():
            gate.wait(30)
            opened.append(kw["load_state_shm"])
            real_send(**kw)

        threading.Thread(target=go, daemon=True).start()

    eng.sched.client.load_nowait = late_send
    warm = Request("w", list(cold.prompt_token_ids), salt=uid)
    eng.run_prefill(warm, avoid=set(cold.block_ids))
    assert eng.invalid_blocks == set(warm.block_ids[:4])  # timed out → recomputed
    assert eng.holds_all(warm, warm.num_tokens)
    w = eng.worker._w()
    assert len(w._lingering) == 1 and w._pending.get("w") == 1  # blocks still held
    # vLLM frees a preempted request's blocks at once: the worker's
    # handle_preemptions must not return while the late copy may land in them.
    threading.Timer(0.2, gate.set).start()
    preempt = eng._output([], preempted={"w"})
    eng.worker.handle_preemptions(preempt.kv_connector_metadata)
    assert opened, "handle_preemptions returned before the late Load was even sent"
    assert w._lingering == [] and not w._pending.get("w")
    eng._step(preempt, {})
    assert eng.holds_all(warm, warm.num_tokens)  # the late copy carried the same KV
    # Finished: its free is delayed until the worker reports it (nothing in flight now).
    assert eng.finish(warm) is True
    eng.drain("w")


def test_two_tp_ranks_each_attach_their_own_ranks_state_of_one_scheduler_issued_load(server, uid):
    before = my_states()
    client = PegaflowClient(server.addr)
    ranks = None
    try:
        ranks = TwoRanks(client, uid)
        sched = SchedulerCore(
            client, instance_id=uid, block_size=BLOCK, mode="layerwise", load_issuer="scheduler",
            ranks=[(0, 0), (1, 0)],
        )
        a = Req("a", synthetic_tokens(91, 3 * BLOCK + 1), uid)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        sched.update_state_after_alloc(a, [1, 2, 3, 4], 0)
        plan = sched.build_step([ScheduledRequest("a", [1, 2, 3, 4], True, 0, a.num_tokens)])
        ranks.save_step(sched, plan, a, [1, 2, 3])

        b = Req("b", list(a.tokens) + [5, 6, 7], uid)
        assert sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, False)
        sched.update_state_after_alloc(b, [9, 10, 11, 12], 3 * BLOCK)
        assert sched.stats["loads_issued"] == 2  # one Load per rank, from the scheduler
        plan = sched.build_step([ScheduledRequest("b", [9, 10, 11, 12], True, 3 * BLOCK, 4)])
        states = plan.loads[0].states
        assert set(states) == {(0, 0), (1, 0)} and states[(0, 0)] != states[(1, 0)]
        for rank, w in enumerate(ranks.workers):
            w.bind(plan)
            w.start_load()
            assert w.step_loads[0].state.name == states[(rank, 0)]
            for name in ranks.kvs[0]:
                w.wait_for_layer_load(name)
            w.wait_for_save()
            assert w.take_load_errors() == set()
            w.unbind()
            assert w.stats["loads"] == 1
        ranks.assert_loaded([9, 10, 11], b)
        sched.close()
    finally:
        if ranks is not None:
            ranks.close()
        client.close()
    assert my_states() == before


def test_the_load_issuer_is_the_scheduler_only_where_vllm_schedules_synchronously(server, uid):
    def issuer(async_scheduling, pp=1, **extra) -> str:
        cfg = vllm_config(server.addr, uid, "tiny", "layerwise", **extra)
        cfg.scheduler_config.async_scheduling = async_scheduling
        cfg.parallel_config.pipeline_parallel_size = pp
        return ConnectorSettings.from_vllm(cfg, env={}).load_issuer

    assert issuer(False) == "scheduler"
    assert issuer(None) == "worker"  # not known: the safe one
    assert issuer(True) == "worker"
    assert issuer(False, pp=2) == "worker"  # PP runs a queue of concurrent batches
    assert issuer(True, **{"pegaflow.load_issuer": "scheduler"}) == "scheduler"
    assert issuer(False, **{"pegaflow.load_issuer": "worker"}) == "worker"
    with pytest.raises(ValueError, match="pegaflow.load_issuer 'gpu'"):
        issuer(False, **{"pegaflow.load_issuer": "gpu"})


def test_an_async_load_aborted_before_it_landed_keeps_its_blocks_until_finished_recving(engines, uid):
    eng = engines("async")
    cold = cold_then_drained(eng, 61, 4, uid)
    gate = threading.Event()
    real_send = eng.sched.client.load_nowait

    def late_send(**kw):  # the Load reaches the server only when the gate opens
        threading.Thread(target=lambda: (gate.wait(30), real_send(**kw)), daemon=True).start()

    eng.sched.client.load_nowait = late_send
    r = Request("aborted", list(cold.prompt_token_ids), salt=uid)
    assert eng.admit(r, avoid=set(cold.block_ids)) == 4 * BLOCK and r.load_async
    res = eng.idle_step()  # the step that carries the load: the worker attaches, nothing landed yet
    assert not res.finished_recving
    # Aborted while WAITING_FOR_REMOTE_KVS: vLLM calls request_finished; the
    # copy may still land in its blocks, so they stay held...
    delay, _ = eng.sched.request_finished(r, list(r.block_ids))
    assert delay is True and "aborted" in eng.sched._s().delayed
    eng.finished_ids.add("aborted")
    gate.set()
    for _ in range(400):
        if res.finished_recving and "aborted" in res.finished_recving:
            break
        time.sleep(0.005)
        res = eng.idle_step()
    else:
        raise AssertionError("the aborted request's load never came back")
    # ...until the worker reports its load (vLLM frees a finished request named
    # in finished_recving), and it is not reported a second time as sent.
    assert not res.finished_sending
    assert eng.sched._s().delayed == set()
    assert eng.holds_all(r, 4 * BLOCK)  # the copy landed in blocks nobody reused
    eng._free(r)


@pytest.mark.parametrize("mode", MODES)
def test_a_worker_issued_load_is_whole_only_in_async_mode_and_lands_byte_exact(engines, uid, mode):
    eng = engines(mode, **{"pegaflow.load_issuer": "worker"})
    cold = cold_then_drained(eng, 41, 6, uid)
    rec = Recorder(eng)
    warm = Request("warm", cold.prompt_token_ids[: 5 * BLOCK] + synthetic_tokens(42, 3 * BLOCK), salt=uid)
    assert eng.run_prefill(warm, avoid=set(cold.block_ids)) == 5 * BLOCK
    assert "scheduler sends Load" not in rec.kinds() and rec.kinds().count("worker sends Load") == 1
    assert rec.whole == [mode == "async"]
    assert eng.holds_all(warm, warm.num_tokens)
    assert eng.layer_violations == [] and eng.invalid_blocks == set()


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_a_refused_scheduler_issued_load_gives_its_lease_back_at_once(uid, mode):
    """A Load the server refuses leaves its lease as it was: the scheduler gives it back
    instead of leaving its blocks pinned until the lease's TTL (10 minutes)."""
    from server_proc import ServerProc, leases_become

    srv = ServerProc.start(extra=["--http-addr", "127.0.0.1:0"])
    eng = Engine(vllm_config(srv.addr, uid, "tiny-" + uid, mode, **SCHED))
    try:
        prompt, used = saved_prompt(eng, 39, uid)
        leases_become(srv, 0)
        client = eng.sched._s().client
        client.load_nowait = out_of_range_targets(client.load_nowait)
        b = Request("b", list(prompt) + [1, 2], salt=uid)
        eng.run_prefill(b, avoid=used)
        assert eng.invalid_blocks == set(b.block_ids[:5])
        assert eng.holds_all(b, b.num_tokens)  # recomputed
        leases_become(srv, 0)
        assert eng.sched.pegaflow_stats()["leases_given_back"] == 1
    finally:
        eng.close()
        srv.stop()


@pytest.mark.parametrize("issuer", ["worker", "scheduler"])
def test_an_async_load_whose_answer_was_lost_is_reported_only_once_its_late_copy_could_have_settled(
    engines, uid, issuer
):
    # DEADLINE_EXCEEDED: the Load may still reach the server and copy into the request's
    # blocks, so finished_recving (after which vLLM may free or reuse them) waits for that.
    eng = engines("async", **{"pegaflow.load_issuer": issuer, "pegaflow.load_timeout_ms": 300})
    cold = cold_then_drained(eng, 45, 4, uid)
    gate = threading.Event()
    sent, _ = lose_load_answers(eng, issuer, gate)
    threading.Timer(0.2, gate.set).start()
    warm = Request("w", list(cold.prompt_token_ids), salt=uid)
    eng.run_prefill(warm, avoid=set(cold.block_ids))
    assert sent, "finished_recving named the request before its late Load was even sent"
    assert set(warm.block_ids[:4]) <= eng.invalid_blocks  # failed → recomputed
    assert eng.holds_all(warm, warm.num_tokens)
    assert eng.finish(warm) is False


class _StreamWaits:
    """GpuWaits as the worker uses them, without a GPU: each layer's wait is "enqueued on the
    stream" and the host goes on, so a failed load shows only when the step's loads settle."""

    def arm(self, st) -> bool:
        return True

    def guard(self, st, deadline) -> None:
        pass

    def wait(self, st, layer) -> bool:
        return True

    def release(self, st) -> None:
        pass

    def retire(self, st, then) -> None:
        then(st)

    def reap(self, block: bool = False) -> None:
        pass

    def close_later(self, st) -> None:
        st.close()

    def close_kept(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_load_errors_asked_before_wait_for_save_name_this_steps_failed_loads(engines, uid):
    # vLLM's runner with a deferred finalize (speculative decoding) asks for the load errors
    # before wait_for_save: a layer-wise load whose failure the GPU's waits let pass must be
    # reported in this step, not after a token was sampled over KV that never landed.
    eng = engines("layerwise")
    cold = cold_then_drained(eng, 47, 4, uid)
    eng.worker._w()._gpu = _StreamWaits()
    gate = threading.Event()
    client = eng.sched.client
    real_send = client.load_nowait

    def refused_late(**kw):
        def go():
            gate.wait(30)
            client.release(kw["lease_id"])  # the lease is gone: the server refuses the Load
            real_send(**kw)

        threading.Thread(target=go, daemon=True).start()

    client.load_nowait = refused_late
    warm = Request("w", list(cold.prompt_token_ids), salt=uid)
    n = eng.admit(warm, avoid=set(cold.block_ids))
    assert n == 4 * BLOCK
    warm.num_computed_tokens = n
    out = eng._output([warm], sched_tokens={"w": warm.num_tokens - n})
    w = eng.worker
    w.handle_preemptions(out.kv_connector_metadata)
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(ForwardContext())
    for name in LAYER_NAMES:
        w.wait_for_layer_load(name)  # enqueued; the host goes on
    gate.set()
    assert w.get_block_ids_with_load_errors() == set(warm.block_ids[:4])
    w.wait_for_save()
    w.get_finished(out.finished_req_ids)
    w.clear_connector_metadata()
    assert w.get_block_ids_with_load_errors() == set()  # reported once
    client.load_nowait = real_send
