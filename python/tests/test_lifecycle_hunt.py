"""Request lifecycles vLLM can produce that once left the connector in a wrong state, each driven
in vLLM's order against a real host-backend server:

- an async load that fails every time: vLLM retries the request (it asks
  get_num_new_matched_tokens again), and the connector offered the same failing load at every
  retry, so the request never ran;
- a query-issued load claimed after a timed-out staged load's late copy settled: both copies went
  into the same staging blocks, and the later request was scattered the late copy's bytes;
- a step the engine scheduled before it saw a layer-wise load fail (vLLM's async scheduling): the
  saves of blocks it computed over that load were stored;
- with TP, a layer-wise load that failed on one rank alone left the other ranks' saves of that
  step, whose slots a later correct save of the prefix sealed: the failing rank now discards
  those hashes at the server (`SaveRequest.discard_hashes`).
"""

from __future__ import annotations

import os
import random
import time

import pytest

from pegaflow.connector.staging import staging_instance
from pegaflow.hashes import synthetic_tokens
from pegaflow.load_state import LoadState

from minivllm_runs import pega_engine, regions, run  # noqa: F401 (regions: a fixture)
from waits import wait_for
from tiny_model import TINY, model  # noqa: F401 (model: a fixture)
from vllm_driver import (
    BLOCK,
    Request,
    lose_leases_after_alloc,
    out_of_range_targets,
    saved_prompt,
    sealed,
    wait_saved,
)


@pytest.mark.parametrize("issuer", ["worker", "scheduler"])
def test_a_request_whose_async_load_failed_is_not_offered_the_load_again_when_vllm_retries_it(
    model, server, regions, uid, issuer  # noqa: F811
):
    """vLLM's scheduler handles a failed async load by putting the request back to WAITING with
    nothing computed and asking the connector again (`_update_waiting_for_remote_kv`: "there may
    be a local cache hit on retry"). A load that fails every time (here: every Load refused)
    was offered again at each retry: the request went WAITING_FOR_REMOTE_KVS → WAITING → ... and
    never ran. Once its load failed, the request is a miss and is computed."""
    rng = random.Random(uid)
    prompt = [rng.randrange(TINY.vocab_size) for _ in range(150)]
    eng = pega_engine(model, server, regions, uid, "async", issuer)
    try:
        cold, *_ = run(eng, prompt, max_tokens=3)
        eng.drain(timeout_s=60)
        assert eng.reset_prefix_cache()
        if issuer == "worker":
            c = eng.worker_connector._w().client
            c.load = out_of_range_targets(c.load)
        else:
            c = eng.scheduler_connector._s().client
            c.load_nowait = out_of_range_targets(c.load_nowait)
        before = eng.scheduler_connector.pegaflow_stats()
        warm, *_ = run(eng, prompt, max_tokens=3, max_steps=60)
        assert warm.output_token_ids == cold.output_token_ids
        stats = eng.scheduler_connector.pegaflow_stats()
        assert stats["load_intents"] - before.get("load_intents", 0) == 1, "the failing load was offered again"
        assert stats["failed_load_retries"] == 1
        eng.drain(timeout_s=60)
        core = eng.scheduler_connector._s()
        assert not core._load_failed and not core._async_targets and not core._loading
    finally:
        eng.shutdown()


def _saved(eng, uid: str, rid: str, seed: int, blocks: int):
    prompt = synthetic_tokens(seed, blocks * BLOCK + 2)
    r = Request(rid, prompt, salt=uid)
    assert eng.run_prefill(r) == 0
    eng.finish(r)
    eng.drain(rid)
    return prompt, set(r.block_ids)


