"""Layer-wise loads through staging blocks (pegaflow.staging_blocks, connector/staging.py):
the server copies into a contiguous run of the worker's staging blocks, registered as a
second instance of the namespace, and each layer is scattered into the request's own
blocks before its attention — whatever order those blocks come in. Every load issuer
(worker, scheduler, and "query": the load rides on the probe's QueryPrefetch), against a
real host-backend server."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pegaflow.client import PegaflowClient
from pegaflow.config import ClientConfig
from pegaflow.connector.scheduler_core import SchedulerCore

from pegaflow.errors import PegaflowError
from pegaflow.connector.staging import STAGING_SUFFIX, StagingRoom, staging_instance
from pegaflow.hashes import synthetic_tokens

from kv_helpers import my_states
from server_proc import silent_local_rpc
from tp_ranks import Req
from vllm_driver import BLOCK, Engine, Request, lose_leases_after_alloc, lose_load_answers
from waits import wait_for

ISSUERS = ["worker", "scheduler", "query"]


@pytest.fixture
def make_engine(engine_factory):
    def make(staging: int, issuer: str) -> Engine:
        return engine_factory(
            "layerwise", **{"pegaflow.staging_blocks": staging, "pegaflow.load_issuer": issuer}
        )

    return make


def _cold(eng: Engine, uid: str, seed: int, blocks: int) -> tuple:
    prompt = synthetic_tokens(seed, blocks * BLOCK + 2)
    cold = Request("cold", prompt, salt=uid)
    assert eng.run_prefill(cold) == 0
    eng.finish(cold)
    eng.drain("cold")
    return prompt, cold


@pytest.mark.parametrize("issuer", ISSUERS)
def test_a_staged_load_lands_byte_exact_in_blocks_given_in_reverse_order(make_engine, uid, issuer):
    eng = make_engine(16, issuer)
    prompt, cold = _cold(eng, uid, 41, 6)
    # The free list handed out backwards (as vLLM's after a request frees its blocks).
    eng.free = sorted(eng.free, reverse=True)
    warm = Request("warm", list(prompt), salt=uid)
    assert eng.run_prefill(warm, avoid=set(cold.block_ids)) == 6 * BLOCK
    assert warm.block_ids[:6] == sorted(warm.block_ids[:6], reverse=True)
    # Every layer held the loaded prefix before its attention ran, and the bytes are right.
    assert eng.layer_violations == [] and eng.invalid_blocks == set()
    assert eng.holds_all(warm, warm.num_tokens)
    assert eng.sched._s().load_instance == staging_instance(eng.sched._s().instance_id)


def test_a_prefix_longer_than_the_staging_blocks_loads_what_fits_and_computes_the_rest(make_engine, uid):
    eng = make_engine(3, "scheduler")
    prompt, cold = _cold(eng, uid, 42, 6)
    warm = Request("warm", list(prompt), salt=uid)
    assert eng.run_prefill(warm, avoid=set(cold.block_ids)) == 3 * BLOCK
    assert eng.layer_violations == [] and eng.holds_all(warm, warm.num_tokens)
    assert eng.sched._s().stats["staging_full"] == 0  # capped, not refused


@pytest.mark.parametrize("issuer", ISSUERS)
def test_a_failed_staged_load_reports_the_requests_own_blocks(make_engine, uid, issuer):
    eng = make_engine(16, issuer)
    prompt, cold = _cold(eng, uid, 43, 5)
    if issuer == "worker":
        # The lease is given back between the scheduler's decision and the worker's Load.
        lose_leases_after_alloc(eng)
    elif issuer == "scheduler":
        # The scheduler's Load is refused (as by a server that lost the instance).
        def refused(*, on_done, **_kw):
            on_done(PegaflowError(grpc.StatusCode.FAILED_PRECONDITION, "refused by the test", "Load"))

        eng.sched._s().client.load_nowait = refused
    else:
        # The copy the query started fails (as a device error would report it in the state).
        qi = eng.sched._s()._query_issuer
        query = qi.query

        def copy_fails(rid, instance_id, hashes):
            q, early = query(rid, instance_id, hashes)
            for st in early.states.values():
                st.wait_all(10.0)  # settled by the server first: nothing overwrites the mark
                st.mark_failed()
            return q, early

        qi.query = copy_fails
    warm = Request("warm", list(prompt), salt=uid)
    eng.run_prefill(warm, avoid=set(cold.block_ids))
    assert eng.invalid_blocks == set(warm.block_ids[:5])  # not the staging blocks 0..4
    assert eng.holds_all(warm, warm.num_tokens)  # recomputed


def test_staging_room_reserves_per_probe_and_frees_at_each_step():
    room = StagingRoom(10)
    assert room.offer(7) == 7
    room.reserve(7)
    assert room.offer(7) == 3  # another probe in the same step gets what is left
    assert room.take(5, reserved=7) == 0  # allocated 5 of its 7 hits: 2 go back
    assert room.offer(10) == 5
    room.reserve(5)
    assert room.take(5, reserved=5) == 5
    with pytest.raises(ValueError, match="0 free"):
        room.take(1, reserved=0)
    room.next_step()
    assert room.offer(10) == 10


def test_the_staging_instance_stays_within_the_name_limit():
    assert staging_instance("engine-1") == "engine-1" + STAGING_SUFFIX
    long_a, long_b = "a" * 127 + "x", "a" * 127 + "y"
    sa, sb = staging_instance(long_a), staging_instance(long_b)
    assert len(sa) <= 128 and len(sb) <= 128 and sa != sb and sa.endswith(STAGING_SUFFIX)


def _probe(eng: Engine, req: Request) -> int:
    n, _ = eng.sched.get_num_new_matched_tokens(req, 0)
    return n


def test_a_query_issued_load_outlives_a_step_that_did_not_schedule_its_request(make_engine, uid):
    eng = make_engine(16, "query")
    prompt, cold = _cold(eng, uid, 44, 6)
    core = eng.sched._s()
    warm = Request("warm", list(prompt), salt=uid)
    assert _probe(eng, warm) == 6 * BLOCK  # the copy into staging blocks 0..5 starts here
    assert core.staging.held == 1
    eng.idle_step()  # a step built without the request (the engine had no room for it, say)
    assert core.staging.held == 1 and core.staging.offer(16) == 10, "its run outlived the step"
    assert eng.run_prefill(warm, avoid=set(cold.block_ids)) == 6 * BLOCK
    # One query for the cold request (a miss) and one for the warm one: its second admission
    # used the first probe and its running copy.
    assert core.stats["queries"] == 2 and core.stats["query_loads"] == 1
    assert eng.layer_violations == [] and eng.invalid_blocks == set()
    assert eng.holds_all(warm, warm.num_tokens)
    # The run is given back at the first step built after its copies settled: the step that
    # computed the request waited for them, but was built while they ran (on a loaded machine).
    wait_for(lambda: (eng.idle_step(), core.staging.held == 0)[1], "the claimed run given back", 10)


def test_an_unused_query_issued_probe_holds_its_run_until_its_copy_settled(make_engine, uid):
    eng = make_engine(16, "query")
    prompt, _ = _cold(eng, uid, 45, 6)
    core = eng.sched._s()
    warm = Request("warm", list(prompt), salt=uid)
    assert _probe(eng, warm) == 6 * BLOCK
    assert eng.finish(warm) is False  # never allocated: nothing of the engine's to hold
    qi = core._query_issuer
    assert qi.draining == 1 and core.staging.held == 1, "the run waits for its copy"
    deadline = time.monotonic() + 10
    while qi.draining and time.monotonic() < deadline:
        time.sleep(0.005)
        qi.poll()
    assert qi.draining == 0 and core.staging.held == 0 and core.staging.offer(16) == 16
    assert core.stats["query_loads_dropped"] == 1
    # The blocks are still cached: the next request of the prefix loads them.
    again = Request("again", list(prompt), salt=uid)
    assert eng.run_prefill(again) == 6 * BLOCK and eng.holds_all(again, again.num_tokens)


def test_the_query_issuer_needs_staging_blocks(engine_factory):
    with pytest.raises(ValueError, match="staging_blocks > 0"):
        engine_factory("layerwise", **{"pegaflow.load_issuer": "query"})
    with pytest.raises(ValueError, match="staging_blocks > 0"):
        engine_factory("async", **{"pegaflow.load_issuer": "query", "pegaflow.staging_blocks": 8})


def test_staging_room_holds_runs_across_steps_above_the_steps_own():
    room = StagingRoom(10)
    room.reserve(2)
    assert room.take(2, reserved=2) == 0
    assert room.hold("a", 5) == 2  # above this step's run
    room.shrink("a", 3)  # a hit of 3: blocks 5, 6 go back
    assert room.offer(10) == 5
    room.next_step()
    assert room.offer(10) == 5, "the held run outlives the step; new runs go above it"
    assert room.hold("b", 4) == 5
    room.rekey("a", ("a", 1))
    assert room.claim("b") == (5, 4)
    room.release(("a", 1))
    assert room.offer(10) == 1, "b is this step's run until the next step"
    room.next_step()
    assert room.offer(10) == 10 and room.held == 0
    assert room.hold("c", 7) == 0
    with pytest.raises(ValueError, match="3 free"):
        room.hold("d", 4)


def test_a_refused_query_gives_its_run_and_states_back_at_once(server, uid):
    """The staging instance is not registered: the server refuses the query before any load, so
    nothing can ever write the run: it is free again and no state is left behind."""
    before = my_states()
    client = PegaflowClient(server.addr)
    sched = SchedulerCore(client, instance_id=uid, block_size=BLOCK, load_issuer="query", staging_blocks=8)
    try:
        req = Req("r", synthetic_tokens(46, 4 * BLOCK + 1), uid)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.stats["query_errors"] == 1
        assert sched.staging.held == 0 and sched.staging.offer(8) == 8
    finally:
        sched.close()
        client.close()
    assert my_states() == before


def test_a_query_that_may_have_reached_the_server_holds_its_run_until_its_deadline(uid, tmp_path):
    """A server that never answers: the query times out (DEADLINE_EXCEEDED), so its loads may
    still run; the run stays held until the states settle or 3 load timeouts pass."""
    base = str(tmp_path / "silent.sock")
    before = my_states()
    with silent_local_rpc(base):
        cfg = ClientConfig.resolve(addr="unix:" + base, rpc_timeout_ms=200, load_timeout_ms=100)
        client = PegaflowClient(config=cfg)
        sched = SchedulerCore(client, instance_id=uid, block_size=BLOCK, load_issuer="query", staging_blocks=8)
        try:
            req = Req("r", synthetic_tokens(47, 4 * BLOCK + 1), uid)
            assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
            qi = sched._query_issuer
            assert qi.draining == 1 and sched.staging.offer(8) == 4, "the run waits: a copy may still land"
            deadline = time.monotonic() + 5
            while qi.draining and time.monotonic() < deadline:
                time.sleep(0.02)
                sched.build_step([])
            assert qi.draining == 0 and sched.staging.offer(8) == 8
            assert sched.stats["query_loads_abandoned"] == 1
        finally:
            sched.close()
            client.close()
    assert my_states() == before


@pytest.mark.parametrize("issuer", ["worker", "scheduler"])
def test_a_staged_load_whose_answer_was_lost_holds_its_request_and_the_staging_blocks_until_it_settles(
    engine_factory, uid, issuer
):
    # A Load that ended DEADLINE_EXCEEDED (or UNAVAILABLE, ...) may still reach the server and
    # copy into the staging run: the load is recomputed, but the next staged load must not
    # scatter from that run, nor the request's blocks be reused, until the copy settled.
    eng = engine_factory(
        "layerwise",
        **{"pegaflow.staging_blocks": 16, "pegaflow.load_issuer": issuer, "pegaflow.load_timeout_ms": 300},
    )
    prompt, cold = _cold(eng, uid, 44, 5)
    gate = threading.Event()
    sent, restore = lose_load_answers(eng, issuer, gate)
    warm = Request("warm", list(prompt), salt=uid)
    eng.run_prefill(warm, avoid=set(cold.block_ids))
    assert eng.invalid_blocks == set(warm.block_ids[:5])  # failed → recomputed
    assert eng.holds_all(warm, warm.num_tokens)
    w = eng.worker._w()
    assert len(w._lingering) == 1 and w._pending.get("warm") == 1, "the lost Load's copy is not waited for"
    restore()
    # Fenced: while that copy may land in the staging run, a staged load is not scattered from it.
    again = Request("again", list(prompt), salt=uid)
    eng.run_prefill(again, avoid=set(cold.block_ids) | set(warm.block_ids))
    assert set(again.block_ids[:5]) <= eng.invalid_blocks and eng.holds_all(again, again.num_tokens)
    gate.set()
    end = time.monotonic() + 10
    while w._lingering or w._pending.get("warm"):
        assert time.monotonic() < end, "the lost Load's hold never ended"
        eng.idle_step()
        time.sleep(0.01)
    assert sent, "the hold ended before the late Load was even sent"
    for r in (warm, again):
        eng.finish(r)
        eng.drain(r.request_id)
    # The staging blocks serve again.
    third = Request("third", list(prompt), salt=uid)
    before = set(eng.invalid_blocks)
    assert eng.run_prefill(third, avoid=set(cold.block_ids)) == 5 * BLOCK
    assert eng.invalid_blocks == before and eng.holds_all(third, third.num_tokens)


def test_staging_buffers_that_fail_midway_unlink_the_regions_they_made():
    """A layer whose staging tensor cannot be made (here a dimension of 0) raises from the
    constructor, after earlier layers got their shm regions: nobody holds the object to close
    them, so the constructor must (they were left in /dev/shm)."""
    import os

    import numpy as np

    from pegaflow.connector.staging import StagingBuffers

    mine = f"pegaflow-kv-{os.getpid()}-"
    before = {f for f in os.listdir("/dev/shm") if f.startswith(mine)}
    kv = {"model.layers.0.attn": np.zeros((2, 4, 4, 2, 8), np.float16),
          "model.layers.1.attn": np.zeros((2, 4, 4, 0, 8), np.float16)}
    with pytest.raises(ValueError, match="dimension <= 0"):
        StagingBuffers(kv, 2)
    assert {f for f in os.listdir("/dev/shm") if f.startswith(mine)} == before
