"""Delayed frees and saves at the edges of a request's life, driven in vLLM's call order
(tests/vllm_driver.py) against a real host-backend server: a request aborted while its async
load is still landing, after it had saved blocks earlier (before a preemption); blocks computed
over a layer-wise load that failed; a preemption that gave up on a load that then settled."""

from __future__ import annotations

import threading
import time

from pegaflow.connector.plan import LoadIntent, StepPlan
from pegaflow.connector.vllm_api import KVCacheBlock, KVCacheBlocks
from pegaflow.hashes import synthetic_tokens
from pegaflow.load_state import LoadState

from vllm_driver import BLOCK, LAYER_NAMES, Request, lose_leases_after_alloc, saved_prompt


def test_an_async_load_aborted_after_earlier_saves_is_freed_once_by_finished_recving(engine_factory, uid):
    """A request saved blocks, was preempted, resumed with an async load of them, and was aborted
    while that load was still landing. vLLM frees its blocks on finished_recving or on
    finished_sending (either; both is a double free): the worker must not report it in
    finished_sending (its saves are done) while the load still writes its blocks, and it must be
    reported once, in finished_recving, when the load has settled."""
    eng = engine_factory("async")
    r = Request("r", synthetic_tokens(61, 5 * BLOCK + 2), salt=uid)
    assert eng.run_prefill(r) == 0  # cold: saves its 5 full blocks
    first_blocks = set(r.block_ids)
    # Preempted: its blocks go back; the preemption waits for its saves.
    eng._step(eng._output([], preempted={"r"}), {})
    eng._free(r)
    r.num_computed_tokens = 0
    wc = eng.worker._w()
    real_load = wc.client.load
    gate = threading.Event()
    sent = threading.Event()

    def late_load(**kw):  # the Load reaches the server only once the gate opens
        def go():
            gate.wait(10)
            real_load(**kw)
            sent.set()

        threading.Thread(target=go, daemon=True).start()

    wc.client.load = late_load
    try:
        assert eng.admit(r, avoid=first_blocks) == 5 * BLOCK and r.load_async  # resumed: an async load
        res = eng._step(eng._output([]), {})  # start_load_kv: the load is under way
        assert not res.finished_recving
        assert eng.finish(r) is True  # aborted while loading: its blocks are held
        sending, recving = set(), []
        for _ in range(3):  # steps while the load is still landing
            res = eng.idle_step()
            sending |= res.finished_sending or set()
            recving += list(res.finished_recving or ())
        assert sending == set() and recving == [], "blocks freed while the async load still writes them"
        gate.set()
        assert sent.wait(10)
        deadline = time.monotonic() + 10
        while not recving:
            assert time.monotonic() < deadline, "the aborted async load never came back in finished_recving"
            res = eng.idle_step()
            sending |= res.finished_sending or set()
            recving += list(res.finished_recving or ())
            time.sleep(0.005)
        for _ in range(3):
            res = eng.idle_step()
            sending |= res.finished_sending or set()
            recving += list(res.finished_recving or ())
        assert recving == ["r"] and sending == set(), (recving, sending)
        assert eng.sched._s().delayed == set()
        eng.delayed.pop("r")
    finally:
        gate.set()  # whatever failed above, the Load goes out before the engine closes
        sent.wait(10)


def _hits(eng, req: Request) -> int:
    q = eng.sched.client.query_prefetch(
        instance_id=eng.sched.settings.instance_id, block_hashes=req.block_hashes, request_id="check"
    )
    if q.lease_id:
        eng.sched.client.release(q.lease_id)
    return q.hits


def test_blocks_computed_over_a_failed_layerwise_load_are_not_saved(engine_factory, uid):
    """A layer-wise load fails (its lease was lost) while the step computes the blocks after it,
    for its own request and for one that shares its loading blocks through the engine's prefix
    cache: those blocks' KV was computed over the failed prefix, so neither request's save of
    them may reach the server (vLLM recomputes them; stored, they would be served as hits)."""
    eng = engine_factory("layerwise")
    shared, used = saved_prompt(eng, 81, uid)  # 5 full blocks on the server
    lose_leases_after_alloc(eng)
    b = Request("b", shared + synthetic_tokens(82, 3 * BLOCK + 1), salt=uid)
    assert eng.admit(b, avoid=used) == 5 * BLOCK
    del eng.sched._s().update_state_after_alloc  # b's lease is lost; nothing else is
    # c hits b's 5 loading blocks in the engine's own prefix cache (vLLM caches a sync load's
    # blocks when it allocates them) and computes 2 more over them in the same step.
    c = Request("c", shared + synthetic_tokens(83, 2 * BLOCK + 1), salt=uid)
    c.num_computed_tokens = 5 * BLOCK
    assert eng.sched.get_num_new_matched_tokens(c, c.num_computed_tokens) == (0, False)
    c.block_ids = b.block_ids[:5] + [x for x in eng.free if x not in used][:3]
    for x in c.block_ids[5:]:
        eng.free.remove(x)
    eng.sched.update_state_after_alloc(c, KVCacheBlocks(([KVCacheBlock(x) for x in c.block_ids],)), 0)
    b.num_computed_tokens = 5 * BLOCK
    todo = {"b": b.num_tokens - b.num_computed_tokens, "c": c.num_tokens - c.num_computed_tokens}
    res = eng._step(eng._output([b, c], sched_tokens=todo), {"b": b, "c": c})
    assert res.invalid_block_ids == set(b.block_ids[:5])
    wc = eng.worker._w()
    deadline = time.monotonic() + 10
    while wc._pending:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _hits(eng, b) == 5 and _hits(eng, c) == 5, "blocks computed over the failed load were saved"
    assert wc.stats_snapshot()["saves_dropped"] == 3 + 7  # b: its 3 new blocks; c: all 7 of its
    for r in (b, c):  # both are still reported once done, as the scheduler delayed their frees
        assert eng.finish(r) is True
    eng.drain("b")
    eng.drain("c")


def test_a_preemption_that_gave_up_on_a_lingering_load_leaves_no_state_behind(engine_factory, uid):
    """A layer-wise load times out (it may still land, so it lingers and holds its request), and
    the request's preemption stops waiting for it at the save deadline, marking the request's
    queued saves cut. Once the server settles the load, nothing of the request may stay behind
    in the worker (an entry per such request, for good)."""
    eng = engine_factory("layerwise", **{"pegaflow.save_timeout_ms": 200, "pegaflow.load_timeout_ms": 200})
    w = eng.worker._w()
    st = LoadState.create()  # the scheduler's state of a Load the server has not settled
    try:
        w.bind(StepPlan(loads=[LoadIntent("p", b"\x01" * 16, [1, 2], states={(0, 0): st.name})]))
        w.start_load()
        for name in LAYER_NAMES:
            w.wait_for_layer_load(name)  # times out at the first layer: the load lingers
        w.wait_for_save()
        w.unbind()
        assert w.take_load_errors() == {1, 2}
        w.handle_preemptions(["p"])  # gives up after the save deadline
        assert w.stats_snapshot()["preemption_wait_timeouts"] == 1
        st.mark_failed()  # the server settles it
        sending, _ = w.get_finished({"p"})
        assert sending == {"p"}
        assert not w._pending and not w._cut and not w._saving, (dict(w._pending), w._cut, w._saving)
    finally:
        st.close()