def test_a_query_issued_run_is_not_reused_while_a_timed_out_copy_into_it_may_land(engine_factory, uid):
    """r1's query-issued load times out at the worker (its copy is late: the server writes and
    settles it only later), so r1 is recomputed and the worker fences staged loads while it
    lingers. r2 is probed next: its copy started at once, into the staging blocks the step's
    end had freed, r1's. r1's late copy then lands and settles, the worker lets r1 go, and r2 is
    claimed: r2's run held r1's bytes, scattered into r2's blocks with no error. A claimed run
    now stays held until its copies settled, so r2's run goes elsewhere."""
    eng = engine_factory(
        "layerwise",
        **{"pegaflow.staging_blocks": 16, "pegaflow.load_issuer": "query", "pegaflow.load_timeout_ms": 300},
    )
    p1, used1 = _saved(eng, uid, "c1", 71, 5)
    p2, used2 = _saved(eng, uid, "c2", 72, 5)
    core = eng.sched._s()
    qi = core._query_issuer
    real_query = qi.client.query_prefetch
    late_names, decoys = [], []

    def r1_copy_is_late(**kw):
        # r1's probe: the server copies into the run but settles decoy states, so r1's own stay
        # pending (a copy that has not landed); a second name keeps r1's state for the late Load.
        if kw.get("request_id") == "r1" and kw.get("load_states"):
            for name in kw["load_states"].values():
                os.link("/dev/shm" + name, "/dev/shm" + name + "-late")
                late_names.append(name + "-late")
            ds = {r: LoadState.create() for r in kw["load_states"]}
            decoys.extend(ds.values())
            kw = {**kw, "load_states": {r: st.name for r, st in ds.items()}}
        return real_query(**kw)

    qi.client.query_prefetch = r1_copy_is_late
    try:
        r1 = Request("r1", list(p1), salt=uid)
        eng.run_prefill(r1, avoid=used1 | used2)
        assert set(r1.block_ids[:5]) <= eng.invalid_blocks  # timed out: recomputed
        w = eng.worker._w()
        assert len(w._lingering) == 1
        r2 = Request("r2", list(p2), salt=uid)
        assert eng.sched.get_num_new_matched_tokens(r2, 0) == (5 * BLOCK, False)  # r2's copy starts
        # r1's late copy (p1's KV) lands in staging blocks 0..4, then its state settles.
        client, staged = eng.sched.client, staging_instance(core.instance_id)
        q = client.query_prefetch(instance_id=staged, block_hashes=r1.block_hashes[:5], request_id="late")
        assert q.hits == 5
        late = LoadState.attach(late_names[0])
        try:
            client.load(instance_id=staged, tp_rank=0, pp_rank=0, lease_id=q.lease_id, block_ids=list(range(5)),
                        load_state_shm=late_names[0], request_id="late")
            end = time.monotonic() + 10
            while late.poll() is None:
                assert time.monotonic() < end, "the late copy never settled"
                time.sleep(0.01)
        finally:
            late.close()
        eng.idle_step()
        assert w._lingering == []  # the worker saw r1's copy settle
        eng.layer_violations.clear()
        assert eng.run_prefill(r2, avoid=used1 | used2 | set(r1.block_ids)) == 5 * BLOCK
        assert eng.layer_violations == [] and eng.holds_all(r2, r2.num_tokens), "r2 computed over r1's bytes"
        assert not set(r2.block_ids) & eng.invalid_blocks
        for r in (r1, r2):
            eng.finish(r)
            eng.drain(r.request_id)
        assert qi.draining == 0 and core.staging.held == 0 and core.staging.offer(16) == 16
    finally:
        for name in late_names:
            try:
                os.unlink("/dev/shm" + name)
            except FileNotFoundError:
                pass
        for d in decoys:
            d.close()


def test_saves_of_a_step_scheduled_before_a_layerwise_load_failed_are_dropped(engine_factory, uid):
    """vLLM's async scheduling builds step N+1 before step N's output: b's next prefill chunk,
    and c, admitted with b's loading blocks as a local prefix hit, are scheduled before the
    engine learns that b's load in step N failed. Both compute over b's failed blocks in step
    N+1; their saves of those blocks reached the server (stored, they would be served as hits
    of that prefix). A save naming a failed load is dropped in every later step too."""
    eng = engine_factory("layerwise")
    shared, used = saved_prompt(eng, 91, uid)  # 5 full blocks on the server
    lose_leases_after_alloc(eng)
    b = Request("b", shared + synthetic_tokens(92, 8 * BLOCK + 1), salt=uid)
    assert eng.admit(b, avoid=used) == 5 * BLOCK
    del eng.sched._s().update_state_after_alloc  # only b's lease is lost
    b.num_computed_tokens = 5 * BLOCK
    out_n = eng._output([b], sched_tokens={"b": 3 * BLOCK})  # b: load blocks 0..4, compute 5..7
    # Step N+1, scheduled while step N runs: b's next chunk (blocks 8..10), and c, which hits
    # b's 5 loading blocks in vLLM's prefix cache and computes 2 more.
    b.num_computed_tokens = 8 * BLOCK
    c = Request("c", shared + synthetic_tokens(93, 2 * BLOCK + 1), salt=uid)
    c.num_computed_tokens = 5 * BLOCK
    assert eng.sched.get_num_new_matched_tokens(c, c.num_computed_tokens) == (0, False)
    c.block_ids = b.block_ids[:5] + [x for x in eng.free if x not in used][:3]
    for x in c.block_ids[5:]:
        eng.free.remove(x)
    eng.sched.update_state_after_alloc(c, eng_blocks(c.block_ids), 0)
    out_n1 = eng._output([c], cached=[b], sched_tokens={"b": 3 * BLOCK, "c": c.num_tokens - c.num_computed_tokens})
    b.num_computed_tokens = 5 * BLOCK
    res = eng._step(out_n, {"b": b})
    assert res.invalid_block_ids == set(b.block_ids[:5])
    b.num_computed_tokens = 8 * BLOCK
    eng._step(out_n1, {"b": b, "c": c})
    wait_saved(eng)
    assert sealed(eng, b.block_hashes[8:11]) == 0, "b's blocks computed over its failed load were saved"
    assert sealed(eng, c.block_hashes[5:7]) == 0, "c's blocks computed over b's failed load were saved"
    assert eng.worker.pegaflow_stats()["saves_dropped"] == 3 + 3 + 7  # b in N, b in N+1, all 7 of c
    for r in (b, c):
        assert eng.finish(r) is True  # still reported once done: the scheduler delayed their frees
    eng.drain("b")
    eng.drain("c")
    assert eng.worker._w()._failed_loads == set() and eng.sched._s()._lw_blocks == {}


