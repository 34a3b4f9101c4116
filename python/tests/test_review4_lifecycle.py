"""Review of the connector's lifecycle bookkeeping (scheduler_core `_lw_blocks`, `_async_targets`,
`_load_failed`; worker_core `_failed_loads` and its discards; the query issuer's held staging runs),
driven in vLLM's call order (tests/vllm_driver.py) against a real host-backend server:

- a request aborted after the step that loads it was scheduled (vLLM's async scheduling builds
  the next step before it sees that step's output): the next step admits another request on its
  loading blocks (a prefix hit in vLLM's cache; the aborted request's blocks are held, delayed by
  request_finished) and computes over them; when the load failed, that request's saves were
  stored, as request_finished had already forgotten which load filled those blocks;
- a request preempted without being named in `preempted_req_ids` (vLLM's
  `reset_prefix_cache(reset_running_requests=True)` preempts every running request outside
  schedule()) and resumed with new blocks and a new load: its first load's blocks stayed in
  `_lw_blocks` for good, and a request given one of them as a fresh block (its own KV computed in
  it) was tied to that load;
- a long run of requests (finished, aborted before they ran, aborted while loading, preempted,
  failed) leaves every per-request table empty, in both modes and with each load issuer;
- an async load failing into blocks another request loaded before marks only the failing request,
  and only for its own life: a later request with the same prompt loads;
- a claimed staging run whose copy never settles refuses probes (the room is full) for at most
  LINGER_LOAD_TIMEOUTS load timeouts, then is given back with a warning.
"""

from __future__ import annotations

import time

import pytest

from pegaflow.hashes import synthetic_tokens

from vllm_driver import (
    BLOCK,
    Request,
    lose_leases_after_alloc,
    out_of_range_targets,
    saved_prompt,
    sealed,
    wait_saved,
)


def _blocks(ids):
    from pegaflow.connector.vllm_api import KVCacheBlock, KVCacheBlocks

    return KVCacheBlocks(([KVCacheBlock(x) for x in ids],))


def test_a_request_admitted_on_an_aborted_requests_failing_load_does_not_save_over_it(engine_factory, uid):
    """Step N loads b's 5 blocks (its Load will fail) and computes 3 more. b is aborted before
    schedule(N+1) (request_finished: its free is delayed, its blocks stay in vLLM's prefix cache),
    and schedule(N+1), built before step N's output, admits c with b's 5 loading blocks as a
    local prefix hit; c computes 2 blocks over them. vLLM then truncates c (a running request
    over invalid blocks) and recomputes, but c's save of step N+1 had been stored: request_finished
    had dropped b's blocks from `_lw_blocks`, so c's save named no load. They stay tied to b's
    load until b's blocks are freed (finished_sending)."""
    eng = engine_factory("layerwise")
    shared, used = saved_prompt(eng, 191, uid)  # 5 full blocks on the server
    lose_leases_after_alloc(eng)
    b = Request("b", shared + synthetic_tokens(192, 3 * BLOCK + 1), salt=uid)
    assert eng.admit(b, avoid=used) == 5 * BLOCK
    del eng.sched._s().update_state_after_alloc  # only b's lease is lost
    b.num_computed_tokens = 5 * BLOCK
    out_n = eng._output([b], sched_tokens={"b": 3 * BLOCK})
    assert eng.finish(b) is True  # aborted while step N runs: blocks held until finished_sending
    c = Request("c", shared + synthetic_tokens(193, 2 * BLOCK + 1), salt=uid)
    c.num_computed_tokens = 5 * BLOCK
    assert eng.sched.get_num_new_matched_tokens(c, c.num_computed_tokens) == (0, False)
    c.block_ids = b.block_ids[:5] + [x for x in eng.free if x not in used][:3]
    for x in c.block_ids[5:]:
        eng.free.remove(x)
    eng.sched.update_state_after_alloc(c, _blocks(c.block_ids), 0)
    out_n1 = eng._output([c], sched_tokens={"c": c.num_tokens - c.num_computed_tokens})
    b.num_computed_tokens = 5 * BLOCK
    res = eng._step(out_n, {"b": b})
    assert res.invalid_block_ids == set(b.block_ids[:5])
    eng._step(out_n1, {"c": c})
    wait_saved(eng)
    assert sealed(eng, c.block_hashes[:7]) == 5, "c's blocks computed over b's failed load were saved"
    assert eng.worker.pegaflow_stats()["saves_dropped"] == 3 + 7  # b's 3, all 7 of c
    eng.drain("b")
    assert eng.finish(c) is True
    eng.drain("c")
    core = eng.sched._s()
    assert core._lw_blocks == {} and eng.worker._w()._failed_loads == set()


