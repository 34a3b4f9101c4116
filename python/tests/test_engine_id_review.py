"""One instance, one engine, seen from the engine that is refused: a second engine given the
same `pegaflow.instance_id` (or one restarted with a new engine id while the server still holds
its old incarnation's instance) has its workers refused "... is registered by another engine",
but its scheduler-side connector registers nothing and keeps querying and loading that instance
id. A Load its scheduler issued (pegaflow.load_issuer=scheduler) copies into the *other* engine's
memory: the refused worker must not take it for its own KV. With worker-issued loads its worker
sends no Load, and must give the query's lease back rather than pin the other engine's blocks."""

from __future__ import annotations

import pytest

from pegaflow.hashes import synthetic_tokens

from vllm_driver import BLOCK, Engine, Request, saved_prompt, vllm_config

MODES = ["layerwise", "async"]
SCHED = {"pegaflow.load_issuer": "scheduler", "pegaflow.reconnect_max_ms": 200}


@pytest.fixture
def two_engines(server, uid):
    made = []

    def make(mode: str, engine_id: str, instance: str) -> Engine:
        cfg = vllm_config(server.addr, engine_id, "tiny-" + uid, mode, **SCHED, **{"pegaflow.instance_id": instance})
        e = Engine(cfg)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_worker_does_not_take_a_scheduler_issued_load_into_the_other_engines_memory(
    two_engines, uid, mode
):
    first = two_engines(mode, "first-" + uid, uid)
    assert first.worker._w().registration.connected
    second = two_engines(mode, "second-" + uid, uid)
    reg = second.worker._w().registration
    assert not reg.connected and "is registered by another engine" in (reg.last_error or "")

    prompt, used = saved_prompt(first, 41, uid)  # the first engine's saves: hits for the second
    req = Request("b", list(prompt) + synthetic_tokens(42, 2 * BLOCK), salt=uid)
    second.run_prefill(req, avoid=used)
    # Its scheduler found the first engine's blocks and sent the Load; the bytes went to the
    # first engine's memory (the instance's), so the second's blocks must be recomputed.
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


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_worker_gives_the_lease_of_the_load_it_cannot_send_back(http_server, uid, mode):
    """Worker-issued loads (the default): the refused engine's scheduler still queries the instance
    id and leases the first engine's blocks; its worker, not registered, sends no Load, and must
    give the lease back rather than leave those blocks pinned in the shared pool for the lease's
    TTL (10 minutes) at every such request."""
    from server_proc import leases_become

    extra = {"pegaflow.instance_id": uid, "pegaflow.reconnect_max_ms": 200}
    made = []
    try:
        made.append(Engine(vllm_config(http_server.addr, "first-" + uid, "tiny-" + uid, mode, **extra)))
        made.append(Engine(vllm_config(http_server.addr, "second-" + uid, "tiny-" + uid, mode, **extra)))
        first, second = made
        assert not second.worker._w().registration.connected
        prompt, used = saved_prompt(first, 43, uid)
        leases_become(http_server, 0)
        req = Request("b", list(prompt) + [1, 2], salt=uid)
        second.run_prefill(req, avoid=used)
        assert second.sched.pegaflow_stats()["hit_blocks"] >= 5  # the scheduler found them
        assert second.invalid_blocks == set(req.block_ids[:5])
        assert second.holds_all(req, req.num_tokens)  # recomputed
        leases_become(http_server, 0, timeout_s=5)
        assert second.worker.pegaflow_stats()["leases_given_back"] == 1
    finally:
        for e in made:
            e.close()