def eng_blocks(ids):
    from pegaflow.connector.vllm_api import KVCacheBlock, KVCacheBlocks

    return KVCacheBlocks(([KVCacheBlock(x) for x in ids],))


class _RefusedLoads:
    """A client whose Loads are refused (every target past the KV cache); all else as `client`'s."""

    def __init__(self, client):
        self._client = client
        self.load = out_of_range_targets(client.load)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_with_tp_a_load_failing_on_one_rank_keeps_the_other_ranks_saves_of_that_step(server, uid):
    """TP 2, layer-wise: b loads 3 blocks and computes 2 more in one step. Rank 0's Load is refused,
    rank 1's lands. Rank 0 drops its save of the 2 blocks (computed over its failed load); rank 1
    saves its slot of them, though its KV of those tokens was computed from hidden states rank
    0's garbage KV fed through the all-reduce (modelled here: other bytes). The blocks stayed
    unsealed until a correct computation of the same prompt (c) saved on both ranks: the server
    skipped rank 1's slot as already filled and sealed the blocks with the bad one, and the next
    request that loaded them (d) got it. Now rank 0 sends the 2 hashes as discard_hashes: the
    server drops rank 1's slot (or refuses it, whichever arrives first) and refuses saves of them
    for DISCARD_TTL_MS (lib/storage/discard.ts), c's included; d loads the 3 blocks held, each
    with the right bytes on every rank, and computes the rest."""
    from pegaflow.client import PegaflowClient
    from pegaflow.connector.plan import ScheduledRequest
    from pegaflow.connector.scheduler_core import SchedulerCore

    from tp_ranks import Req, TwoRanks, rank_content

    client = PegaflowClient(server.addr)
    ranks = None
    try:
        ranks = TwoRanks(client, uid)
        sched = SchedulerCore(client, instance_id=uid, block_size=BLOCK, mode="layerwise")
        a = Req("a", synthetic_tokens(95, 3 * BLOCK + 1), uid)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        sched.update_state_after_alloc(a, [1, 2, 3, 4], 0)
        plan = sched.build_step([ScheduledRequest("a", [1, 2, 3, 4], True, 0, a.num_tokens)])
        ranks.save_step(sched, plan, a, [1, 2, 3])

        b = Req("b", list(a.tokens[: 3 * BLOCK]) + synthetic_tokens(96, 2 * BLOCK + 1), uid)
        hashes = b.block_hashes
        assert sched.get_num_new_matched_tokens(b, 0) == (3 * BLOCK, False)
        sched.update_state_after_alloc(b, [9, 10, 11, 12, 13, 14], 3 * BLOCK)
        plan = sched.build_step([ScheduledRequest("b", [9, 10, 11, 12, 13, 14], True, 3 * BLOCK, 2 * BLOCK + 1)])
        assert [s.block_ids for s in plan.saves] == [[12, 13]]
        ranks.workers[0].client = _RefusedLoads(client)
        # Rank 1 first: rank 0's refused Load gives the lease back, and a Load sent after that
        # is refused too (the ranks of one engine run concurrently; either order happens).
        for rank in (1, 0):
            w, kv = ranks.workers[rank], ranks.kvs[rank]
            for li, t in enumerate(kv.values()):
                for blk, h in zip([12, 13], hashes[3:5]):
                    for s in range(2):
                        t[s, blk] = rank_content(h + (b"over-garbage" if rank == 1 else b""), rank, li, s)
            w.bind(plan)
            w.start_load()
            for name in kv:
                w.wait_for_layer_load(name)
            w.wait_for_save()
            assert w.take_load_errors() == ({9, 10, 11} if rank == 0 else set())
            w.unbind()
        ranks.workers[0].client = client

        def saved_all() -> None:
            for rank, w in enumerate(ranks.workers):
                wait_for(lambda: not w._pending, f"rank {rank}'s saves", timeout_s=10)

        saved_all()
        # Rank 0's discard travels in a job of its own (its saves were all dropped), which
        # saved_all does not wait for: c's saves must come after the server applied it.
        wait_for(
            lambda: ranks.workers[0].stats_snapshot().get("saves_discarded", 0) >= 2,
            "rank 0's discard answered", timeout_s=10,
        )
        c = Req("c", list(b.tokens), uid)  # the same prompt, computed right on both ranks
        for rank, kv in enumerate(ranks.kvs):
            for li, t in enumerate(kv.values()):
                for blk, h in zip([1, 2, 3, 4, 5], hashes[:5]):
                    for s in range(2):
                        t[s, blk] = rank_content(h, rank, li, s)
        assert sched.get_num_new_matched_tokens(c, 0) == (3 * BLOCK, False)
        sched.update_state_after_alloc(c, [1, 2, 3, 4, 5, 6], 0)
        plan = sched.build_step([ScheduledRequest("c", [1, 2, 3, 4, 5, 6], True, 0, c.num_tokens)])
        for w in ranks.workers:
            w.bind(plan)
            w.start_load()
            w.wait_for_save()
            w.unbind()
        saved_all()
        w0, w1 = (w.stats_snapshot() for w in ranks.workers)
        assert (w0["saves_discarded"], w0["saves_dropped"]) == (2, 2)
        # c's saves of blocks 3 and 4 came inside the discard's TTL: refused on both ranks.
        assert w0["blocks_refused"] == 2 and w1["blocks_refused"] >= 2
        d = Req("d", list(b.tokens), uid)
        assert sched.get_num_new_matched_tokens(d, 0) == (3 * BLOCK, False), "b's bad blocks were sealed"
        sched.update_state_after_alloc(d, [7, 8, 9, 10, 11, 14], 3 * BLOCK)
        plan = sched.build_step([ScheduledRequest("d", [7, 8, 9, 10, 11, 14], True, 3 * BLOCK, 1)])
        for w in ranks.workers:
            w.bind(plan)
            w.start_load()
            for name in ranks.kvs[0]:
                w.wait_for_layer_load(name)
            w.wait_for_save()
            assert w.take_load_errors() == set()
            w.unbind()
        ranks.assert_loaded([7, 8, 9], d)  # before: 5 blocks, rank 1's block 10 the bytes of b's failed step
        sched.close()
    finally:
        if ranks is not None:
            ranks.close()
        client.close()


