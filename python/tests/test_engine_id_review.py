"""One instance, one engine, seen from the engine that is refused: a second engine given the
same `pegaflow.instance_id` (or one restarted with a new engine id while the server still holds
its old incarnation's instance) has its workers refused "... is registered by another engine",
but its scheduler-side connector registers nothing and keeps querying and loading that instance
id. Its queries, Loads and Saves carry its engine id, so the server refuses them too: no lease
on the first engine's blocks, no load (scheduler- or query-issued) copied into the first
engine's memory at the second engine's block ids; the second engine computes its requests, the
refusal a miss like any failed query, said once.

A second engine without an engine id (a config that has none registers and sends ""; the
server checks nothing) is not caught at its requests: a Load its scheduler issued
(pegaflow.load_issuer=scheduler) still copies into the first engine's memory, and the refused
worker must not take it for its own KV; with worker-issued loads its worker sends no Load, and
must give the query's lease back rather than pin the first engine's blocks."""

from __future__ import annotations

import threading
from typing import List, Optional

import grpc
import numpy as np
import pytest

from pegaflow.client import PegaflowClient
from pegaflow.errors import PegaflowError
from pegaflow.hashes import synthetic_tokens
from pegaflow.load_state import STATE_REJECTED, LoadState

from kv_helpers import fill, make_kv, matches, register
from vllm_driver import BLOCK, Engine, Request, saved_prompt, vllm_config

MODES = ["layerwise", "async"]
SCHED = {"pegaflow.load_issuer": "scheduler", "pegaflow.reconnect_max_ms": 200}
QUERY = {"pegaflow.load_issuer": "query", "pegaflow.staging_blocks": 8, "pegaflow.reconnect_max_ms": 200}
#: (mode, extra config) of the loads the second engine's scheduler side issues.
SCHEDULER_SIDE = [("layerwise", SCHED), ("async", SCHED), ("layerwise", QUERY)]
SCHEDULER_SIDE_IDS = ["layerwise-scheduler", "async-scheduler", "layerwise-query"]


def config(addr: str, mode: str, engine_id: Optional[str], model: str, instance: str, extra: dict):
    """An engine's config under `instance`; `engine_id` None: the config has none (registers "")."""
    cfg = vllm_config(addr, engine_id or "unused", model, mode, **extra, **{"pegaflow.instance_id": instance})
    if engine_id is None:
        cfg.kv_transfer_config.engine_id = None  # after the stand-in's __post_init__ made one
    return cfg


@pytest.fixture
def two_engines(server, uid):
    made = []

    def make(mode: str, engine_id: Optional[str], instance: str, extra: dict = SCHED) -> Engine:
        e = Engine(config(server.addr, mode, engine_id, "tiny-" + uid, instance, extra))
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def memory(e: Engine) -> List[bytes]:
    """Every byte of `e`'s KV cache and of its worker's staging blocks (when it has some)."""
    out = [e.region.numpy(np.uint8, (e.region.nbytes,)).tobytes()]
    staging = e.worker._w().staging
    if staging is not None:
        out += [t.numpy().tobytes() for t in staging.tensors.values()]
    return out


def refused_second(make, mode: str, uid: str, extra: dict, second_id: Optional[str]) -> "tuple[Engine, Engine]":
    first = make(mode, "first-" + uid, uid, extra)
    assert first.worker._w().registration.connected
    second = make(mode, second_id, uid, extra)
    reg = second.worker._w().registration
    assert not reg.connected and "is registered by another engine" in (reg.last_error or "")
    return first, second


@pytest.mark.parametrize("mode,extra", SCHEDULER_SIDE, ids=SCHEDULER_SIDE_IDS)
def test_another_engines_scheduler_and_query_issued_loads_leave_the_first_engines_blocks_alone(
    two_engines, uid, mode, extra, caplog
):
    first, second = refused_second(two_engines, mode, uid, extra, "second-" + uid)
    prompt, used = saved_prompt(first, 41, uid)  # the first engine's saves: what the second asks for
    before = memory(first)
    reqs = [
        Request(rid, list(prompt) + synthetic_tokens(seed, 2 * BLOCK), salt=uid) for rid, seed in (("b", 42), ("c", 43))
    ]
    with caplog.at_level("ERROR", logger="pegaflow.connector"):
        got = [second.run_prefill(req, avoid=used) for req in reqs]  # no exception into its steps
    # Before, its scheduler found the first engine's blocks and the copy went to the instance's
    # memory (the first engine's) at the second engine's block ids.
    changed = [i for i, (was, now) in enumerate(zip(before, memory(first))) if was != now]
    assert not changed, f"the other engine's loads landed in the first engine's memory (regions {changed})"
    assert got == [0, 0], "its queries are refused: a miss"
    for req in reqs:
        assert second.holds_all(req, req.num_tokens), "recomputed"
    stats = second.sched.pegaflow_stats()
    # (vLLM's driver probes each request twice, and a failed query is not cached.)
    assert stats["query_other_engine"] == stats["query_errors"] >= 2, stats
    assert [stats.get(k, 0) for k in ("hit_blocks", "loads_issued", "query_loads")] == [0, 0, 0], stats
    assert second.worker.pegaflow_stats().get("load_failures", 0) == 0  # nothing was sent to fail
    said = [r.getMessage() for r in caplog.records if r.name == "pegaflow.connector"]
    said = [m for m in said if "queries are refused" in m]
    assert len(said) == 1 and f"engine_id 'second-{uid}'" in said[0], caplog.messages
    assert "is registered by another engine" in said[0] and f'this request\'s "second-{uid}"' in said[0]
    # The first engine still hits its own blocks.
    again = Request("a2", list(prompt) + [1, 2], salt=uid)
    assert first.run_prefill(again, avoid=used) == 5 * BLOCK