def test_a_request_preempted_outside_schedule_leaves_no_load_on_its_old_blocks(engine_factory, uid):
    """a loads 5 blocks (its Load fails: a is recomputed and its load is failed on the worker
    until a finishes). vLLM's reset_prefix_cache(reset_running_requests=True) preempts a outside
    schedule(): no preempted_req_ids names it, its blocks are freed. c is admitted on them as
    fresh blocks and computes its own KV there: its saves are no one's load's. a is resumed with
    new blocks and loads again; once a and c are done nothing of a's loads is left."""
    eng = engine_factory("layerwise")
    shared, used = saved_prompt(eng, 194, uid)
    lose_leases_after_alloc(eng)
    a = Request("a2", shared + synthetic_tokens(195, 2 * BLOCK + 1), salt=uid)
    assert eng.run_prefill(a, avoid=used) == 5 * BLOCK
    del eng.sched._s().update_state_after_alloc
    assert set(a.block_ids[:5]) <= eng.invalid_blocks
    wait_saved(eng)
    # reset_prefix_cache preempts a: blocks freed, num_computed_tokens 0, no preempted_req_ids.
    old = list(a.block_ids)
    eng.free[:0] = old
    a.num_computed_tokens = 0
    c = Request("c2", synthetic_tokens(196, 4 * BLOCK + 1), salt=uid)
    assert eng.run_prefill(c) == 0
    assert set(c.block_ids) & set(old[:5]), "c was not given a's old blocks"
    wait_saved(eng)
    dropped = eng.worker.pegaflow_stats().get("saves_dropped", 0)
    assert sealed(eng, c.block_hashes) == 4, f"c's own blocks were dropped ({dropped}) as computed over a's load"
    # a resumes (scheduled again from WAITING with new blocks) and loads its prefix again.
    assert eng.run_prefill(a, avoid=used | set(old) | set(c.block_ids)) == 5 * BLOCK
    for r in (a, c):
        assert eng.finish(r) is True
        eng.drain(r.request_id)
    assert eng.sched._s()._lw_blocks == {}, "a's first load's blocks are still named"


def _fail_loads(eng, issuer: str):
    """From now on every load of `issuer` fails (refused at the server); returns the undo."""
    if issuer == "worker":
        c = eng.worker._w().client
        real, name = c.load, "load"
        c.load = out_of_range_targets(real)
    elif issuer == "scheduler":
        c = eng.sched._s().client
        real, name = c.load_nowait, "load_nowait"
        c.load_nowait = out_of_range_targets(real)
    else:  # query: the load rides on the probe; its targets past the staging blocks are refused
        c = eng.sched._s()._query_issuer.client
        real, name = c.query_prefetch, "query_prefetch"

        def refused(**kw):
            if kw.get("load_into") is not None:
                kw = {**kw, "load_into": [10**6] * len(kw["load_into"])}
            return real(**kw)

        c.query_prefetch = refused
    return lambda: setattr(c, name, real)


def _until_recved(eng, rid: str, res) -> None:
    """Idle steps until an async load comes back in finished_recving (`res`: the last step's
    output; vLLM then frees a finished request's blocks: _update_from_kv_xfer_finished)."""
    for _ in range(400):
        if res.finished_recving and rid in res.finished_recving:
            if rid in eng.delayed:
                eng._free(eng.delayed.pop(rid))
            return
        time.sleep(0.005)
        res = eng.idle_step()
    raise AssertionError(f"{rid}'s async load never came back")