def test_a_failed_loads_discard_outlasts_a_full_save_queue_and_goes_ahead_of_the_ranks_next_saves():
    """The discard of rank 0 (TP 2) must reach the server before any later save of this rank, or a
    recompute of the prefix could be stored first and then lose to it. A full save queue dropped
    the step's job with it: it is now kept and rides on the next job, sent with that job's saves
    in one Save (the server applies it before planning them). With TP 1 there is no other rank to
    mend: nothing is sent."""
    from types import SimpleNamespace

    from pegaflow.client import PegaflowClient
    from pegaflow.connector.plan import SaveIntent, StepPlan
    from pegaflow.connector.worker_core import WorkerCore, _SaveJob

    bad = [b"\x03" * 16, b"\x04" * 16]
    client = PegaflowClient("127.0.0.1:1")  # never dialled: Save is recorded below
    sent = []

    def save(**kw):
        sent.append(kw)
        return SimpleNamespace(blocks_saved=len(kw["block_ids"]), blocks_skipped=0, blocks_refused=0,
                               blocks_not_admitted=0, blocks_discarded=len(kw["discard_hashes"]))

    client.save = save
    try:
        for tp_size in (2, 1):
            w = WorkerCore(client, instance_id="i", namespace="n", tp_rank=0, tp_size=tp_size, save_queue_depth=1)
            w.registration = SimpleNamespace(connected=True, stats=dict)
            w._failed_loads.add("b")
            w._queue.put_nowait(_SaveJob(None, [], 0))  # the queue is full
            w.bind(StepPlan(saves=[SaveIntent("b", [12, 13], bad, ("b",))]))
            w.wait_for_save()  # b's save dropped; its discard cannot be queued
            w.unbind()
            w._queue.get_nowait()
            w.bind(StepPlan(saves=[SaveIntent("c", [5], [b"\x05" * 16])]))
            w.wait_for_save()
            w.unbind()
            job = w._queue.get_nowait()
            assert [s.request_id for s in job.intents] == ["c"]
            assert job.discard == (bad if tp_size > 1 else [])
            w._save(job)
            assert sent.pop()["discard_hashes"] == (bad if tp_size > 1 else [])
            stats = w.stats_snapshot()
            assert stats.get("saves_discarded", 0) == stats.get("blocks_discarded", 0) == (2 if tp_size > 1 else 0)
            assert stats["saves_dropped"] == 2 and stats["saves"] == 1
    finally:
        client.close()