@pytest.mark.parametrize("mode", MODES)
def test_without_an_engine_id_a_refused_worker_does_not_take_a_scheduler_issued_load(two_engines, uid, mode):
    """A second engine whose config has no engine id sends "" (not checked): its scheduler's
    Load is still copied into the first engine's memory, and its refused worker must not
    compute over KV that never landed in its own."""
    first, second = refused_second(two_engines, mode, uid, SCHED, None)
    prompt, used = saved_prompt(first, 41, uid)
    req = Request("b", list(prompt) + synthetic_tokens(42, 2 * BLOCK), salt=uid)
    second.run_prefill(req, avoid=used)
    assert second.sched.pegaflow_stats()["loads_issued"] >= 1
    assert second.invalid_blocks >= set(req.block_ids[:5]), second.invalid_blocks
    assert second.holds_all(req, req.num_tokens), "the second engine computed over KV that never landed"
    assert second.worker.pegaflow_stats()["load_failures"] >= 1


@pytest.fixture
def http_server():
    """A server of this test's own with /metrics (the session's has no HTTP listener)."""
    from server_proc import ServerProc

    s = ServerProc.start(extra=["--http-addr", "127.0.0.1:0"])
    yield s
    s.stop()


@pytest.mark.parametrize("second_id", ["second", None], ids=["engine-id", "no-engine-id"])
@pytest.mark.parametrize("mode", MODES)
def test_a_refused_engine_leaves_no_lease_on_the_first_engines_blocks(http_server, uid, mode, second_id):
    """Worker-issued loads (the default). With an engine id, the second engine's queries are
    refused before a lease is taken. Without one ("" is not checked), its scheduler leases the
    first engine's blocks; its worker, not registered, sends no Load and must give the lease
    back rather than leave those blocks pinned in the shared pool for the lease's TTL (10
    minutes) at every such request."""
    from server_proc import leases_become

    extra = {"pegaflow.reconnect_max_ms": 200}
    made = []
    try:
        made.append(Engine(config(http_server.addr, mode, "first-" + uid, "tiny-" + uid, uid, extra)))
        made.append(Engine(config(http_server.addr, mode, second_id and second_id + uid, "tiny-" + uid, uid, extra)))
        first, second = made
        assert not second.worker._w().registration.connected
        prompt, used = saved_prompt(first, 43, uid)
        leases_become(http_server, 0)
        req = Request("b", list(prompt) + [1, 2], salt=uid)
        n = second.run_prefill(req, avoid=used)
        assert second.holds_all(req, req.num_tokens)  # recomputed
        stats, wstats = second.sched.pegaflow_stats(), second.worker.pegaflow_stats()
        if second_id is None:
            assert stats["hit_blocks"] >= 5  # the scheduler found them
            assert second.invalid_blocks == set(req.block_ids[:5])
            leases_become(http_server, 0, timeout_s=5)
            assert wstats["leases_given_back"] == 1
        else:
            assert n == 0 and stats.get("hit_blocks", 0) == 0 and stats["query_other_engine"] >= 1, stats
            assert http_server.metric("pegaflow_leases") == 0, "no lease was taken for the other engine"
            assert wstats.get("leases_given_back", 0) == 0 and not second.invalid_blocks
    finally:
        for e in made:
            e.close()


def test_the_client_sends_the_engine_id_with_save_query_and_load(server, client, uid):
    """PegaflowClient's save, query_prefetch, load and load_nowait carry `engine_id`: another
    engine's is refused naming both ids, before the store or the lease is touched; the engine's
    own (and "") go through."""
    region, kv = make_kv(2, 8)
    mine, other = "first-" + uid, "second-" + uid
    owner = PegaflowClient(server.addr, rpc_timeout_ms=10_000, engine_id=mine)  # the rank registers with it
    reg = register(owner, kv, uid, "ns-" + uid)

    def refused(call, *args, **kw) -> str:
        with pytest.raises(PegaflowError) as e:
            call(*args, **kw)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
        assert f'its engine_id "{mine}", this request\'s "{other}"' in e.value.details, e.value.details
        return e.value.details

    try:
        h = [b"\x11" * 16]
        fill(kv, [1], h)
        save = dict(instance_id=uid, tp_rank=0, block_ids=[1], block_hashes=h)
        assert refused(client.save, **save, engine_id=other).startswith("Save (tp_rank 0 pp_rank 0)")
        assert client.query_prefetch(instance_id=uid, block_hashes=h, request_id="q0").hits == 0, "nothing saved"
        assert client.save(**save, engine_id=mine).blocks_saved == 1
        ask = dict(instance_id=uid, block_hashes=h, request_id="q1")
        assert 'request "q1"' in refused(client.query_prefetch, **ask, engine_id=other)
        q = client.query_prefetch(**ask, engine_id=mine)
        assert q.hits == 1
        with LoadState.create() as st:
            load = dict(instance_id=uid, tp_rank=0, lease_id=q.lease_id, block_ids=[6], load_state_shm=st.name)
            refused(client.load, **load, request_id="l1", engine_id=other)
            assert st.state == STATE_REJECTED  # as any refused Load marks its load state
            answered, errs = threading.Event(), []
            client.load_nowait(**load, engine_id=other, on_done=lambda e: (errs.append(e), answered.set()))
            assert answered.wait(10)
            assert errs[0] is not None and f'this request\'s "{other}"' in errs[0].details, errs
            st.rearm()
            client.load(**load, engine_id=mine)  # the lease was left as it was
            st.wait_all(timeout_s=30)
        assert matches(kv, [6], h) == []
    finally:
        reg.close()
        owner.close()
        region.close()