@pytest.mark.parametrize(
    "mode,issuer",
    [("layerwise", "worker"), ("layerwise", "scheduler"), ("layerwise", "query"), ("async", "worker"),
     ("async", "scheduler")],
)
def test_per_request_tables_are_empty_after_a_long_run_of_every_lifecycle(engine_factory, uid, mode, issuer):
    """Rounds of: a request that loads and finishes; one aborted after its probe, before it was
    allocated (vLLM's finish_requests on a WAITING request); one aborted while its load runs;
    one preempted (named in preempted_req_ids) and resumed; one whose load fails. Then every
    per-request table of both sides is empty and the staging room is whole."""
    extra = {"pegaflow.load_issuer": issuer}
    if issuer == "query":
        extra["pegaflow.staging_blocks"] = 16
    eng = engine_factory(mode, **extra)
    prompt, _ = saved_prompt(eng, 197, uid)
    core, wc = eng.sched._s(), eng.worker._w()
    n = 0

    def req() -> Request:
        nonlocal n
        n += 1
        return Request(f"r{n}", prompt + synthetic_tokens(1000 + n, BLOCK + 1), salt=uid)

    def done(r: Request) -> None:
        if eng.finish(r):
            eng.drain(r.request_id)

    for _ in range(3):
        r = req()  # loads and finishes
        assert eng.run_prefill(r) == 5 * BLOCK
        done(r)
        r = req()  # probed (a hit), aborted before it was allocated
        assert eng.sched.get_num_new_matched_tokens(r, 0)[0] == 5 * BLOCK
        assert eng.finish(r) is False
        r = req()  # aborted while its load runs
        assert eng.admit(r) == 5 * BLOCK
        r.num_computed_tokens = 5 * BLOCK
        out = eng._output([] if r.load_async else [r], sched_tokens={} if r.load_async else {r.request_id: BLOCK + 1})
        assert eng.finish(r) is True
        res = eng._step(out, {} if r.load_async else {r.request_id: r})
        if r.load_async:
            _until_recved(eng, r.request_id, res)
        else:
            eng.drain(r.request_id)
        r = req()  # preempted after its prefill, resumed later with new blocks (and a new load)
        assert eng.run_prefill(r) == 5 * BLOCK
        eng._step(eng._output([], preempted=[r.request_id]), {})
        eng._free(r)
        r.block_ids, r.num_computed_tokens = [], 0
        assert eng.run_prefill(r) == 6 * BLOCK  # its own 6th block was saved meanwhile
        done(r)
        refused = core.stats_snapshot().get("query_load_errors", 0)
        undo = _fail_loads(eng, issuer)  # its load fails: recomputed
        try:
            r = req()
            eng.run_prefill(r)
        finally:
            undo()
        if issuer == "query":  # refused at the query: a miss, its run drained
            assert core.stats_snapshot()["query_load_errors"] > refused
        else:
            assert eng.invalid_blocks, "the load did not fail"
        eng.invalid_blocks.clear()  # (the driver's record; those blocks are handed out again)
        done(r)
    for _ in range(3):
        eng.idle_step()
    if issuer == "query":
        end = time.monotonic() + 10
        while core._query_issuer.draining:  # refused loads' states settle at the server
            assert time.monotonic() < end, "a drained staging run is never given back"
            time.sleep(0.01)
            eng.idle_step()
        assert core.staging.held == 0 and core.staging.offer(16) == 16
    assert core._probes == {} and core._tracked == {} and core._delayed == set() and core._loading == set()
    assert core._lw_blocks == {} and core._finished_loads == {}
    assert core._async_targets == {} and core._load_failed == set()
    assert wc._failed_loads == set() and wc._unsent_discard == ([], "")
    assert wc._pending == {} and wc._saving == set() and wc._finishing == set() and wc._lingering == []
    assert wc._async_loads == {} and wc.step_loads == []


def test_an_async_load_failing_into_blocks_another_request_loaded_marks_only_its_own_request(engine_factory, uid):
    """r1's async load lands; r1 runs, is preempted (its blocks freed) and waits to resume. r2 is
    given r1's old blocks and its load into them fails: only r2 is a miss when vLLM retries it
    (failed_load_retries), r1 still loads when it resumes. Once the server loads again, r2 stays a
    miss for its own life (documented: "a miss from then on"), and r3 with r2's prompt loads."""
    eng = engine_factory("async")
    prompt, used = saved_prompt(eng, 198, uid)
    core = eng.sched._s()
    r1 = Request("r1", prompt + synthetic_tokens(199, BLOCK + 1), salt=uid)
    assert eng.run_prefill(r1, avoid=used) == 5 * BLOCK
    eng._step(eng._output([], preempted=["r1"]), {})
    old = list(r1.block_ids)
    eng.free[:0] = old
    r1.block_ids, r1.num_computed_tokens = [], 0
    undo = _fail_loads(eng, "worker")
    try:
        r2 = Request("r2", prompt + synthetic_tokens(200, BLOCK + 1), salt=uid)
        assert eng.run_prefill(r2) == 0  # offered 5 blocks; all failed, computed (_handle_invalid_blocks)
    finally:
        undo()
    assert set(r2.block_ids[:5]) == set(old[:5]) and set(old[:5]) <= eng.invalid_blocks
    eng.invalid_blocks.clear()
    assert core._load_failed == {"r2"} and core._async_targets == {}
    assert eng.sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # vLLM's retry: a miss
    assert core.stats_snapshot()["failed_load_retries"] == 1
    assert eng.run_prefill(r1, avoid=used | set(r2.block_ids)) == 6 * BLOCK  # r1 resumes and loads
    assert eng.sched.get_num_new_matched_tokens(r2, 0) == (0, False)  # still a miss for its life
    wait_saved(eng)  # r2's recomputed blocks are on the server (r3 raced their save: 5 hits of 6)
    r3 = Request("r3", list(r2.prompt_token_ids), salt=uid)
    assert eng.run_prefill(r3, avoid=used | set(r1.block_ids) | set(r2.block_ids)) == 6 * BLOCK
    for r in (r1, r2, r3):
        if eng.finish(r):
            eng.drain(r.request_id)
    assert core._load_failed == set() and core._async_targets == {} and core._loading == set()


def test_a_claimed_staging_run_whose_copy_never_settles_refuses_probes_for_a_bounded_time(engine_factory, uid, caplog):
    """Query issuer, a staging room of 5 blocks: r1's claimed run (all of them) holds a copy the
    server never settles (the states it writes are others'), so r1 times out and is recomputed.
    Every probe meanwhile finds the room full (a miss, counted in staging_full), not for good:
    LINGER_LOAD_TIMEOUTS load timeouts after the claim the run is given back, with a warning
    (query_loads_abandoned), and r2 loads."""
    from pegaflow.connector.lifecycle import LINGER_LOAD_TIMEOUTS
    from pegaflow.load_state import LoadState

    timeout_s = 0.2
    eng = engine_factory(
        "layerwise",
        **{"pegaflow.staging_blocks": 5, "pegaflow.load_issuer": "query", "pegaflow.load_timeout_ms": 200},
    )
    p1, used = saved_prompt(eng, 201, uid)
    core = eng.sched._s()
    qi = core._query_issuer
    real_query = qi.client.query_prefetch
    decoys = []

    def r1_copy_never_settles(**kw):
        if kw.get("request_id") == "r1" and kw.get("load_states"):
            ds = {r: LoadState.create() for r in kw["load_states"]}
            decoys.extend(ds.values())
            kw = {**kw, "load_states": {r: st.name for r, st in ds.items()}}
        return real_query(**kw)

    qi.client.query_prefetch = r1_copy_never_settles
    try:
        r1 = Request("r1", list(p1) + [7], salt=uid)
        claimed = time.monotonic()
        eng.run_prefill(r1, avoid=used)
        assert set(r1.block_ids[:5]) <= eng.invalid_blocks  # timed out: recomputed
        eng.layer_violations.clear()  # (r1's step read what never landed: vLLM drops its token)
        r2 = Request("r2", list(p1) + [8], salt=uid)
        full = core.stats_snapshot().get("staging_full", 0)
        assert eng.sched.get_num_new_matched_tokens(r2, 0) == (0, False)
        assert core.stats_snapshot()["staging_full"] == full + 1 and core.staging.held == 1
        with caplog.at_level("WARNING", logger="pegaflow.connector"):
            while time.monotonic() < claimed + timeout_s * LINGER_LOAD_TIMEOUTS + 0.05:
                eng.idle_step()
                time.sleep(0.02)
            assert eng.run_prefill(r2, avoid=used | set(r1.block_ids)) == 5 * BLOCK
        eng.idle_step()  # the next build_step gives r2's own run back, its copy settled
        assert core.staging.held == 0 and core.stats_snapshot()["query_loads_abandoned"] == 1
        assert any("still pending" in m and "r1" in m for m in caplog.messages), caplog.messages
        assert eng.layer_violations == [] and eng.holds_all(r2, r2.num_tokens)
        for r in (r1, r2):
            eng.finish(r)
            eng.drain(r.request_id)
    finally:
        for d in decoys:
            d.close()
